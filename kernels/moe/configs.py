"""Launch configs of the MoE kernels: one config per kernel and shape class by default, full autotune opt-in.

Why: every autotune key (N, K and the gather/scatter flags) sweeps the whole search space, compiling each
config; one forward + backward at Qwen3-30B-A3B shapes compiled ~50 kernels (~190 s on the H200, issue 19).
By default each launch takes ``pick(...)``: a config from ``TABLE`` by kernel and shape class, clamped to
the GEMM's size and to the device's shared memory, so each kernel variant compiles once per shape class
(Triton's disk cache then serves later processes).

``PRIME_SPMD_MOE_AUTOTUNE=1`` (or ``configs.AUTOTUNE = True`` before a launch) restores the autotuner over
``ROW_CONFIGS`` / ``WGRAD_CONFIGS``; ``benchmarks/moe.py --configs heuristic,autotune`` compares the two and
prints what the autotuner picked (from ``kernel.TUNED``), which is how ``TABLE`` gets refined.

Interpreter (CPU, TRITON_INTERPRET=1): one config (several fail there), in both modes.

Letters: N, K, MW and the BLOCK_* tile names are GEMM roles (output columns, reduction, weight-grad output rows),
the local letters kernel.py's docstring declares, with the legend dims each launch gives them.
"""

from __future__ import annotations

import functools
import os

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
AUTOTUNE = os.environ.get("PRIME_SPMD_MOE_AUTOTUNE", "0") == "1"
KERNELS = ("gate_up", "grouped_gemm", "dz_swiglu_bwd", "grouped_wgrad")
WIDE_N = 1024  # shape class: GEMMs with N >= WIDE_N output columns take the "wide" TABLE row


def _space(bn: tuple[int, ...], bk: tuple[int, ...], warps: tuple[int, ...], stages: tuple[int, ...], **extra):
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, **extra}, num_warps=w, num_stages=s)
        for n in bn
        for k in bk
        for w in warps
        for s in stages
    ]


def gpu_search_space(kernel: str) -> list[triton.Config]:
    """The configs the autotuner tries for ``kernel`` on GPU: 128/256-wide N tiles x warps x stages, 8 per
    kernel (the former 3x2x2 + 32 wgrad configs took ~200 s of compile in a benchmark run)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown MoE kernel {kernel!r}; choose one of {KERNELS}")
    if kernel == "grouped_wgrad":
        return _space((128,), (32, 64), (4, 8), (3, 4), BLOCK_MW=128)
    return _space((128, 256), (64,), (4, 8), (3, 4))


if INTERPRET:
    ROW_CONFIGS = [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    WGRAD_CONFIGS = [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32, "BLOCK_MW": 32}, num_warps=4, num_stages=1)]
else:
    ROW_CONFIGS, WGRAD_CONFIGS = gpu_search_space("gate_up"), gpu_search_space("grouped_wgrad")

# (kernel, wide) -> BLOCK_N, BLOCK_K, num_warps, num_stages (and BLOCK_MW for grouped_wgrad), each in
# gpu_search_space(kernel). Chosen by reasoning, NOT yet measured against the autotuner (docs/benchmarks.md says
# when they are): 128 x 256 fp32 accumulators want 8 warps (128 registers a thread); gate_up holds two
# accumulators, so it stays 128 wide; dz carries the SwiGLU-backward epilogue, so 8 warps. Shared memory at
# bf16: at most 48 KiB a stage (gate_up, wide grouped_gemm), 144 KiB at 3 stages of the H200's 227 KiB.
TABLE: dict[tuple[str, bool], dict[str, int]] = {
    ("gate_up", False): dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    ("gate_up", True): dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    ("grouped_gemm", False): dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    ("grouped_gemm", True): dict(BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    ("dz_swiglu_bwd", False): dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    ("dz_swiglu_bwd", True): dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    ("grouped_wgrad", False): dict(BLOCK_MW=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    ("grouped_wgrad", True): dict(BLOCK_MW=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
}

# Every config pick() made in this process: (kernel, N, K, MW, block_m, element bytes, smem budget) -> config.
PICKS: dict[tuple, triton.Config] = {}


def smem_bytes(kernel: str, c: dict[str, int], elem_bytes: int, block_m: int) -> int:
    """Upper bound on the shared memory of config ``c``: num_stages buffers of one K step's A and B tiles
    (``block_m``: the row kernels' row tile). An estimate: Triton's own allocation (epilogue layout
    conversions included) is checked only when the kernel compiles."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown MoE kernel {kernel!r}; choose one of {KERNELS}")
    rows = c.get("BLOCK_MW", block_m)  # A tile rows: the expert's row tile, or wgrad's output-row block
    b_tiles = 2 if kernel == "gate_up" else 1  # gate and up weight tiles
    return c["num_stages"] * (rows + b_tiles * c["BLOCK_N"]) * c["BLOCK_K"] * elem_bytes


def _fit(kernel: str, c: dict[str, int], elem_bytes: int, block_m: int, smem_budget: int) -> dict[str, int]:
    """Shrink ``c`` until smem_bytes fits: fewer stages (down to 2), then BLOCK_K, then BLOCK_N (down to 16)."""
    c = dict(c)
    for field, floor in (("num_stages", 2), ("BLOCK_K", 16), ("BLOCK_N", 16)):
        while smem_bytes(kernel, c, elem_bytes, block_m) > smem_budget and c[field] > floor:
            c[field] = c[field] - 1 if field == "num_stages" else c[field] // 2
    if smem_bytes(kernel, c, elem_bytes, block_m) > smem_budget:
        raise ValueError(f"no {kernel} config fits {smem_budget} bytes of shared memory (smallest tried: {c})")
    return c


def pick(
    kernel: str, N: int, K: int, *, block_m: int, elem_bytes: int, smem_budget: int, MW: int | None = None
) -> triton.Config:
    """The one launch config of ``kernel`` for an N-column GEMM reducing over K (grouped_wgrad: MW x N output
    tiles; its reduction runs over rows) with ``elem_bytes``-byte inputs. Clamped so that no tile exceeds the
    GEMM (tl.dot needs >= 16) and the smem bound fits ``smem_budget`` bytes; memoized in PICKS. Host-only."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown MoE kernel {kernel!r}; choose one of {KERNELS}")
    if min(N, K, MW or 1) < 1:
        raise ValueError(f"{kernel}: GEMM dims must be >= 1, got N={N} K={K} MW={MW}")
    key = (kernel, N, K, MW, block_m, elem_bytes, smem_budget)
    if key not in PICKS:
        if INTERPRET:
            c = describe((WGRAD_CONFIGS if kernel == "grouped_wgrad" else ROW_CONFIGS)[0])
        else:
            c = dict(TABLE[(kernel, N >= WIDE_N)])
            c["BLOCK_N"] = min(c["BLOCK_N"], max(16, triton.next_power_of_2(N)))
            if kernel == "grouped_wgrad":
                c["BLOCK_MW"] = min(c["BLOCK_MW"], max(16, triton.next_power_of_2(MW)))
            else:  # grouped_wgrad's BLOCK_K steps over an expert's rows, unknown on the host
                c["BLOCK_K"] = min(c["BLOCK_K"], max(16, triton.next_power_of_2(K)))
            c = _fit(kernel, c, elem_bytes, block_m, smem_budget)
        warps, stages = c.pop("num_warps"), c.pop("num_stages")
        PICKS[key] = triton.Config(c, num_warps=warps, num_stages=stages)
    return PICKS[key]


@functools.cache
def smem_budget(device_index: int) -> int:
    """Shared memory one program may use on this CUDA device, in bytes (Triton's own limit)."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def launch_kwargs(c: triton.Config) -> dict:
    """Keyword arguments that launch a @triton.jit kernel with config ``c``."""
    return dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)


def describe(c: triton.Config) -> dict[str, int]:
    """A config as the dict TABLE holds."""
    return dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
