"""Trainer -> inference weight transfer, in buckets of bounded size, with HF parameter names.

Disjoint mode: every trainer rank gathers one parameter at a time (``full_tensor``, a collective
over the trainer role); trainer rank 0 packs the full tensors, cast to the engine's dtype, into a
flat bucket of at most ``bucket_bytes`` and broadcasts it over the weight bridge; every inference
rank receives the bucket and hands views of it to ``engine.load_weights``. Both sides derive the
same bucket layout from the ``WeightSpec`` sent once at start-up. Peak extra memory: one bucket
plus one gathered parameter, never the whole model.

Colocated mode: the same per-parameter gather, then an in-process copy into the rank's engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from prime_spmd.distributed.groups import Bridge
from prime_spmd.distributed.topology import CONTROLLER_RANK
from prime_spmd.inference.engine import InferenceEngine


@dataclass(frozen=True, slots=True)
class WeightSpec:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    wire_dtype: str

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.wire_dtype)


def hf_named_parameters(lm: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The LM's parameters under their HF names (tied weights once; wrapper prefixes removed)."""
    return [(n.replace("._checkpoint_wrapped_module", ""), p) for n, p in lm.named_parameters()]


def build_spec(lm: nn.Module, wire_dtype: torch.dtype) -> WeightSpec:
    items = hf_named_parameters(lm)
    return WeightSpec(
        names=tuple(n for n, _ in items),
        shapes=tuple(tuple(p.shape) for _, p in items),
        wire_dtype=str(wire_dtype).removeprefix("torch."),
    )


def plan_buckets(spec: WeightSpec, bucket_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket, in order; a parameter larger than a bucket travels alone."""
    item = torch.empty((), dtype=spec.dtype).element_size()
    buckets: list[list[int]] = [[]]
    used = 0
    for i, shape in enumerate(spec.shapes):
        n = item * int(torch.Size(shape).numel())
        if buckets[-1] and used + n > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += n
    return buckets


def _full(p: torch.Tensor) -> torch.Tensor:
    # DTensor -> full tensor: an all-gather over the trainer role's FSDP axis. No grad flows (no_grad).
    return p.full_tensor() if hasattr(p, "full_tensor") else p


class WeightSender:
    """Trainer side. Every trainer rank constructs it and calls ``send``/``copy_to`` at the same points."""

    def __init__(self, lm: nn.Module, wire_dtype: torch.dtype, bucket_bytes: int, rank: int) -> None:
        self.lm, self.rank, self.bucket_bytes = lm, rank, bucket_bytes
        self.spec = build_spec(lm, wire_dtype)
        self.buckets = plan_buckets(self.spec, bucket_bytes)

    @torch.no_grad()
    def send(self, bridge: Bridge | None, device: torch.device) -> float:
        """Broadcast the current weights to the inference ranks; returns seconds spent."""
        t0 = time.perf_counter()
        params = [p for _, p in hf_named_parameters(self.lm)]
        for idx in self.buckets:
            fulls = [_full(params[i]) for i in idx]
            if self.rank != CONTROLLER_RANK:
                continue
            flat = torch.cat([f.detach().to(device=device, dtype=self.spec.dtype).reshape(-1) for f in fulls])
            assert bridge is not None
            bridge.broadcast(flat, src=CONTROLLER_RANK)
        return time.perf_counter() - t0

    @torch.no_grad()
    def copy_to(self, engine: InferenceEngine) -> float:
        """Colocated mode: load the current full weights into this rank's engine in place."""
        t0 = time.perf_counter()
        for name, p in hf_named_parameters(self.lm):
            engine.load_weights([(name, _full(p).detach().to(self.spec.dtype))])
        return time.perf_counter() - t0


class WeightReceiver:
    """Inference side of the weight bridge (every inference rank)."""

    def __init__(self, spec: WeightSpec, bucket_bytes: int, engine: InferenceEngine, device: torch.device) -> None:
        self.spec, self.engine, self.device = spec, engine, device
        self.buckets = plan_buckets(spec, bucket_bytes)

    @torch.no_grad()
    def recv(self, bridge: Bridge) -> float:
        t0 = time.perf_counter()
        for idx in self.buckets:
            sizes = [int(torch.Size(self.spec.shapes[i]).numel()) for i in idx]
            flat = torch.empty(sum(sizes), dtype=self.spec.dtype, device=self.device)
            bridge.broadcast(flat, src=CONTROLLER_RANK)
            views = flat.split(sizes)
            self.engine.load_weights(
                (self.spec.names[i], v.view(self.spec.shapes[i])) for i, v in zip(idx, views)
            )
        return time.perf_counter() - t0
