"""Zeroed int32 counters that a kernel's last program of a group resets (the fused decode attention's split
combination): kept per (device, user), so no launch needs a memset and a CUDA graph that captured a launch reads the
same buffer at every replay."""

from __future__ import annotations

import torch

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
