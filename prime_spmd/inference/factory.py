"""Build the configured inference engine (``--inference.engine``)."""

from __future__ import annotations

import time
from typing import Any

import torch

from prime_spmd.config.sections import InferenceConfig, ModelConfig, NativeEngineConfig
from prime_spmd.inference.engine import InferenceEngine
from prime_spmd.inference.native import NativeEngine
from prime_spmd.inference.runner import prefill_choice
from prime_spmd.inference.shared_weights import count_shared, share_weights, tie_fused
from prime_spmd.log import logger
from prime_spmd.models import registry
from prime_spmd.models.loading import load_model, load_tokenizer, materialize_random_init, resolve_dtype
from prime_spmd.models.qwen3.model import set_moe_impl
from prime_spmd.models.vision import load_vision_processor
from prime_spmd.models.vlm import VLM_TYPES


def build_engine(
    inference_cfg: InferenceConfig,
    model_cfg: ModelConfig,
    device: torch.device,
    seq_len: int,
    *,
    tp: int = 1,
    seed: int = 0,
    share_from: torch.nn.Module | None = None,
    tokenizer: Any | None = None,
    share_trained: bool = False,
) -> InferenceEngine:
    """Load the model and tokenizer of ``model_cfg`` and wrap them in the configured engine (the native engine takes
    ``tokenizer``, ``model_cfg``'s already loaded, where given: the colocated trainer's).

    ``seq_len`` is the KV-cache length per sequence unless ``--inference.max_model_len`` is set.
    Both engines run in bfloat16 on CUDA and float32 on CPU unless ``--model.dtype`` says otherwise.
    ``tp`` (``--topology.engine_tp``) is the vLLM engine's tensor-parallel size; the native engine
    refuses tp > 1. vLLM: collective over the inference default process group (every inference rank
    calls this at the same point with the same ``seed``; see ``build_vllm_engine``).

    ``share_from`` (colocated, one trainer rank, native engine): the trainer's LM. The model is read to the host,
    every weight the trainer holds frozen in the engine's dtype becomes the trainer's tensor (``shared_weights.py``),
    and only the rest moves to the device: the device never holds a second copy of a shared weight. ``share_trained``
    (``--trainer.offload master``): the trained weights too, which the optimizer updates in place; once the engine has
    fused its q/k/v and gate/up weights, the trainer's parameters are re-pointed at the fused slices (``tie_fused``). With
    ``--model.random_init`` the model is built on meta instead and only the rest is drawn, on the device: no host copy.
    """
    max_len = inference_cfg.max_model_len or seq_len
    if inference_cfg.engine == "vllm" and model_cfg.random_init:
        raise ValueError("--model.random_init needs --inference.engine native (vLLM reads the weights from disk)")
    if inference_cfg.engine == "vllm":
        from prime_spmd.inference.vllm_engine import build_vllm_engine

        if inference_cfg.native != NativeEngineConfig():
            logger.warning(f"--inference.engine=vllm ignores [inference.native]: {inference_cfg.native}")

        engine = build_vllm_engine(model_cfg, inference_cfg, device=device, tp=tp, seed=seed, max_model_len=max_len)
        if registry.model_type(model_cfg.path) in VLM_TYPES:  # images pass to vLLM as PIL images
            engine.processor = load_vision_processor(model_cfg.path, engine.tokenizer)
        return engine
    if tp != 1:
        raise ValueError(f"--topology.engine_tp={tp} needs --inference.engine=vllm (the native engine runs tp 1)")
    dtype = resolve_dtype(model_cfg.dtype, device)
    lora_base, report = None, None
    if share_from is None:
        model = load_model(model_cfg, device, dtype)
    else:
        model = load_model(model_cfg, torch.device("meta" if model_cfg.random_init else "cpu"), dtype)
        report = share_weights(model, share_from, trained_in_place=share_trained)
        lora_base = report.lora_base
        if model_cfg.random_init:  # what is not the trainer's is drawn on the device, as the trainer drew its own
            materialize_random_init(model, model_cfg, device)
        if registry.use_custom(model_cfg):  # read on the host, it chose the host's MoE kernel
            set_moe_impl(model, "triton" if device.type == "cuda" else "reference")
    native = inference_cfg.native
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_cfg)
    engine = NativeEngine(
        model,
        tokenizer,
        max_batch_size=inference_cfg.max_batch_size,
        max_model_len=max_len,
        device=device,
        cuda_graphs=inference_cfg.cuda_graphs,
        decode_attention=native.decode_attention,
        decode_linear=native.decode_linear,
        sampler=native.sampler,
        kv_cache=native.kv_cache,
        kv_block_size=native.kv_block_size,
        kv_cache_tokens=native.kv_cache_tokens,
        pdl=native.pdl,
        prefill_layer_fn=prefill_choice(native.prefill),
        decode_steps_per_launch=native.decode_steps_per_launch,
        quantization=inference_cfg.quantization,
        lora_base=lora_base,
        exact=model_cfg.exact,
        kv_cache_dtype=inference_cfg.kv_cache_dtype,
    )
    if report is not None:
        if share_trained:  # before any graph capture: graphs hold the fused tensors' addresses
            tie_fused(model, share_from)
        count_shared(model, share_from, report)
        logger.info(
            f"engine weights: {report.shared_bytes / 2**30:.2f} GiB read in place from the trainer ({report.shared} "
            f"tensors), {report.owned_bytes / 2**30:.2f} GiB its own ({report.owned}: trained, LoRA-merged or fused)"
        )
    engine.processor = load_vision_processor(model_cfg.path, tokenizer)
    if native.warmup == "on":
        t0 = time.perf_counter()
        logger.info("native engine warm-up: compiling and capturing the decode step of every batch/length bucket")
        n = engine.warmup()
        logger.info(f"native engine warm-up: {n} decode variants compiled/captured in {time.perf_counter() - t0:.1f} s")
    return engine
