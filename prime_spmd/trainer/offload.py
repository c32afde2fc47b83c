"""AdamW whose moment estimates live in host memory (``--trainer.offload optimizer``).

AdamW's two fp32 moments are 8 bytes a trained parameter, half of full fine-tuning's 16 (fp32 master weights 4,
fp32 gradients 4, moments 8). Kept in pinned host memory, they leave the GPU for the engine's KV cache and the
trainer's activations; what it costs is one host -> device and one device -> host copy of them every step.

``step`` streams the moments in chunks of at most ``chunk_bytes`` (a parameter larger than a chunk spans several:
AdamW is elementwise, so a chunk holds element ranges of parameters): while the device updates chunk i
(AdamW on the parameters' local shards, in place), a side stream copies chunk i + 1's moments in and chunk i - 1's
out, through two device staging buffers. The device holds at most two chunks of moments at a time.

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
    shards (no collective). ``chunk_bytes``: moments streamed through the device per chunk (two chunks resident).
    """

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
        self._staging: list[torch.Tensor] = []
        self._copy_stream: torch.cuda.Stream | None = None

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            pin = _local(p).device.type == "cuda"
            state["step"] = torch.tensor(0.0)
            for name in MOMENTS:
                state[name] = _like_on_host(p, pin)
        return state

    def _chunks(
        self, live: list[tuple[torch.Tensor, dict, dict]]
    ) -> list[list[tuple[torch.Tensor, dict, dict, int, int]]]:
        """Segments (param, state, group, start, end) of ``live``'s (param, state, group), in order, cut into chunks
        of at most ``chunk_bytes`` of moments. AdamW is elementwise, so a parameter larger than a chunk (an embedding
        or LM head: Qwen3-8B's is 622M elements, 4.6 GiB of moments) spans several chunks and the device staging stays
        at two chunks (docs/log.md 2026-12-07: whole-parameter chunks made the 4B run's staging 5.8 GiB)."""
        limit = max(1, self.chunk_bytes // 8)  # elements a chunk: two fp32 moments each
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
        """Two staging buffers of [2, numel] fp32 (exp_avg, exp_avg_sq), grown when a chunk needs more."""
        if not self._staging or self._staging[0].shape[1] < numel or self._staging[0].device != device:
            self._staging = [torch.empty(2, numel, dtype=torch.float32, device=device) for _ in range(2)]
        return self._staging

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer.step
        assert closure is None, "HostOffloadAdamW.step takes no closure"
        live = [(p, self._init_state(p), g) for g in self.param_groups for p in g["params"] if p.grad is not None]
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

        def views(i: int) -> list[list[torch.Tensor]]:  # per moment, per parameter: slices of chunk i's buffer
            buf = bufs[i % 2]
            return [list(buf[m, : sum(numels[i])].split(numels[i])) for m in range(2)]

        def load(i: int) -> None:  # host -> device (side stream on CUDA)
            for m, name in enumerate(MOMENTS):
                for (_, state, _, a, b), v in zip(chunks[i], views(i)[m]):
                    v.copy_(_local(state[name]).view(-1)[a:b], non_blocking=True)

        def store(i: int) -> None:  # device -> host
            for m, name in enumerate(MOMENTS):
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

    @staticmethod
    def _update(chunk: list[tuple[torch.Tensor, dict, dict, int, int]], moments: list[list[torch.Tensor]]) -> None:
        """torch's AdamW on one chunk's segments, in place on the parameters' local shards and the staged moments
        (each parameter's step count already advanced by ``step``)."""
        by_group: dict[int, list[int]] = {}
        for j, (_, _, group, _, _) in enumerate(chunk):
            by_group.setdefault(id(group), []).append(j)
        for idx in by_group.values():
            group = chunk[idx[0]][2]
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            params = [_local(chunk[j][0]).view(-1)[chunk[j][3] : chunk[j][4]] for j in idx]
            grads = [_local(chunk[j][0].grad).view(-1)[chunk[j][3] : chunk[j][4]] for j in idx]
            exp_avgs = [moments[0][j] for j in idx]
            exp_avg_sqs = [moments[1][j] for j in idx]
            steps = []
            for j in idx:
                steps.append(float(chunk[j][1]["step"]))
            if wd != 0:
                torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            for s in set(steps):  # parameters of a group share their step count; kept general
                sel = [k for k, v in enumerate(steps) if v == s]
                step_size = lr / (1 - beta1**s)
                bc2_sqrt = math.sqrt(1 - beta2**s)
                denom = torch._foreach_sqrt([exp_avg_sqs[k] for k in sel])
                torch._foreach_div_(denom, bc2_sqrt)
                torch._foreach_add_(denom, eps)
                torch._foreach_addcdiv_([params[k] for k in sel], [exp_avgs[k] for k in sel], denom, -step_size)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader moves every state tensor to its parameter's device: the moments go back to the host."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            pin = _local(p).device.type == "cuda"
            state["step"] = torch.as_tensor(float(state["step"]))
            for name in MOMENTS:
                if name in state and _local(state[name]).device.type != "cpu":
                    host = _like_on_host(p, pin)
                    _local(host).copy_(_local(state[name]))
                    state[name] = host
