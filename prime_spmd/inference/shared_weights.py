"""Colocated mode with one trainer rank: the engine reads the trainer's weights in place.

A trainer parameter held in the engine's dtype that never changes (frozen, ``requires_grad=False``), or that the
optimizer updates in place in that dtype (``--trainer.offload master``: the fp32 masters live on the host and each step
writes the new weights, cast, into the parameters), needs no engine copy: ``share_weights`` re-points the engine model's
parameter at the trainer's tensor (for an FSDP2 parameter on a one-rank mesh, its local shard is the whole tensor) and
the engine's own copy is freed. What is shared with LoRA: every weight the adapters leave alone (embeddings, norms, LM
head, the linears no adapter targets, and the stacked MoE experts, which adapters never target); with the masters on
the host, every weight. What stays a copy, and why (docs/memory.md):

- weights that train as fp32 masters on the device (full fine-tuning's default): the engine decodes bf16, so it holds a
  cast copy, refreshed at each weight sync;
- a LoRA-adapted linear's weight: the engine runs W0 + scale * B @ A merged;
- a frozen weight the engine has packed into a fused tensor (qkv, gate/up: ``runner.fuse_linears``) when its
  neighbours in that tensor cannot be shared. Weights trained in place go the other way: once the engine has fused
  them, the trainer's parameters are re-pointed at their slices of the fused tensor (``tie_fused``), so the optimizer's
  in-place update lands where the engine reads.

Call both before the engine captures CUDA graphs (a graph holds the addresses it was captured with).
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
def share_weights(engine_model: nn.Module, trainer_lm: nn.Module, trained_in_place: bool = False) -> SharingReport:
    """Re-point each engine parameter whose trainer twin (same name, wrappers removed) is frozen (or, with
    ``trained_in_place``, trained in place: ``--trainer.offload master``), of the same dtype and shape, at the
    trainer's tensor (on the trainer's device: an engine model read to the host then moves only what it owns; a
    parameter still on meta is replaced by one that aliases the trainer's tensor). Parameters the engine fused into a
    larger tensor (their ``.data`` is a view of it) keep their copy. Single process; one trainer rank only (a shard of
    a larger mesh is not the whole tensor)."""
    trainer = {unwrapped_name(n): p for n, p in trainer_lm.named_parameters()}
    adapted = {unwrapped_name(n) + ".weight" for n, m in trainer_lm.named_modules() if hasattr(m, "lora_A")}
    report = SharingReport(lora_base={n: _local(trainer[n]) for n in adapted if n in trainer})
    for name, p in list(engine_model.named_parameters()):
        t = trainer.get(name)
        src = _local(t) if t is not None else None
        ok = (
            t is not None
            and name not in adapted
            and (trained_in_place or not t.requires_grad)
            and src.shape == p.shape
            and src.dtype == p.dtype
            and p.untyped_storage().nbytes() == p.numel() * p.element_size()  # not a slice of a fused tensor
        )
        if ok and p.is_meta:  # built on meta (--model.random_init): a meta parameter's data cannot be re-pointed
            module, _, leaf = name.rpartition(".")
            setattr(engine_model.get_submodule(module), leaf, nn.Parameter(src, requires_grad=p.requires_grad))
        elif ok:
            p.data = src
    return report


def count_shared(engine_model: nn.Module, trainer_lm: nn.Module, report: SharingReport) -> SharingReport:
    """Fill ``report``'s counts from what the built engine holds: a parameter is shared when its storage is a trainer
    parameter's (after the engine's fusing and ``tie_fused``), else the engine's own."""
    storages = {_local(p).untyped_storage().data_ptr() for p in trainer_lm.parameters()}
    report.shared_bytes = report.owned_bytes = report.shared = report.owned = 0
    for p in engine_model.parameters():
        nbytes = p.numel() * p.element_size()
        if not p.is_meta and p.untyped_storage().data_ptr() in storages:
            report.shared_bytes += nbytes
            report.shared += 1
        else:
            report.owned_bytes += nbytes
            report.owned += 1
    return report


@torch.no_grad()
def tie_fused(engine_model: nn.Module, trainer_lm: nn.Module) -> int:
    """After the engine fused its linears (``runner.fuse_linears``: the q/k/v and gate/up weights became slices of one
    tensor, filled from the trainer's shared tensors), re-point each trainer parameter that is trained in place
    (``--trainer.offload master``) at its engine twin's slice, when that is a slice of a larger tensor of the same
    dtype and shape: the trainer's own tensor is freed and the optimizer's in-place update lands in the fused tensor
    the engine reads. Returns the bytes the engine no longer holds apart from the trainer."""
    trainer = {unwrapped_name(n): p for n, p in trainer_lm.named_parameters()}
    tied = 0
    for name, p in engine_model.named_parameters():
        t = trainer.get(name)
        if t is None or not t.requires_grad or hasattr(t, "to_local"):  # frozen twins stay shared as they are
            continue
        fused = p.untyped_storage().nbytes() > p.numel() * p.element_size()
        if fused and t.shape == p.shape and t.dtype == p.dtype and t.data_ptr() != p.data_ptr():
            t.data = p.data
            tied += p.numel() * p.element_size()
    return tied
