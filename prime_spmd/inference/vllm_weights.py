"""Weights going into vLLM's model: HF names from the trainer's wrapped parameter names, copied out of the
receiver's staging buffer, and the re-processing of tied layers that vLLM 0.32's layerwise reload skips.
Called by the vLLM worker extension (vllm_engine.WeightLoadExtension), on every inference rank."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# Prefixes that torch wrappers put in front of HF parameter names (torch.compile, activation
# checkpointing, FSDP1, DDP). vLLM's ``load_weights`` expects the checkpoint's own names.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")


def normalize_weight_name(name: str) -> str:
    """The HF checkpoint name of a parameter: wrapper prefixes (compile, checkpointing, DDP) removed.

    vLLM's ``model.load_weights`` maps HF names onto its fused parameters itself (q/k/v -> qkv_proj,
    gate/up -> gate_up_proj, tied lm_head skipped), so no other mapping happens here.
    """
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
        name = name.replace("._orig_mod.", ".").replace("._checkpoint_wrapped_module.", ".")
    return name


def normalize_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Lazily apply ``normalize_weight_name`` to (name, tensor) pairs and copy each tensor.

    The copy is needed: during a layerwise reload vLLM keeps the tensors of a layer whose weights
    are not all loaded yet until the rest arrive, and our weight receiver reuses one staging buffer
    for every bucket (a layer's weights may span two buckets). Peak extra memory: one bucket plus
    the pending weights of the layers cut by bucket boundaries.
    """
    for name, tensor in weights:
        yield normalize_weight_name(name), tensor.detach().clone()


def reprocess_tied_layers(model: torch.nn.Module) -> list[str]:
    """Re-run weight processing of every layer whose weight is shared with another layer; return their names.

    vLLM 0.32's layerwise reload processes a tied weight only through the layer that owns it
    (vllm/model_executor/model_loader/reload/__init__.py, "Limitations" 2): with tied embeddings the
    new values reach ``embed_tokens.weight`` (and so the shared ``lm_head.weight``), but the state the
    lm_head's quant method derived from it at start-up stays old. On the CPU build that state is a
    packed GEMM handle (``dispatch_cpu_unquantized_gemm``), so the lm_head kept computing logits with
    the initial weights: mismatch KL 0.15 after an update of a tiny Qwen3, measured 2026-12-03. On
    CUDA the unquantized embedding method derives nothing and this is a no-op.
    """
    # Only the unquantized embedding method: its processing reads the (already reloaded) weight and
    # derives the GEMM handle again. A quantized method's processing is not idempotent on its output.
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(weight, torch.Tensor)
            and weight.numel() > 0
            and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod)
        ):
            owners.setdefault(weight.data_ptr(), []).append((name, module))
    done = []
    for group in owners.values():
        if len(group) < 2:
            continue
        for name, module in group:
            module.quant_method.process_weights_after_loading(module)
            done.append(name)
    return done
