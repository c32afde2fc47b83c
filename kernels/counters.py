"""Zeroed int32 counters that a kernel's last program of a group resets (split-K in kernels/decode_linear, the
fused decode attention's split combination): kept per (device, user), so no launch needs a memset and a CUDA
graph that captured a launch reads the same buffer at every replay.

Also the two halves of a dependency between programs of one launch (kernels/decode_chain): ``count_done`` after a
program's stores, ``wait_count`` before a later program's loads of them."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def zeroed_counters(device: torch.device, n: int, user: str) -> torch.Tensor:
    """At least ``n`` int32 zeros on ``device`` for ``user`` (a kernel's name), the same buffer at every call while
    it is large enough. Each launch must leave them zero. Launches on one stream only (two launches in flight at
    once would share counters)."""
    key = (device, user)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:  # a graph captured earlier may still read it: keep it alive
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 4096), device=device, dtype=torch.int32)
        _COUNTERS[key] = buf
    return buf


@triton.jit
def count_done(ptr):
    """After this program's stores: a CTA barrier (every thread's stores issued before it), then one release increment
    of the int32 counter at ``ptr`` (a scalar atomic: one thread), so a program that acquires the count sees them."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


# Polls a wait makes before it gives up (kernels/decode_chain turns a give-up into an error on the host, where a hang
# would have lost the run): ~10 s of polls on a GPU; 1 under the interpreter, which runs a launch's programs one
# after another, so any wait it reaches unmet is a bug in the order of the work, reported at once
SPIN_LIMIT = tl.constexpr(1 if INTERPRET else 1 << 24)


@triton.jit
def wait_count(ptr, target, err_ptr):
    """Spin until the int32 counter at ``ptr`` reaches ``target`` (volatile loads, which bypass L1), then acquire it
    (one thread's acquire atomic, then a CTA barrier that orders every thread's later loads after it): the writes the
    counted programs made before their ``count_done`` are visible to this program's loads. Deadlock-free only where
    every counted program has started already (kernels/decode_chain takes its work in ticket order for that). After
    ``SPIN_LIMIT`` polls it stops waiting and adds 1 to the int32 at ``err_ptr``: the program goes on with what it
    reads, the launch ends, and the host finds the count (``DecodeChain.check``)."""
    cur = tl.load(ptr, volatile=True)
    polls = tl.full([], 0, tl.int32)
    while (cur < target) & (polls < SPIN_LIMIT):
        cur = tl.load(ptr, volatile=True)
        polls += 1
    if cur < target:
        tl.atomic_add(err_ptr, 1)
    tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
