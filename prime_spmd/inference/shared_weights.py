"""Colocated mode with one trainer rank: the engine reads the trainer's frozen weights in place.

A frozen trainer parameter (``requires_grad=False``) held in the engine's dtype never changes, so the engine needs no
copy of it: ``share_frozen_weights`` re-points the engine model's parameter at the trainer's tensor (for an FSDP2
parameter on a one-rank mesh, its local shard is the whole tensor) and the engine's own copy is freed. What is shared
with LoRA: every weight the adapters leave alone (embeddings, norms, LM head, the linears no adapter targets, and the
stacked MoE experts, which adapters never target). What stays a copy, and why (docs/memory.md):

- weights that train (full fine-tuning's fp32 masters): the engine decodes bf16, so it holds a cast copy, refreshed
  at each weight sync;
- a LoRA-adapted linear's weight: the engine runs W0 + scale * B @ A merged;
- a weight the engine has packed into a fused tensor (qkv, gate/up: ``runner.fuse_linears``) when its
  neighbours in that tensor cannot be shared.

Call it before the engine captures CUDA graphs (a graph holds the addresses it was captured with).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from prime_spmd.distributed.fsdp import unwrapped_name


@dataclass(kw_only=True, slots=True)
class SharingReport:
    shared_bytes: int = 0
    """Engine weight bytes that are the trainer's tensors (no copy)."""
    owned_bytes: int = 0
    """Engine weight bytes it holds itself (see the module docstring for why)."""
    shared: int = 0
    owned: int = 0
    lora_base: dict[str, torch.Tensor] | None = None
    """The trainer's frozen base weight W0 of each LoRA-adapted linear, by name: what the engine merges its adapters
    into (read in place, not cloned)."""


def _local(p: torch.Tensor) -> torch.Tensor:
    """The rank's shard of an FSDP2 DTensor parameter: on a one-rank mesh, the whole tensor (no collective; no
    grad flows: the tensor is frozen and the engine reads it under no_grad)."""
    return p.to_local() if hasattr(p, "to_local") else p


@torch.no_grad()
def share_frozen_weights(engine_model: nn.Module, trainer_lm: nn.Module) -> SharingReport:
    """Re-point each engine parameter whose trainer twin (same name, wrappers removed) is frozen, of the same dtype
    and shape, at the trainer's tensor (on the trainer's device: an engine model read to the host then moves only
    what it owns; a parameter still on meta is replaced by one that aliases the trainer's tensor). Parameters the
    engine fused into a larger tensor (their ``.data`` is a view of it) keep their copy. Single process; one trainer
    rank only (a shard of a larger mesh is not the whole tensor)."""
    trainer = {unwrapped_name(n): p for n, p in trainer_lm.named_parameters()}
    adapted = {unwrapped_name(n) + ".weight" for n, m in trainer_lm.named_modules() if hasattr(m, "lora_A")}
    report = SharingReport(lora_base={n: _local(trainer[n]) for n in adapted if n in trainer})
    for name, p in list(engine_model.named_parameters()):
        t = trainer.get(name)
        src = _local(t) if t is not None else None
        ok = (
            t is not None
            and name not in adapted
            and not t.requires_grad
            and src.shape == p.shape
            and src.dtype == p.dtype
            and p.untyped_storage().nbytes() == p.numel() * p.element_size()  # not a slice of a fused tensor
        )
        nbytes = p.numel() * p.element_size()
        if ok and p.is_meta:  # built on meta (--model.random_init): a meta parameter's data cannot be re-pointed
            module, _, leaf = name.rpartition(".")
            setattr(engine_model.get_submodule(module), leaf, nn.Parameter(src, requires_grad=p.requires_grad))
        elif ok:
            p.data = src
        if ok:
            report.shared_bytes += nbytes
            report.shared += 1
        else:
            report.owned_bytes += nbytes
            report.owned += 1
    return report
