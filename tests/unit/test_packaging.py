"""Our kernels import as `prime_spmd.kernels`; the bare name `kernels` stays free for Hugging Face's distribution,
which transformers >= 5.25 installs and imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_our_kernels_and_hf_kernels_import_side_by_side() -> None:
    """From the repository root (on sys.path first, as under `python -m prime_spmd`): `import kernels` is never our
    folder, `prime_spmd.kernels` is, and transformers' models import. Where HF's `kernels` is installed (it is with
    transformers >= 5.25), the bare name must resolve to it."""
    code = (
        "import importlib.metadata as md, importlib.util, sys\n"
        f"root = {str(ROOT)!r}\n"
        "import prime_spmd.kernels.lm_logprob.op as op\n"
        "assert op.__file__.startswith(root + '/kernels/'), op.__file__\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "try:\n    hf = md.version('kernels')\nexcept md.PackageNotFoundError:\n    hf = None\n"
        "if hf is not None:\n"
        "    import kernels\n"
        "    assert not (kernels.__file__ or '').startswith(root + '/kernels/'), kernels.__file__\n"
        "else:\n"
        "    assert spec is None or spec.origin is None, spec  # at most a namespace portion, never a regular package\n"
        "from transformers import AutoModelForCausalLM\n"
        "print('ok', hf)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr


def test_engine_and_models_import_without_the_cli_stack() -> None:
    """The native engine and the model registry import where tyro is not installed (the GPU machine's image: the
    benchmarks import them directly); a None entry in sys.modules makes any import of tyro fail."""
    code = (
        "import sys\nsys.modules['tyro'] = None\n"
        "import prime_spmd.inference.native, prime_spmd.models.registry\n"
        "assert not any(m.startswith('prime_spmd.config.loader') for m in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
