"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may be scheduled while the kernel before it
on the stream is still running. Its programs wait (``griddepcontrol.wait``) until that kernel has finished and its
writes are visible before they touch memory an earlier kernel wrote, then let the next kernel launch
(``griddepcontrol.launch_dependents``). What overlaps is the next kernel's launch and scheduling with the previous
one's tail: the decode step of a small batch is a chain of ~150 short kernels (docs/inference.md, decode profile).

Process-wide and off by default (``--inference.pdl``; ``set_enabled``): it has not been measured on a GPU. Kernels
take ``USE_PDL`` (a constexpr: False compiles them exactly as without) and call ``pdl_enter(USE_PDL)`` first;
launchers pass ``USE_PDL=enabled()`` and ``**launch_options()``. Never under the Triton interpreter (it cannot run
the instructions), never off CUDA.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

try:  # triton >= 3.5 (the GPU machine has 3.6)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:  # pragma: no cover - older triton
    HAS_PDL = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


_ENABLED = [False]


def set_enabled(on: bool) -> bool:
    """Turn PDL on or off for every later launch of the kernels that support it; returns whether it is on (False
    where this triton lacks the intrinsics or the interpreter runs the kernels)."""
    _ENABLED[0] = bool(on) and HAS_PDL and not INTERPRET
    return _ENABLED[0]


def enabled() -> bool:
    return _ENABLED[0]


def launch_options() -> dict[str, bool]:
    """Extra launch arguments: ``launch_pdl=True`` while PDL is on."""
    return {"launch_pdl": True} if _ENABLED[0] else {}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """First thing in a PDL kernel: wait for the previous kernel (and its writes), then let the next one launch."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
