"""The decode step's glue as Triton kernels (the spec: reference.py).

A decode step of a small batch is a chain of short kernels (docs/inference.md, decode profile): in eager PyTorch its
inputs are five (embedding gather, two RoPE-row gathers, +1, clamp) and its state update four (compiled), each ~1-2.5
us plus a launch gap on an H100, ~20 us a step around ~0.8 ms. Here each is one launch. ``step_inputs`` lets the next
kernel launch at once (PDL's ``launch_dependents``, while PDL is on: the PDL decode linear after it loads its weights
while the gathers run, and waits for them before it reads x); ``advance`` is launched with PDL after the sampler.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from prime_spmd.kernels.pdl.launch import enabled as pdl_enabled
from prime_spmd.kernels.pdl.launch import gdc_launch_dependents, launch_options, pdl_enter

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _step_inputs_kernel(
    ids_ptr, pos_ptr, emb_ptr, cos_ptr, sin_ptr, x_ptr, cos_out_ptr, sin_out_ptr, lens_ptr,
    D, DH, kv_len, s_emb, s_cos, s_sin,
    BLOCK_D: tl.constexpr, BLOCK_DH: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Row b (axis 0): its embedding row, RoPE rows and attended length. Launched without PDL (the step's first
    kernel); with USE_PDL it lets the next kernel launch before its own loads."""
    if USE_PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    tok = tl.load(ids_ptr + b).to(tl.int64)
    p = tl.load(pos_ptr + b).to(tl.int64)
    rd = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + rd
        m = offs < D
        tl.store(x_ptr + b * D + offs, tl.load(emb_ptr + tok * s_emb + offs, mask=m), mask=m)
    offs = tl.arange(0, BLOCK_DH)
    m = offs < DH
    tl.store(cos_out_ptr + b * DH + offs, tl.load(cos_ptr + p * s_cos + offs, mask=m), mask=m)
    tl.store(sin_out_ptr + b * DH + offs, tl.load(sin_ptr + p * s_sin + offs, mask=m), mask=m)
    tl.store(lens_ptr + b, tl.minimum(p + 1, kv_len))


@triton.jit
def _advance_kernel(
    ids_ptr, pos_ptr, steps_ptr, out_ptr, tok_ptr, lp_ptr, B, s_out, max_pos,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """All B rows in one program (B <= a few hundred)."""
    pdl_enter(USE_PDL)
    offs = tl.arange(0, BLOCK)
    m = offs < B
    tok = tl.load(tok_ptr + offs, mask=m, other=0)
    lp = tl.load(lp_ptr + offs, mask=m, other=0.0)
    pos = tl.load(pos_ptr + offs, mask=m, other=0)
    steps = tl.load(steps_ptr + offs, mask=m, other=0)
    tl.store(ids_ptr + offs, tok.to(ids_ptr.dtype.element_ty), mask=m)
    tl.store(pos_ptr + offs, tl.minimum(pos + 1, max_pos), mask=m)
    tl.store(steps_ptr + offs, steps + 1, mask=m)
    tl.store(out_ptr + offs, tok.to(tl.float64), mask=m)
    tl.store(out_ptr + s_out + offs, lp.to(tl.float64), mask=m)


def _check_rows(name: str, t: torch.Tensor, b: int, device: torch.device) -> None:
    if t.ndim != 1 or t.shape[0] != b or t.stride(0) != 1 or t.device != device:
        raise ValueError(f"decode_glue: {name} must be a contiguous [{b}] tensor on {device}, got {list(t.shape)} "
                         f"stride {t.stride()} on {t.device}")  # fmt: skip


def step_inputs(
    ids_B: torch.Tensor, pos_B: torch.Tensor, embed_VD: torch.Tensor, cos_TDh: torch.Tensor, sin_TDh: torch.Tensor,
    kv_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(x [B, D], cos [B, Dh], sin [B, Dh], lens [B] int64) as ``reference.step_inputs_reference``, in one launch.
    ``ids`` must hold token ids < V (the engine's sampled tokens; not checked on the device) and ``pos`` positions
    inside the tables."""
    b, dev = ids_B.shape[0], ids_B.device
    _check_rows("ids", ids_B, b, dev)
    _check_rows("pos", pos_B, b, dev)
    for name, t in (("embed", embed_VD), ("cos", cos_TDh), ("sin", sin_TDh)):
        if t.ndim != 2 or t.stride(1) != 1 or t.device != dev:
            raise ValueError(f"decode_glue: {name} must be 2-D with a contiguous last dim on {dev}, got "
                             f"{list(t.shape)} stride {t.stride()} on {t.device}")  # fmt: skip
    if cos_TDh.shape != sin_TDh.shape:
        raise ValueError(f"decode_glue: cos {list(cos_TDh.shape)} and sin {list(sin_TDh.shape)} differ")
    d, dh = embed_VD.shape[1], cos_TDh.shape[1]
    x = torch.empty(b, d, device=dev, dtype=embed_VD.dtype)
    cos = torch.empty(b, dh, device=dev, dtype=cos_TDh.dtype)
    sin = torch.empty(b, dh, device=dev, dtype=sin_TDh.dtype)
    lens = torch.empty(b, device=dev, dtype=torch.int64)
    if b:
        _step_inputs_kernel[(b,)](
            ids_B, pos_B, embed_VD, cos_TDh, sin_TDh, x, cos, sin, lens,
            d, dh, kv_len, embed_VD.stride(0), cos_TDh.stride(0), sin_TDh.stride(0),
            BLOCK_D=min(triton.next_power_of_2(d), 64 if INTERPRET else 2048), BLOCK_DH=triton.next_power_of_2(dh),
            USE_PDL=pdl_enabled(), num_warps=4,
        )  # fmt: skip
    return x, cos, sin, lens


def advance(ids_B, pos_B, steps_B, out_2B, tokens_B, logprobs_B, max_pos: int) -> None:
    """``reference.advance_reference`` in one launch (with PDL while it is on). ``out_2B`` float64 [2, B] with a
    contiguous last dim; the [B] tensors contiguous."""
    b, dev = ids_B.shape[0], ids_B.device
    for name, t in (("ids", ids_B), ("pos", pos_B), ("steps", steps_B), ("tokens", tokens_B), ("logprobs", logprobs_B)):
        _check_rows(name, t, b, dev)
    if out_2B.shape != (2, b) or out_2B.stride(1) != 1 or out_2B.dtype != torch.float64:
        raise ValueError(f"decode_glue: out must be float64 [2, {b}] with a contiguous last dim, got "
                         f"{out_2B.dtype} {list(out_2B.shape)} stride {out_2B.stride()}")  # fmt: skip
    if b:
        use_pdl = pdl_enabled()
        _advance_kernel[(1,)](
            ids_B, pos_B, steps_B, out_2B, tokens_B, logprobs_B, b, out_2B.stride(0), max_pos,
            BLOCK=triton.next_power_of_2(b), USE_PDL=use_pdl, num_warps=4, **launch_options(),
        )  # fmt: skip
