"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may be scheduled while the kernel before it
on the stream is still running. Its programs wait (``griddepcontrol.wait``) until that kernel has finished and its
writes are visible before they touch memory an earlier kernel wrote, then let the next kernel launch
(``griddepcontrol.launch_dependents``). What overlaps is the next kernel's launch and scheduling with the previous
one's tail: the decode step of a small batch is a chain of ~150 short kernels (docs/inference.md, decode profile).

Process-wide (``set_enabled``); the native engine turns it on on CUDA by default (``--inference.native.pdl``, since 14976e9;
measured on an H200, docs/benchmarks.md). Kernels
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


def prefetch_enabled() -> bool:
    """Whether PDL kernels load or prefetch their weights before they wait: always while PDL is on (the one-row GEMV's
    preload won: H200, Qwen3-0.6B, batch 1, 1,331 vs 1,225 tok/s; kernels/pdl/README.md)."""
    return _ENABLED[0]


def bulk_prefetchable(t, *extents_elems: int) -> bool:
    """Can ``cp.async.bulk.prefetch.L2`` take pieces of ``t`` (a CUDA tensor) whose starts and sizes are sums of
    ``extents_elems`` (elements: its row stride, the row length, a split's length)? Its address must be 16-byte
    aligned and its size a multiple of 16 bytes."""
    e = t.element_size()
    return t.data_ptr() % 16 == 0 and all((n * e) % 16 == 0 for n in extents_elems)


def launch_options() -> dict[str, bool]:
    """Extra launch arguments: ``launch_pdl=True`` while PDL is on."""
    return {"launch_pdl": True} if _ENABLED[0] else {}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """First thing in a PDL kernel: wait for the previous kernel (and its writes), then let the next one launch."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(row_ptrs, nbytes):
    """Bulk-prefetch into L2 ``nbytes`` (int32, a multiple of 16; 0 skips: a split-K program past K) from each of
    ``row_ptrs`` (16-byte aligned): one ``cp.async.bulk.prefetch.L2.global`` per element (sm_90+; the caller checks
    ``bulk_prefetchable``). Only moves data into L2, the GPU's point of coherence, so it is safe before
    ``griddepcontrol.wait``: a PDL kernel streams its weights in while the kernel before it still runs."""
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.ne.u32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,r",
        [row_ptrs, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
