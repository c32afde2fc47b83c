"""Build the configured inference engine (``--inference.engine``)."""

from __future__ import annotations

import torch

from prime_spmd.config.sections import InferenceConfig, ModelConfig
from prime_spmd.inference.engine import InferenceEngine


def build_engine(
    inference_cfg: InferenceConfig, model_cfg: ModelConfig, device: torch.device, seq_len: int
) -> InferenceEngine:
    """Load the model and tokenizer of ``model_cfg`` and wrap them in the configured engine.

    ``seq_len`` is the KV-cache length per sequence unless ``--inference.max_model_len`` is set.
    The native engine runs in bfloat16 on CUDA and float32 on CPU unless ``--model.dtype`` says otherwise.
    """
    max_len = inference_cfg.max_model_len or seq_len
    if inference_cfg.engine == "vllm":
        from prime_spmd.inference.vllm_engine import VLLMEngine

        return VLLMEngine.from_config(inference_cfg, model_cfg, max_len)
    from prime_spmd.inference.native import NativeEngine
    from prime_spmd.models.loading import load_model, load_tokenizer, resolve_dtype

    dtype = resolve_dtype(model_cfg.dtype, device)
    model = load_model(model_cfg, device, dtype)
    return NativeEngine(
        model,
        load_tokenizer(model_cfg),
        max_batch_size=inference_cfg.max_batch_size,
        max_model_len=max_len,
        device=device,
        cuda_graphs=inference_cfg.cuda_graphs,
    )
