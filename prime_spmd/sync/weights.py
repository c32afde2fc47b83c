"""Trainer -> inference weight transfer, in buckets of bounded size, with HF parameter names.

Disjoint mode: for each bucket, every trainer rank contributes its FSDP shards of the bucket's
parameters, cast to the engine's dtype, to ONE all-gather over the trainer role (parameters that are
not plain dim-0 shards on a 1-D mesh, e.g. EP experts, fall back to ``full_tensor``); trainer rank 0
reassembles them in parameter order into a flat bucket of at most ``bucket_bytes`` and broadcasts it
over the weight bridge; every inference rank receives the bucket and hands views of it to
``engine.load_weights``. Both sides derive the same bucket layout from the ``WeightSpec`` sent once
at start-up. Staging buffers are allocated once per sync and reused by every bucket of it (fresh
host allocations cost page faults on every bucket); peak extra memory on trainer rank 0 is about
two buckets plus one bucket / trainer ranks, never the whole model.

Colocated mode: the same per-bucket gather, then an in-process copy into the rank's engine (one
``load_weights`` call per sync; with one trainer rank, straight from the parameters).

LoRA (the LM has ``LoraLinear`` modules, docs/lora.md): the spec lists the adapter tensors only
(``lora_scale`` > 0), so only they travel, by the same buckets, into ``engine.load_lora_weights``; how the engine
takes them (merged into its base weights, or its own LoRA layers) is the engine's business. Every update ends with
``engine.finish_weight_update``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from prime_spmd.distributed.fsdp import unwrapped_name
from prime_spmd.distributed.groups import Bridge
from prime_spmd.distributed.topology import CONTROLLER_RANK
from prime_spmd.models.lora import is_adapter, lora_scale

if TYPE_CHECKING:  # annotations only: distributed/ does not import inference/ at run time
    from prime_spmd.inference.engine import InferenceEngine


@dataclass(frozen=True, slots=True)
class WeightSpec:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    wire_dtype: str
    lora_scale: float = 0.0
    """alpha / rank when the tensors are LoRA adapters to merge on the receiving side; 0: full weights."""

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.wire_dtype)


def hf_named_parameters(lm: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The LM's parameters under their HF names (tied weights once; wrapper prefixes removed)."""
    return [(unwrapped_name(n), p) for n, p in lm.named_parameters()]


def synced_parameters(lm: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """What a weight sync sends: every parameter, or with LoRA only the adapters (HF-style names)."""
    items = hf_named_parameters(lm)
    return [(n, p) for n, p in items if is_adapter(n)] if lora_scale(lm) else items


def build_spec(lm: nn.Module, wire_dtype: torch.dtype) -> WeightSpec:
    items = synced_parameters(lm)
    return WeightSpec(
        names=tuple(n for n, _ in items),
        shapes=tuple(tuple(p.shape) for _, p in items),
        wire_dtype=str(wire_dtype).removeprefix("torch."),
        lora_scale=lora_scale(lm),
    )


def loader(engine: InferenceEngine, spec: WeightSpec):
    """``engine.load_weights``, or for adapter tensors (``spec.lora_scale`` > 0) ``engine.load_lora_weights``."""
    if not spec.lora_scale:
        return engine.load_weights
    return lambda items: engine.load_lora_weights(items, spec.lora_scale)


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


def elapsed_s(t0: float, device: torch.device) -> float:
    """Seconds since ``t0`` (``time.perf_counter``), after the device finished the queued work: NCCL ops
    and copies return to the host before the GPU ran them, so host time alone undercounts a sync."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _full(p: torch.Tensor) -> torch.Tensor:
    # DTensor -> full tensor: an all-gather over the trainer role's FSDP axis. No grad flows (no_grad).
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _dim0_mesh(p: torch.Tensor):
    """The 1-D mesh of a DTensor sharded ``Shard(0)`` on it (what FSDP2 makes of a dense parameter), else None."""
    if isinstance(p, DTensor) and p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),) and p.ndim >= 1:
        return p.device_mesh
    return None


class WeightSender:
    """Trainer side. Every trainer rank constructs it and calls ``send``/``copy_to`` at the same points."""

    def __init__(self, lm: nn.Module, wire_dtype: torch.dtype, bucket_bytes: int, rank: int) -> None:
        self.lm, self.rank, self.bucket_bytes = lm, rank, bucket_bytes
        self.spec = build_spec(lm, wire_dtype)
        self.buckets = plan_buckets(self.spec, bucket_bytes)
        self._offsets = []  # per bucket: element offset of each parameter in the flat bucket
        for idx in self.buckets:
            offs, o = [], 0
            for i in idx:
                offs.append(o)
                o += _numel(self.spec.shapes[i])
            self._offsets.append((offs, o))
        self._max_bucket = max(total for _, total in self._offsets)

    @torch.no_grad()
    def _gather(self, b: int, params: list[torch.Tensor], flat: torch.Tensor | None, bufs: dict) -> None:
        """Collective over the trainer role: every trainer rank calls it for every bucket ``b`` in order.
        With ``flat`` given, writes the bucket's full parameters (wire dtype, parameter order) into it."""
        idx = self.buckets[b]
        offs, _ = self._offsets[b]
        dtype = self.spec.dtype
        batched: list[tuple[int, int]] = []  # (position in bucket, param index) of dim-0 shards on `mesh`
        mesh = None
        for j, i in enumerate(idx):
            m = _dim0_mesh(params[i])
            if m is not None and (mesh is None or m == mesh):
                mesh = m
                batched.append((j, i))
                continue
            full = _full(params[i])  # EP experts, replicated or plain tensors; same order on every rank
            if flat is not None:
                n = _numel(self.spec.shapes[i])
                flat[offs[j] : offs[j] + n].copy_(full.detach().reshape(-1))
        if not batched:
            return
        world = mesh.size()
        if world == 1:
            if flat is not None:
                for j, i in batched:
                    n = _numel(self.spec.shapes[i])
                    flat[offs[j] : offs[j] + n].copy_(params[i].to_local().detach().reshape(-1))
            return
        me = mesh.get_local_rank()
        # Per rank segment: every parameter's dim-0 chunk padded to ceil(d0 / world) rows (torch.chunk,
        # FSDP2's layout), so that the segments have one size on all ranks.
        layout, seg = [], 0
        for j, i in batched:
            shape = self.spec.shapes[i]
            rest = _numel(shape[1:])
            chunk = -(-shape[0] // world)
            layout.append((j, i, shape[0], rest, chunk, seg))
            seg += chunk * rest
        if "inp" not in bufs or bufs["inp"].numel() < seg:
            bufs["inp"] = torch.empty(
                seg, dtype=dtype, device=flat.device if flat is not None else self._device(params)
            )
        inp = bufs["inp"][:seg]
        for _j, i, d0, rest, chunk, so in layout:
            local = params[i].to_local()
            rows = max(0, min(chunk, d0 - me * chunk))
            assert local.shape[0] == rows, (self.spec.names[i], tuple(local.shape), rows)
            if rows:
                inp[so : so + rows * rest].copy_(local.detach().reshape(-1))
        if "out" not in bufs or bufs["out"].numel() < world * seg:
            bufs["out"] = torch.empty(world * seg, dtype=dtype, device=inp.device)
        out = bufs["out"][: world * seg]
        dist.all_gather_into_tensor(out, inp, group=mesh.get_group())
        if flat is None:
            return
        for j, _i, d0, rest, chunk, so in layout:
            for q in range(world):
                rows = max(0, min(chunk, d0 - q * chunk))
                if rows:
                    dst = offs[j] + q * chunk * rest
                    flat[dst : dst + rows * rest].copy_(out[q * seg + so : q * seg + so + rows * rest])

    @staticmethod
    def _device(params: list[torch.Tensor]) -> torch.device:
        return params[0].device if params else torch.device("cpu")

    def _single_rank(self, params: list[torch.Tensor]) -> bool:
        """No parameter needs a collective to be whole (one trainer rank)."""
        for p in params:
            m = _dim0_mesh(p)
            if hasattr(p, "full_tensor") and (m is None or m.size() > 1):
                return False
        return True

    @torch.no_grad()
    def send(self, bridge: Bridge | None, device: torch.device, version: int) -> tuple[float, float]:
        """Broadcast the current weights, as weights version ``version``, to the inference ranks.

        Every trainer rank calls it; only the controller has a bridge. Returns (wait s, transfer s) with the
        device work included: the wait is the one-number version header, which completes only once every
        inference rank finished its generation and posted the receive; the transfer is the rest.
        """
        t0 = time.perf_counter()
        wait_s = 0.0
        params = [p for _, p in synced_parameters(self.lm)]
        bufs: dict = {}
        stage = None
        if self.rank == CONTROLLER_RANK:
            assert bridge is not None
            # a header first: the receivers report the version they hold, which the schedule checks
            bridge.broadcast(torch.tensor([version], dtype=torch.int64, device=device), src=CONTROLLER_RANK)
            wait_s = elapsed_s(t0, device)
            stage = torch.empty(self._max_bucket, dtype=self.spec.dtype, device=device)
        for b in range(len(self.buckets)):
            flat = stage[: self._offsets[b][1]] if stage is not None else None
            self._gather(b, params, flat, bufs)
            if flat is not None:
                bridge.broadcast(flat, src=CONTROLLER_RANK)
        return wait_s, elapsed_s(t0, device) - wait_s

    @torch.no_grad()
    def copy_to(self, engine: InferenceEngine, version: int) -> float:
        """Colocated mode: load the current full weights into this rank's engine in place and mark them
        as weights version ``version``; returns seconds spent (device work included)."""
        t0 = time.perf_counter()
        named = synced_parameters(self.lm)
        params = [p for _, p in named]
        device = self._device(params)
        load = loader(engine, self.spec)
        if self._single_rank(params):
            # nothing to gather: one load_weights call (one cache reset), straight from the parameters
            load(
                (name, (p.to_local() if hasattr(p, "to_local") else p).detach().to(self.spec.dtype))
                for name, p in named
            )
            engine.finish_weight_update()
            engine.weights_version = version
            return elapsed_s(t0, device)
        bufs: dict = {}
        stage = torch.empty(self._max_bucket, dtype=self.spec.dtype, device=self._device(params))

        def weights():
            for b, idx in enumerate(self.buckets):
                offs, total = self._offsets[b]
                flat = stage[:total]
                self._gather(b, params, flat, bufs)
                for j, i in enumerate(idx):
                    n = _numel(self.spec.shapes[i])
                    yield self.spec.names[i], flat[offs[j] : offs[j] + n].view(self.spec.shapes[i])

        load(weights())  # consumes each bucket's views before the next gather reuses `stage`
        engine.finish_weight_update()
        engine.weights_version = version
        return elapsed_s(t0, device)


class WeightReceiver:
    """Inference side of the weight bridge (every inference rank)."""

    def __init__(self, spec: WeightSpec, bucket_bytes: int, engine: InferenceEngine, device: torch.device) -> None:
        self.spec, self.engine, self.device = spec, engine, device
        self.buckets = plan_buckets(spec, bucket_bytes)
        self._sizes = [[_numel(spec.shapes[i]) for i in idx] for idx in self.buckets]
        self._max_bucket = max(sum(s) for s in self._sizes)
        self._load = loader(engine, spec)

    @torch.no_grad()
    def recv(self, bridge: Bridge) -> float:
        """Receive one ``WeightSender.send`` into the engine; sets ``engine.weights_version`` to the version
        the trainer sent once every bucket is loaded. Returns seconds spent (device work included)."""
        t0 = time.perf_counter()
        header = torch.zeros(1, dtype=torch.int64, device=self.device)
        bridge.broadcast(header, src=CONTROLLER_RANK)
        stage = torch.empty(self._max_bucket, dtype=self.spec.dtype, device=self.device)  # reused by every bucket
        for idx, sizes in zip(self.buckets, self._sizes):
            flat = stage[: sum(sizes)]
            bridge.broadcast(flat, src=CONTROLLER_RANK)
            views = flat.split(sizes)
            items = ((self.spec.names[i], v.view(self.spec.shapes[i])) for i, v in zip(idx, views))
            self._load(items)
        self.engine.finish_weight_update()
        self.engine.weights_version = int(header.item())
        return elapsed_s(t0, self.device)
