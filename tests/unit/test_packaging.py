"""Our top-level `kernels` package must not make transformers think HF's `kernels` is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_transformers_does_not_use_our_kernels_package() -> None:
    code = (
        "import kernels, importlib.metadata as md\n"
        f"assert kernels.__file__.startswith({str(ROOT / 'kernels')!r}), kernels.__file__\n"  # ours is importable...
        "from transformers.utils import import_utils as iu\n"
        "assert not iu.is_kernels_available(), 'transformers thinks HF kernels is installed'\n"
        "try:\n    md.version('kernels')\n    raise SystemExit('a kernels distribution is installed')\n"
        "except md.PackageNotFoundError:\n    pass\n"
        "from transformers import AutoModelForCausalLM\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
