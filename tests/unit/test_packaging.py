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


def test_engine_and_models_import_without_the_cli_stack() -> None:
    """The native engine and the model registry import where tyro is not installed (the GPU machine's image: the
    benchmarks import them directly); a None entry in sys.modules makes any import of tyro fail."""
    code = (
        "import sys\nsys.modules['tyro'] = None\n"
        "import prime_spmd.inference.native, prime_spmd.models.registry\n"
        "assert not any(m.startswith('prime_spmd.config.loader') for m in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
