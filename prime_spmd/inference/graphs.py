"""CUDA-graph capture and replay for the native engine: one memory pool per engine, the decode launches captured per
(rows, length, sampler flags, steps) key by the engine, and the prefills captured per (row bucket, length bucket).

A captured graph reads and writes fixed device buffers: inputs are copied into its static tensors before a replay,
outputs read from its output buffer after. Decode and prefill graphs share the pool: they never run at the same time,
and what outlives a replay lives in buffers allocated outside the pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# Prefills of up to this many padded tokens (row bucket x length bucket) run as captured CUDA graphs (CUDA, the slot
# cache, not transformers' MoE blocks): an eager prefill launches ~50 kernels a layer from Python, which for a small
# model costs far more host time than GPU time (Qwen3-0.6B, one 128-token prompt, H200: a generate's first step
# 61.6 ms eager, 6.8 ms with the graph; docs/benchmarks.md).
PREFILL_GRAPH_MAX_TOKENS = 8192


class GraphPool:
    """The CUDA graphs of one engine on ``device``, captured into one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = None
        self.captures = 0
        """Graphs captured so far (decode and prefill)."""
        self.capture_s = 0.0
        """Host seconds spent in ``capture`` so far, warm-ups included (their compiles too): what a run pays for
        graphs when it first meets a shape (``NativeEngine.graph_stats``)."""

    def capture(self, fn: Callable[[], object], warmups: int) -> torch.cuda.CUDAGraph:
        """Run ``fn`` ``warmups`` times on a side stream (compiles, cuBLAS / SDPA workspaces, allocator first use),
        then capture it into a CUDA graph in the pool."""
        t0 = time.perf_counter()
        graph = self._capture(fn, warmups)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0  # capture synchronizes the device, so the warm-ups are in it
        return graph

    def new_pool(self) -> None:
        """Capture later graphs into a fresh memory pool (after every graph of the current one was dropped:
        ``NativeEngine.release_memory``). Capturing into a pool whose graphs are all gone, while tensors allocated in it
        still live, trips torch's allocator (``it->second->use_count > 0 INTERNAL ASSERT FAILED``,
        CUDACachingAllocator.cpp, torch 2.11: Qwen3-8B on an H200 at c730d53, the second generation after a release);
        the old pool is freed once its last tensor is."""
        self._pool = None

    def _capture(self, fn: Callable[[], object], warmups: int) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        return graph


def pad_prefill(ids_BT: torch.Tensor, slots: list[int], last: list[int], rows: int, length: int):
    """A prefill batch padded to ``rows`` x ``length`` for a captured graph: ids right-padded with 0 (after each
    prompt, as in any batched prefill: causal attention keeps the real positions exact, and the K/V written past a
    prompt are overwritten by decode before they are attended); the extra rows repeat row 0 (its ids, slot and last
    position), so they write the same K/V into the same slot and touch no other slot. Returns CPU tensors
    (ids [rows, length], slots [rows], last [rows])."""
    b, t = ids_BT.shape
    if not (b <= rows and t <= length):
        raise ValueError(f"pad_prefill: batch {b} x {t} does not fit {rows} x {length}")
    ids = torch.zeros(rows, length, dtype=torch.long)
    ids[:b, :t] = ids_BT
    ids[b:] = ids[0]
    return ids, torch.tensor(slots + slots[:1] * (rows - b)), torch.tensor(last + last[:1] * (rows - b))


class PrefillGraphs:
    """``prefill(ids [B, T], slots [B], last [B]) -> logits [B, V]`` (fp32) replayed from graphs captured per
    (rows, length) bucket on first use. Every graph writes its logits into one buffer [max_rows, V]; the logits a
    call returns are a view of it, valid until the next call."""

    def __init__(self, pool: GraphPool, prefill: Callable, max_rows: int, vocab_size: int) -> None:
        self.pool, self.prefill, self.max_rows, self.vocab_size = pool, prefill, max_rows, vocab_size
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._logits: torch.Tensor | None = None

    def run(self, ids_BT: torch.Tensor, slots: list[int], last: list[int], rows: int, length: int) -> torch.Tensor:
        """Replay (capturing on first use) the graph of bucket (``rows``, ``length``) for CPU ids [B, T]."""
        padded = pad_prefill(ids_BT, slots, last, rows, length)
        if (rows, length) not in self._graphs:
            self._graphs[(rows, length)] = self._capture(padded)
        graph, static = self._graphs[(rows, length)]
        for dst, src in zip(static, padded, strict=True):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return self._logits[: ids_BT.shape[0]]

    def _capture(self, padded: tuple) -> tuple[torch.cuda.CUDAGraph, tuple]:
        """Capture ``prefill`` at ``padded``'s shapes. Its static inputs hold this batch's real values first, so the
        eager warm-up run writes only the slots being prefilled."""
        device = self.pool.device
        static = tuple(t.to(device) for t in padded)
        if self._logits is None:  # the runner's logits are fp32 (runner._lm_head)
            self._logits = torch.empty(self.max_rows, self.vocab_size, device=device, dtype=torch.float32)
        out = self._logits[: len(static[1])]
        return self.pool.capture(lambda: out.copy_(self.prefill(*static)), warmups=1), static
