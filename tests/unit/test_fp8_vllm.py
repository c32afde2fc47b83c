"""``--inference.quantization fp8`` with ``--inference.engine vllm``: vLLM's own ``quantization="fp8"`` reaches
``vllm.LLM`` (a fake vllm module on a non-CPU platform records the keyword arguments; no vLLM needed), and is refused
where vLLM cannot run it (its CPU build, float32 weights; the real CPU build: tests/vllm_venv/test_vllm_fp8.py)."""

from __future__ import annotations

import types

import pytest
import torch

from prime_spmd.config.sections import InferenceConfig, ModelConfig
from prime_spmd.inference import vllm_engine
from prime_spmd.inference.vllm_engine import build_llm_kwargs, check_vllm_fp8
from prime_spmd.models.tiny import build_char_tokenizer, build_tiny_model


def test_llm_kwargs_pass_quantization_only_when_set():
    assert build_llm_kwargs(model_path="/m", quantization="fp8")["quantization"] == "fp8"
    assert "quantization" not in build_llm_kwargs(model_path="/m")


def test_build_vllm_engine_hands_fp8_to_llm(monkeypatch, tmp_path):
    calls = []

    class RecordingLLM:
        def __init__(self, **kwargs):
            calls.append(kwargs)

    fake = types.SimpleNamespace(__version__="0.32.0", LLM=RecordingLLM, SamplingParams=dict, TokensPrompt=dict)
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: fake)
    monkeypatch.setattr(vllm_engine, "vllm_platform_is_cpu", lambda: False)  # as on CUDA
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):  # build_vllm_engine sets them: restored
        monkeypatch.setenv(var, "1")
    path = build_tiny_model(tmp_path / "m")
    for quantization in ("fp8", "none"):
        engine = vllm_engine.build_vllm_engine(
            ModelConfig(path=str(path), dtype="bfloat16"), InferenceConfig(engine="vllm", quantization=quantization),
            device=torch.device("cpu"), tokenizer=build_char_tokenizer(),
        )  # fmt: skip
        assert isinstance(engine.llm, RecordingLLM)
    assert calls[0]["quantization"] == "fp8" and "quantization" not in calls[1]


def test_fp8_is_refused_on_the_cpu_build_and_with_float32_weights():
    check_vllm_fp8("bfloat16", platform_is_cpu=False)
    check_vllm_fp8("float16", platform_is_cpu=False)
    with pytest.raises(ValueError, match=r"--inference\.quantization fp8 .*vLLM 0\.32\.0's CPU build.*engine native"):
        check_vllm_fp8("bfloat16", platform_is_cpu=True)
    with pytest.raises(ValueError, match=r"--inference\.quantization fp8 .*resolves to float32: set --model\.dtype"):
        check_vllm_fp8("float32", platform_is_cpu=False)
