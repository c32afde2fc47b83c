"""FP8 weights (kernels/fp8): the Triton quantize and FP8 decode linears vs the PyTorch reference, opcheck, the
prefill GEMM impls against the reference.

CPU runs Triton under TRITON_INTERPRET=1 (tests/conftest.py): 16 x 16 x 32 tiles and 64-wide quantize chunks, so the
small shapes cover several tiles and ragged edges. With CUDA the same tests run on the GPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from prime_spmd.kernels.fp8 import op
from prime_spmd.kernels.fp8.op import fp8_decode_linear, fp8_fused_linear, fp8_linear, quantize_fp8_
from prime_spmd.kernels.fp8.reference import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8_reference,
    fp8_decode_linear_reference,
    fp8_scaled_mm_reference,
    quantize_fp8_reference,
    quantize_rows_fp8_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SUBNORMAL_STEP = 2.0**-9  # e4m3's smallest step: the interpreter's rounding may differ there (kernel.py)


def _quantized(n, k, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    q = torch.empty(n, k, dtype=FP8_DTYPE, device=DEVICE)
    s = torch.empty(n, dtype=torch.float32, device=DEVICE)
    return w, q, s


@pytest.mark.parametrize("n,k", [(1, 1), (5, 64), (33, 200), (48, 130)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_matches_reference_and_round_trips(n, k, dtype):
    w, q, s = _quantized(n, k, dtype=dtype)
    w[0, 0] = 0.0
    quantize_fp8_(w, q, s, impl="triton")
    q_ref, s_ref = quantize_fp8_reference(w)
    assert torch.equal(s, s_ref)
    diff = (q.float() - q_ref.float()).abs()
    assert (diff <= SUBNORMAL_STEP).all(), diff.max()
    # round trip: within half an e4m3 step (3 mantissa bits: relative 2^-4) of each row's value, plus the subnormal step
    back = dequantize_fp8_reference(q, s, torch.float32)
    tol = w.float().abs() * 2.0**-4 + s[:, None] * SUBNORMAL_STEP + 1e-30
    assert ((back - w.float()).abs() <= tol).all()


def test_quantize_writes_row_slices_of_a_fused_tensor_and_zero_rows():
    w, q, s = _quantized(24, 96)
    w[3:5] = 0.0
    quantize_fp8_(w[8:16], q[8:16], s[8:16], impl="triton")
    quantize_fp8_(w[:8], q[:8], s[:8], impl="reference")
    quantize_fp8_(w[16:], q[16:], s[16:], impl="triton")
    q_ref, s_ref = quantize_fp8_reference(w)
    assert torch.equal(s, s_ref) and (q.float() - q_ref.float()).abs().max() <= SUBNORMAL_STEP
    assert (q[3:5].float() == 0).all()


def test_quantize_rejects_bad_outputs():
    w, q, s = _quantized(4, 32)
    with pytest.raises(ValueError, match="float8"):
        quantize_fp8_(w, q.float(), s)
    with pytest.raises(ValueError, match="want w, q"):
        quantize_fp8_(w, q[:2], s)


def _decode_case(m, k, n, act, dtype, seed=0, bias=False, norm=False, residual=False):
    gen = torch.Generator().manual_seed(seed)
    no = n // 2 if act == "silu_mul" else n
    x = (torch.randn(m, k, generator=gen) * 3).to(DEVICE, dtype)

    def opt(flag, *shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype) if flag else None

    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEVICE, dtype)
    q, s = quantize_fp8_reference(w)
    return dict(
        x_MK=x, q_NK=q, scale_N=s, bias_N=opt(bias, n, scale=0.1), norm_w_K=opt(norm, k),
        residual_MNo=opt(residual, m, no), act=act,
    )  # fmt: skip


# fp32: one summation order against another over K <= 200 of exact e4m3 products (interpreter: IEEE fp32 dots)
FP32_RTOL = 1e-5


@pytest.mark.parametrize(
    "m,k,n,act,flags",
    [
        (m, k, n, act, flags)
        for (m, k, n), act, flags in itertools.product(
            [(1, 64, 48), (1, 200, 34), (3, 96, 64), (17, 130, 40)],
            ["none", "silu_mul"],
            [(False, False, False), (True, True, True), (False, True, False), (True, False, True)],
        )
    ],
)
def test_fp8_decode_linear_fp32_matches_reference(m, k, n, act, flags):
    bias, norm, res = flags
    case = _decode_case(m, k, n, act, torch.float32, bias=bias, norm=norm, residual=res)
    got = fp8_decode_linear(**case, impl="triton")
    ref = fp8_decode_linear_reference(**case)
    torch.testing.assert_close(got, ref, rtol=FP32_RTOL, atol=FP32_RTOL)


@pytest.mark.parametrize("act", ["none", "silu_mul"])
@pytest.mark.parametrize("flags", [(False, False, False), (True, True, True)])
def test_fp8_gemv_preloaded_form_matches_reference(act, flags):
    """The GEMV's PDL form (whole w slab and scales before the wait), forced by the config without PDL."""
    from prime_spmd.kernels.fp8 import kernel

    bias, norm, res = flags
    case = _decode_case(1, 200, 34, act, torch.float32, bias=bias, norm=norm, residual=res)
    args = [case[k] for k in ("x_MK", "q_NK", "scale_N", "bias_N", "norm_w_K")]
    got = kernel.fp8_decode_linear(*args, 1e-6, case["residual_MNo"], act == "silu_mul", ("gemv", 4, 32, 1, True))
    torch.testing.assert_close(got, fp8_decode_linear_reference(**case), rtol=FP32_RTOL, atol=FP32_RTOL)


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("act", ["none", "silu_mul"])
def test_fp8_decode_linear_bf16_within_one_rounding(m, act):
    case = _decode_case(m, 128, 64, act, torch.bfloat16, seed=1, bias=True, norm=True, residual=True)
    got = fp8_decode_linear(**case, impl="triton").float()
    ref = fp8_decode_linear_reference(**case).float()
    # bf16 outputs: one summation order against another may flip the last bit of a rounding (2^-8 relative) that the
    # SiLU-gate and residual then carry; measured max here: one bf16 ulp of the largest outputs
    torch.testing.assert_close(got, ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


def test_fp8_decode_linear_opcheck_and_bad_inputs():
    case = _decode_case(2, 64, 32, "silu_mul", torch.float32, bias=True, norm=True, residual=True)
    args = (
        case["x_MK"],
        case["q_NK"],
        case["scale_N"],
        case["bias_N"],
        case["norm_w_K"],
        1e-6,
        case["residual_MNo"],
        True,
    )
    # test_schema perturbs every tensor input by arithmetic, which float8 tensors do not support on CPU
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.prime_spmd.fp8_decode_linear.default, args, test_utils=utils)
    with pytest.raises(ValueError, match="q must be"):
        fp8_decode_linear(case["x_MK"], case["q_NK"].float(), case["scale_N"])
    with pytest.raises(ValueError, match="act"):
        fp8_decode_linear(case["x_MK"], case["q_NK"], case["scale_N"], act="gelu")


@pytest.mark.parametrize("impl", ["dequant", "scaled_mm"])
def test_fp8_linear_impls_near_the_reference(impl):
    """Prefill's GEMMs (3-D x, bias) against the upcast reference. dequant rounds the weight to bf16 only where x is
    bf16 (exact here in fp32 / one bf16 rounding); scaled_mm also rounds x to e4m3 per row (relative 2^-4 a value),
    so its tolerance is e4m3's."""
    gen = torch.Generator().manual_seed(2)
    dtype = torch.bfloat16
    x = torch.randn(2, 5, 64, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(48, 64, generator=gen) * 0.125).to(DEVICE, dtype)
    b = torch.randn(48, generator=gen).to(DEVICE, dtype)
    q, s = quantize_fp8_reference(w)
    ref = fp8_linear(x, q, s, b, impl="reference").float()
    got = fp8_linear(x, q, s, b, impl=impl).float()
    assert got.shape == (2, 5, 48) and got.dtype == torch.float32
    tol = 2**-7 if impl == "dequant" else 2**-3
    assert (got - ref).abs().max() <= tol * ref.abs().max(), (got - ref).abs().max()


def test_activation_quantize_round_trips_per_row():
    """``quantize_rows_fp8_reference`` (the ``_scaled_mm`` path's x): each row's amax maps to 448, the rest within half
    an e4m3 step (relative 2^-4) plus the subnormal step, a zero row to zeros."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 96, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0])[:, None]).to(DEVICE)
    x[3] = 0.0
    xq, s = quantize_rows_fp8_reference(x.bfloat16())
    assert xq.dtype == FP8_DTYPE and s.shape == (5, 1) and s.dtype == torch.float32
    assert (xq.float().abs().amax(1)[[0, 1, 2, 4]] == FP8_MAX).all() and (xq[3].float() == 0).all()
    back = xq.float() * s
    xb = x.bfloat16().float()
    assert ((back - xb).abs() <= xb.abs() * 2.0**-4 + s * SUBNORMAL_STEP).all()


@pytest.mark.parametrize("impl", ["triton", "scaled_mm"])
def test_tile_rows_dispatch(impl, monkeypatch):
    """One row of K <= GEMV_MAX_K takes the GEMV whatever TILE_ROWS_IMPL says; more rows (or a longer K) take the tile
    kernel or, for bf16, _scaled_mm; an unknown setting is a ValueError naming the environment variable."""
    monkeypatch.setattr(op, "TILE_ROWS_IMPL", impl)
    assert op.tile_rows_impl(1, 4096, torch.bfloat16) == "gemv"
    assert op.tile_rows_impl(1, op.GEMV_MAX_K, torch.bfloat16) == "gemv"
    assert op.tile_rows_impl(1, 2 * op.GEMV_MAX_K, torch.bfloat16) == impl
    assert op.tile_rows_impl(2, 1024, torch.bfloat16) == impl
    assert op.tile_rows_impl(64, 1024, torch.float32) == "triton"  # row-wise _scaled_mm writes bf16 only
    monkeypatch.setattr(op, "TILE_ROWS_IMPL", "cublas")
    with pytest.raises(ValueError, match="PRIME_SPMD_FP8_TILE_ROWS.*'cublas'"):
        op.tile_rows_impl(2, 1024, torch.bfloat16)


# bf16 outputs of the same e4m3 products: on CPU (torch 2.13 _scaled_mm) bit-equal to the reference (max error 0); on
# CUDA another summation order may flip one rounding (2^-8 relative) that the SiLU-gate and residual carry
SCALED_MM_RTOL = 2**-7


@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("flags", [(False, False, False), (True, True, True), (False, False, True)])
@pytest.mark.parametrize("act", ["none", "silu_mul"])
def test_fused_linear_scaled_mm_path_matches_its_reference(m, flags, act, monkeypatch):
    """TILE_ROWS_IMPL "scaled_mm": the norm, ``torch._scaled_mm`` (runs on CPU since torch 2.6) and the epilogue
    against decode_linear's norm / epilogue around ``fp8_scaled_mm_reference``; one row takes the GEMV (weight-only,
    the Triton op), so it equals fp8_decode_linear's reference, not the activation-rounding one."""
    from prime_spmd.kernels.decode_linear.reference import finish_output, norm_input

    monkeypatch.setattr(op, "TILE_ROWS_IMPL", "scaled_mm")
    bias, norm, res = flags
    case = _decode_case(m, 96, 64, act, torch.bfloat16, seed=4, bias=bias, norm=norm, residual=res)
    args = [case[k] for k in ("x_MK", "q_NK", "scale_N", "bias_N", "norm_w_K")]
    got = fp8_fused_linear(*args, 1e-6, case["residual_MNo"], act == "silu_mul").float()
    if m == 1:
        ref = fp8_decode_linear_reference(**case).float()
    else:
        y = fp8_scaled_mm_reference(norm_input(case["x_MK"], case["norm_w_K"], 1e-6), *args[1:4])
        ref = finish_output(y, act, case["residual_MNo"]).float()
        # and not the weight-only result: the activations were rounded to e4m3
        assert not torch.equal(got, fp8_decode_linear_reference(**case).float())
    torch.testing.assert_close(got, ref, rtol=SCALED_MM_RTOL, atol=SCALED_MM_RTOL * ref.abs().max().item())


@pytest.mark.parametrize("k", [96, 200])
def test_fp8_gemv_default_config_matches_reference(k, monkeypatch):
    """The GEMV at its own GPU config (4 columns, ``gemv_config`` with the interpreter's guard lifted) and both forms
    (chunked, preloaded) over a ragged K."""
    from prime_spmd.kernels.fp8 import kernel

    monkeypatch.setattr(kernel, "INTERPRET", False)
    cfg = kernel.gemv_config(34, k, False)
    monkeypatch.undo()
    assert cfg[:2] == ("gemv", 4)
    case = _decode_case(1, k, 34, "none", torch.float32, seed=5, bias=True, norm=True, residual=False)
    args = [case[n] for n in ("x_MK", "q_NK", "scale_N", "bias_N", "norm_w_K")]
    for preload in (False, True):
        got = kernel.fp8_decode_linear(*args, 1e-6, None, False, (*cfg[:2], 64, 1, preload))
        torch.testing.assert_close(got, fp8_decode_linear_reference(**case), rtol=FP32_RTOL, atol=FP32_RTOL)


AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from prime_spmd.kernels.fp8 import kernel as K

def compile(fn, sig, consts):
    sig = dict(sig, **{c: "constexpr" for c in consts})
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))

compile(K._quantize_kernel, dict(w_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", K="i32", sw="i32", sq="i32"),
        dict(BLOCK_K=2048, RNE_EMU=False))
ptrs = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", b_ptr="*bf16", nw_ptr="*bf16", r_ptr="*bf16", o_ptr="*bf16")
flags = dict(HAS_BIAS=True, HAS_NORM=True, HAS_RES=True, SILU_MUL=True, RNE_EMU=False, USE_PDL=False)
for preload in (False, True):
    compile(K._fp8_gemv_kernel, dict(ptrs, NO="i32", eps="fp32", swn="i32"),
            dict(flags, K=1024, BLOCK_N=2, BLOCK_K=1024, PRELOAD=preload, KP=1024))
compile(K._fp8_tile_kernel, dict(ptrs, M="i32", K="i32", NO="i32", eps="fp32", sxm="i32", swn="i32", srm="i32", som="i32"),
        dict(flags, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, UPCAST=False, IEEE=False))
print("ok")
"""


def test_kernels_compile_for_sm90():
    """The interpreter checks neither Triton's typing nor its rule that globals be constexpr: compile the three kernels
    for sm_90 (bf16 activations, e4m3 weights) ahead of time, in a process without TRITON_INTERPRET. Needs only the
    Triton wheel (its bundled ptxas); ~10 s on 2 CPU cores."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
