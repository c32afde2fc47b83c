"""Build the configured inference engine (``--inference.engine``)."""

from __future__ import annotations

import time

import torch

from prime_spmd.config.sections import InferenceConfig, ModelConfig
from prime_spmd.inference.engine import InferenceEngine
from prime_spmd.inference.native import NativeEngine
from prime_spmd.inference.runner import fused_prefill_choice
from prime_spmd.log import logger
from prime_spmd.models.loading import load_model, load_tokenizer, resolve_dtype

NATIVE_ONLY = (
    "decode_attention",
    "decode_linear",
    "sampler",
    "warmup",
    "kv_cache",
    "kv_block_size",
    "kv_cache_tokens",
    "pdl",
    "fused_prefill",
    "decode_steps_per_launch",
)


def native_only_settings(inference_cfg: InferenceConfig) -> dict[str, object]:
    """The native-engine-only fields of ``inference_cfg`` set away from their defaults (vLLM ignores them)."""
    default = InferenceConfig()
    return {f: getattr(inference_cfg, f) for f in NATIVE_ONLY if getattr(inference_cfg, f) != getattr(default, f)}


def build_engine(
    inference_cfg: InferenceConfig,
    model_cfg: ModelConfig,
    device: torch.device,
    seq_len: int,
    *,
    tp: int = 1,
    seed: int = 0,
) -> InferenceEngine:
    """Load the model and tokenizer of ``model_cfg`` and wrap them in the configured engine.

    ``seq_len`` is the KV-cache length per sequence unless ``--inference.max_model_len`` is set.
    Both engines run in bfloat16 on CUDA and float32 on CPU unless ``--model.dtype`` says otherwise.
    ``tp`` (``--topology.engine_tp``) is the vLLM engine's tensor-parallel size; the native engine
    refuses tp > 1. vLLM: collective over the inference default process group (every inference rank
    calls this at the same point with the same ``seed``; see ``build_vllm_engine``).
    """
    max_len = inference_cfg.max_model_len or seq_len
    if inference_cfg.engine == "vllm":
        from prime_spmd.inference.vllm_engine import build_vllm_engine

        ignored = native_only_settings(inference_cfg)
        if ignored:
            logger.warning(f"--inference.engine=vllm ignores the native engine's settings {ignored}")

        return build_vllm_engine(model_cfg, inference_cfg, device=device, tp=tp, seed=seed, max_model_len=max_len)
    if tp != 1:
        raise ValueError(f"--topology.engine_tp={tp} needs --inference.engine=vllm (the native engine runs tp 1)")
    dtype = resolve_dtype(model_cfg.dtype, device)
    model = load_model(model_cfg, device, dtype)
    engine = NativeEngine(
        model,
        load_tokenizer(model_cfg),
        max_batch_size=inference_cfg.max_batch_size,
        max_model_len=max_len,
        device=device,
        cuda_graphs=inference_cfg.cuda_graphs,
        decode_attention=inference_cfg.decode_attention,
        decode_linear=inference_cfg.decode_linear,
        sampler=inference_cfg.sampler,
        kv_cache=inference_cfg.kv_cache,
        kv_block_size=inference_cfg.kv_block_size,
        kv_cache_tokens=inference_cfg.kv_cache_tokens,
        pdl=inference_cfg.pdl,
        fused_prefill=fused_prefill_choice(inference_cfg.fused_prefill),
        decode_steps_per_launch=inference_cfg.decode_steps_per_launch,
    )
    warm = inference_cfg.warmup
    if warm == "on" or (warm == "auto" and engine.use_graphs):
        t0 = time.perf_counter()
        logger.info("native engine warm-up: compiling and capturing the decode step of every batch/length bucket")
        n = engine.warmup()
        logger.info(f"native engine warm-up: {n} decode variants compiled/captured in {time.perf_counter() - t0:.1f} s")
    return engine
