"""AdamW whose moment estimates live in host memory (``--trainer.offload optimizer``).

AdamW's two fp32 moments are 8 bytes a trained parameter, half of full fine-tuning's 16 (fp32 master weights 4,
fp32 gradients 4, moments 8). Kept in pinned host memory, they leave the GPU for the engine's KV cache and the
trainer's activations; what it costs is one host -> device and one device -> host copy of them every step.

``step`` streams the moments in chunks of at most ``chunk_bytes`` (a parameter larger than a chunk spans several:
AdamW is elementwise, so a chunk holds element ranges of parameters): while the device updates chunk i
(AdamW on the parameters' local shards, in place), a side stream copies chunk i + 1's moments in and chunk i - 1's
out, through two device staging buffers. The device holds at most two chunks of moments at a time.

``HostMasterAdamW`` (``--trainer.offload master``) also keeps the fp32 master weights on the host: the trained
parameters are the compute-dtype (bf16) weights the forward reads, and the engine of a colocated run reads them in
place; the step streams master and moments through the device the same way and writes each updated master back into
its parameter, cast. Gradients accumulate over a step's micro-batches in fp32 buffers of the optimizer's own (a hook
on each parameter takes its compute-dtype gradient as soon as autograd has it), freed by ``zero_grad``.

The moments are ``DTensor``s with the parameter's mesh and placements whose local tensors are on the host (as FSDP2's
own CPU offload keeps its sharded parameters), so checkpoints (DCP, ``get_state_dict``) save and resume them like a
device optimizer's. The update is torch's AdamW (decoupled weight decay, bias-corrected moments, no amsgrad) written
with ``torch._foreach`` ops; tests/unit/test_offload_optimizer.py compares it with ``torch.optim.AdamW``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's shard of a DTensor (no collective; no grad flows: the optimizer runs under no_grad)."""
    return t.to_local() if isinstance(t, DTensor) else t


REGISTER_MIN_BYTES = 32 << 20
"""Moments of at least this many bytes are pinned by registering ordinary host memory with CUDA (``_host_zeros``);
glibc serves allocations this large from mappings of their own (its mmap threshold grows to 32 MiB at most), so no
two registered ranges share a page."""


def _host_zeros(shape: torch.Size, pin: bool, register_min_bytes: int = REGISTER_MIN_BYTES) -> torch.Tensor:
    """fp32 zeros in host memory; with ``pin``, page-locked. torch's pinned allocator (``pin_memory=True``) rounds
    every allocation up to a power of two (``CachingHostAllocator``): a Qwen3-8B MLP weight's 192 MiB of one moment
    takes 256 MiB, and over the model the moments would pin 33% more host memory than they hold (Qwen3-8B: 81.3 GiB
    for 61.0; Qwen3-4B: 42.3 for 30.0), paying the pinning time for it too. Tensors of at least
    ``register_min_bytes`` come from the ordinary allocator at their exact size instead and are registered with CUDA
    (``cudaHostRegister``), unregistered when the tensor is collected; smaller ones (norms, biases) keep torch's
    pinned allocator."""
    nbytes = math.prod(shape) * 4
    if not pin or nbytes < register_min_bytes:
        return torch.zeros(shape, dtype=torch.float32, device="cpu", pin_memory=pin)
    host = torch.zeros(shape, dtype=torch.float32, device="cpu")
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"--trainer.offload optimizer: cudaHostRegister of {nbytes} bytes of moments failed ({err})")
    weakref.finalize(host, cudart.cudaHostUnregister, host.data_ptr())
    return host


def _like_on_host(p: torch.Tensor, pin: bool) -> torch.Tensor:
    """fp32 zeros shaped like ``p``'s local shard in host memory (``_host_zeros``); for a DTensor, a DTensor with
    ``p``'s spec around the host tensor (built directly, as FSDP2 builds its CPU-offloaded parameters:
    ``DTensor.from_local`` would move the local tensor to the mesh's device)."""
    local = _host_zeros(_local(p).shape, pin)
    if isinstance(p, DTensor):
        return DTensor(local, p._spec, requires_grad=False)
    return local


class HostOffloadAdamW(torch.optim.Optimizer):
    """AdamW over ``params`` (device tensors or FSDP2 DTensors) with its moments in host memory.

    Same hyper-parameters and param-group semantics as ``torch.optim.AdamW`` (``lr``, ``betas``, ``eps``,
    ``weight_decay``); the step counter is a host float per parameter. Called by every trainer rank on its own
    shards (no collective). ``chunk_bytes``: host state (``HOST``) streamed through the device per chunk (two chunks
    resident).
    """

    HOST: tuple[str, ...] = MOMENTS
    """Per-parameter state kept in host memory and streamed through the device at each step."""

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        chunk_bytes: int = 256 << 20,
    ) -> None:
        if chunk_bytes < 8:
            raise ValueError(f"chunk_bytes must hold at least one parameter's moments, got {chunk_bytes}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.chunk_bytes = chunk_bytes
        """Bytes of host state (every name of ``HOST``) a chunk stages on the device."""
        self._staging: list[torch.Tensor] = []
        self._copy_stream: torch.cuda.Stream | None = None

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            pin = _local(p).device.type == "cuda"
            state["step"] = torch.tensor(0.0)
            for name in self.HOST:
                state[name] = _like_on_host(p, pin)
        return state

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient the step applies to ``p`` (None: ``p`` has none this step)."""
        return p.grad

    def _chunks(
        self, live: list[tuple[torch.Tensor, dict, dict]]
    ) -> list[list[tuple[torch.Tensor, dict, dict, int, int]]]:
        """Segments (param, state, group, start, end) of ``live``'s (param, state, group), in order, cut into chunks
        of at most ``chunk_bytes`` of moments. AdamW is elementwise, so a parameter larger than a chunk (an embedding
        or LM head: Qwen3-8B's is 622M elements, 4.6 GiB of moments) spans several chunks and the device staging stays
        at two chunks (docs/log.md 2026-12-07: whole-parameter chunks made the 4B run's staging 5.8 GiB)."""
        limit = max(1, self.chunk_bytes // (4 * len(self.HOST)))  # elements a chunk: fp32 host state each
        chunks: list[list] = [[]]
        size = 0
        for p, state, group in live:
            n, a = _local(p).numel(), 0
            while a < n:
                if size == limit:
                    chunks.append([])
                    size = 0
                b = min(n, a + limit - size)
                chunks[-1].append((p, state, group, a, b))
                size += b - a
                a = b
        return [c for c in chunks if c]

    def _buffers(self, device: torch.device, numel: int) -> list[torch.Tensor]:
        """Two staging buffers of [len(HOST), numel] fp32, grown when a chunk needs more."""
        if not self._staging or self._staging[0].shape[1] < numel or self._staging[0].device != device:
            n = len(self.HOST)
            self._staging = [torch.empty(n, numel, dtype=torch.float32, device=device) for _ in range(2)]
        return self._staging

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer.step
        assert closure is None, "HostOffloadAdamW.step takes no closure"
        live = [
            (p, self._init_state(p), g) for g in self.param_groups for p in g["params"] if self._grad(p) is not None
        ]
        for _, state, _ in live:  # one step a parameter, however many segments it has
            state["step"] += 1
        chunks = self._chunks(live)
        if not chunks:
            return None
        device = _local(chunks[0][0][0]).device
        numels = [[b - a for _, _, _, a, b in c] for c in chunks]
        bufs = self._buffers(device, max(sum(n) for n in numels))
        cuda = device.type == "cuda"
        if cuda and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        copy = self._copy_stream
        compute = torch.cuda.current_stream(device) if cuda else None

        def views(i: int) -> list[list[torch.Tensor]]:  # per host state, per parameter: slices of chunk i's buffer
            buf = bufs[i % 2]
            return [list(buf[m, : sum(numels[i])].split(numels[i])) for m in range(len(self.HOST))]

        def load(i: int) -> None:  # host -> device (side stream on CUDA)
            for m, name in enumerate(self.HOST):
                for (_, state, _, a, b), v in zip(chunks[i], views(i)[m]):
                    v.copy_(_local(state[name]).view(-1)[a:b], non_blocking=True)

        def store(i: int) -> None:  # device -> host
            for m, name in enumerate(self.HOST):
                for (_, state, _, a, b), v in zip(chunks[i], views(i)[m]):
                    _local(state[name]).view(-1)[a:b].copy_(v, non_blocking=True)

        loaded: list[torch.cuda.Event | None] = [None] * len(chunks)
        done: list[torch.cuda.Event | None] = [None] * len(chunks)

        def issue_load(i: int) -> None:
            if not cuda:
                load(i)
                return
            with torch.cuda.stream(copy):
                if i >= 2:  # chunk i reuses chunk i - 2's buffer: its update and its copy out come first
                    copy.wait_event(done[i - 2])
                    store(i - 2)
                load(i)
                loaded[i] = torch.cuda.Event()
                loaded[i].record(copy)

        issue_load(0)
        for i, chunk in enumerate(chunks):
            if i + 1 < len(chunks):
                issue_load(i + 1)
            if cuda:
                compute.wait_event(loaded[i])
            self._update(chunk, views(i))
            if cuda:
                done[i] = torch.cuda.Event()
                done[i].record(compute)
            else:
                store(i)
        if cuda:
            with torch.cuda.stream(copy):
                for i in range(max(0, len(chunks) - 2), len(chunks)):
                    copy.wait_event(done[i])
                    store(i)
            compute.wait_stream(copy)  # the host copies are whole before anyone reads the state
            copy.synchronize()
        return None

    def _update(self, chunk: list[tuple[torch.Tensor, dict, dict, int, int]], staged: list[list[torch.Tensor]]) -> None:
        """AdamW on one chunk's segments, in place on the parameters' local shards and the staged moments."""
        params = [_local(p).view(-1)[a:b] for p, _, _, a, b in chunk]
        grads = [_local(self._grad(p)).view(-1)[a:b] for p, _, _, a, b in chunk]
        adamw_segments(chunk, params, grads, staged[0], staged[1])

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every state tensor to its parameter's dtype and device: all the host state at once on
        the device (Qwen3-8B: 61 GiB of moments), and a bf16 parameter's fp32 master through bf16. So only the step
        counts go through it; each host tensor is kept as it is where it already lives on the host in fp32 at the
        parameter's shape, pinned where the parameter is on CUDA (a DCP resume loads into the optimizer's own host
        tensors), else copied into new host memory."""
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        host = {i: {n: v for n, v in s.items() if n in self.HOST} for i, s in state_dict["state"].items()}
        rest = {i: {n: v for n, v in s.items() if n not in self.HOST} for i, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": rest})
        for i, p in zip(ids, (p for g in self.param_groups for p in g["params"])):
            if p not in self.state:
                continue
            state = self.state[p]
            state["step"] = torch.as_tensor(float(state["step"]))
            for name, value in host.get(i, {}).items():
                state[name] = _host_state(p, value)


def _host_state(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as host state of ``p``: itself when it is fp32 on the host at ``p``'s local shape, contiguous, and
    pinned where ``p`` is on CUDA; else a copy in new host memory (``_like_on_host``)."""
    local, pin = _local(value), _local(p).device.type == "cuda"
    if (
        local.device.type == "cpu"
        and local.dtype == torch.float32
        and local.shape == _local(p).shape
        and local.is_contiguous()
        and (local.is_pinned() or not pin)
    ):
        return value
    out = _like_on_host(p, pin)
    _local(out).copy_(local)
    return out


class HostMasterAdamW(HostOffloadAdamW):
    """``HostOffloadAdamW`` whose fp32 master weights live on the host too (``--trainer.offload master``).

    ``params`` are the compute-dtype (bf16) weights the forward reads; a hook on each takes its gradient as soon as
    autograd has accumulated it and adds it, in fp32, into a buffer of the optimizer's own (``gradients()``; freed by
    ``zero_grad``), so the step's micro-batches sum in fp32 and no compute-dtype gradient outlives its hook. The master
    starts as the parameter's value at the first step (a host copy, in fp32); each step streams master and moments
    through the device in chunks, updates the master and writes it back into the parameter in place, cast (the
    parameter's storage never moves: a colocated engine reads it, and CUDA graphs hold its address). Checkpoints save
    and resume the masters with the moments (state ``master``)."""

    HOST = ("master", *MOMENTS)

    def __init__(self, params: Iterable, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self._acc: dict[torch.Tensor, torch.Tensor] = {}
        for group in self.param_groups:
            for p in group["params"]:
                p.register_post_accumulate_grad_hook(self._accumulate)

    @torch.no_grad()
    def _accumulate(self, p: torch.Tensor) -> None:
        acc = self._acc.get(p)
        if acc is None:
            self._acc[p] = p.grad.to(torch.float32, copy=True)
        else:
            acc.add_(p.grad)
        p.grad = None

    def gradients(self) -> list[torch.Tensor]:
        """The step's fp32 gradients so far, in parameter order (what clipping scales in place)."""
        return [self._acc[p] for g in self.param_groups for p in g["params"] if p in self._acc]

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The hooks' fp32 sum, else a gradient set on the parameter directly (DCP's optimizer-state init sets zeros
        and steps at lr 0)."""
        acc = self._acc.get(p)
        if acc is None and p.grad is not None:
            return p.grad.float()
        return acc

    def _init_state(self, p: torch.Tensor) -> dict:
        fresh = not self.state[p]
        state = super()._init_state(p)
        if fresh:  # the master starts as the parameter's value
            _local(state["master"]).copy_(_local(p).detach())
        return state

    def _update(self, chunk: list[tuple[torch.Tensor, dict, dict, int, int]], staged: list[list[torch.Tensor]]) -> None:
        """AdamW on the staged masters, then each parameter's segment takes its master, cast."""
        grads = [_local(self._grad(p)).view(-1)[a:b] for p, _, _, a, b in chunk]
        adamw_segments(chunk, staged[0], grads, staged[1], staged[2])
        torch._foreach_copy_([_local(p).view(-1)[a:b] for p, _, _, a, b in chunk], staged[0])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the fp32 gradient buffers (and any compute-dtype gradient): the memory is free until the next
        backward."""
        self._acc.clear()
        super().zero_grad(set_to_none=set_to_none)


def adamw_segments(
    chunk: list[tuple[torch.Tensor, dict, dict, int, int]],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
) -> None:
    """torch's AdamW (decoupled weight decay, bias-corrected moments) on one chunk's segments, in place on ``params``
    and the moments. ``chunk``: (param, state, group, start, end) a segment, each parameter's step count already
    advanced; the other lists hold one flat view a segment, in the chunk's order."""
    by_group: dict[int, list[int]] = {}
    for j, (_, _, group, _, _) in enumerate(chunk):
        by_group.setdefault(id(group), []).append(j)
    for idx in by_group.values():
        group = chunk[idx[0]][2]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        ps, gs = [params[j] for j in idx], [grads[j] for j in idx]
        ms, vs = [exp_avgs[j] for j in idx], [exp_avg_sqs[j] for j in idx]
        steps = [float(chunk[j][1]["step"]) for j in idx]
        if wd != 0:
            torch._foreach_mul_(ps, 1 - lr * wd)
        torch._foreach_lerp_(ms, gs, 1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, gs, gs, 1 - beta2)
        for s in set(steps):  # parameters of a group share their step count; kept general
            sel = [k for k, v in enumerate(steps) if v == s]
            step_size = lr / (1 - beta1**s)
            bc2_sqrt = math.sqrt(1 - beta2**s)
            denom = torch._foreach_sqrt([vs[k] for k in sel])
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_([ps[k] for k in sel], [ms[k] for k in sel], denom, -step_size)
