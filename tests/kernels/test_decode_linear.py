"""Fused decode linear: the Triton kernel vs the PyTorch reference, opcheck, compile and CUDA-graph capture.

CPU runs Triton under TRITON_INTERPRET=1 (tests/conftest.py) with 16 x 16 x 32 tiles, so the small
shapes still cover several tiles over N and K, ragged edges in M, N and K, and more than one row block.
With CUDA the same tests run on the GPU (the interpreter is then off), at the engine's tile sizes.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from prime_spmd.kernels.decode_linear.op import decode_linear
from prime_spmd.kernels.decode_linear.reference import decode_linear_reference

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
# fp32: one summation order against another over K <= 200 (interpreter: IEEE fp32 dots; GPU: no TF32)
FP32_RTOL = 1e-5


def _case(m, k, n, act, dtype, device, seed=0, bias=False, norm=False, residual=False):
    gen = torch.Generator().manual_seed(seed)
    no = n // 2 if act == "silu_mul" else n
    x = torch.randn(m, k, generator=gen) * 3

    def opt(flag, *shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype) if flag else None

    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, dtype)
    return dict(
        x_MK=x.to(device, dtype),
        w_NK=w,
        bias_N=opt(bias, n, scale=0.5),
        norm_w_K=opt(norm, k, scale=0.3),
        residual_MNo=opt(residual, m, no),
        act=act,
    )


SHAPES = [
    # m, k, n: ragged N and K (not multiples of the tiles), M 1 / odd / past one row block
    (1, 64, 48),
    (3, 200, 70),
    (17, 96, 64),
    (40, 33, 130),
]


def _ulps_bf16(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """|got - ref| in units of the bf16 spacing (2^(exponent - 7)) of ``scale`` (default ref), elementwise.
    With a residual, pass scale = max(|ref|, |residual|): where the add cancels, a one-step difference of
    the GEMM's rounded output is many steps of the small sum."""
    mag = ref.float().abs() if scale is None else scale.float().abs()
    spacing = torch.exp2(torch.floor(torch.log2(mag.clamp_min(1e-30))) - 7)
    return (got.float() - ref.float()).abs() / spacing


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act", ["none", "silu_mul"])
def test_matches_reference_fp32(device, shape, act):
    m, k, n = shape
    for bias, norm, residual in itertools.product((False, True), repeat=3):
        case = _case(m, k, n, act, torch.float32, device, bias=bias, norm=norm, residual=residual)
        ref = decode_linear(**case, impl="reference")
        got = decode_linear(**case, impl="triton")
        assert got.shape == ref.shape and got.dtype == torch.float32
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < FP32_RTOL, (bias, norm, residual, err)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["none", "silu_mul"])
def test_matches_reference_bf16(device, act):
    """bf16 rounds after the GEMM, the SiLU, the gate product and the residual, as the unfused layer does: the
    kernel differs from the reference only by summation order inside fp32, so nearly all outputs are
    bit-equal and the rest a rounding step or two away."""
    m, k, n = 5, 160, 96
    case = _case(m, k, n, act, torch.bfloat16, device, seed=1, bias=True, norm=True, residual=True)
    ref = decode_linear(**case, impl="reference")
    got = decode_linear(**case, impl="triton")
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    ulps = _ulps_bf16(got, ref)
    assert (got == ref).float().mean().item() > 0.9
    assert ulps.max().item() <= 4, ulps.max().item()


@pytest.mark.parametrize("device", DEVICES)
def test_norm_rounds_like_the_unfused_layer(device):
    """The normed input is rounded to bf16 before the GEMM: with weights of one nonzero entry per row, out
    picks single elements of norm_w * norm(x), which must equal the reference's exactly."""
    m, k = 2, 64
    case = _case(m, k, k, "none", torch.bfloat16, device, seed=2, norm=True)
    case["w_NK"] = torch.eye(k, device=device, dtype=torch.bfloat16)
    ref = decode_linear_reference(**case)
    got = decode_linear(**case, impl="triton")
    assert torch.equal(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise(device):
    case = _case(2, 32, 16, "none", torch.float32, device)
    with pytest.raises(ValueError, match="act 'gelu'"):
        decode_linear(**{**case, "act": "gelu"}, impl="triton")
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        decode_linear(**{**case, "x_MK": case["x_MK"][:, :31]}, impl="triton")
    with pytest.raises(ValueError, match=r"residual must be \[2, 8\]"):
        decode_linear(**{**case, "act": "silu_mul", "residual_MNo": case["x_MK"][:, :16]}, impl="triton")
    with pytest.raises(ValueError, match="bias is torch.bfloat16"):
        decode_linear(**{**case, "bias_N": torch.zeros(16, device=device, dtype=torch.bfloat16)}, impl="triton")
    with pytest.raises(ValueError, match="w's last dim must be contiguous"):
        decode_linear(**{**case, "w_NK": case["w_NK"].T.contiguous().T}, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        decode_linear(**case, impl="cublas")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    case = _case(3, 48, 32, "silu_mul", torch.float32, device, bias=True, norm=True, residual=True)
    args = (case["x_MK"], case["w_NK"], case["bias_N"], case["norm_w_K"], 1e-6, case["residual_MNo"], True)
    torch.library.opcheck(torch.ops.prime_spmd.decode_linear, args)
    torch.library.opcheck(
        torch.ops.prime_spmd.decode_linear, (case["x_MK"], case["w_NK"], None, None, 1e-6, None, False)
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_replay_reads_new_inputs():
    """Captured once; x, the weights and the residual updated in place between replays, as the engine does."""
    case = _case(4, 1024, 6144, "silu_mul", torch.bfloat16, "cuda", seed=3, norm=True, residual=True)
    args = {k: v for k, v in case.items()}
    decode_linear(**args, impl="triton")  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_linear(**args, impl="triton")
    for _ in range(3):
        case["x_MK"].normal_()
        case["w_NK"].mul_(1.1)
        case["residual_MNo"].normal_()
        graph.replay()
        ref = decode_linear_reference(**case)
        scale = torch.maximum(ref.float().abs(), case["residual_MNo"].float().abs())
        assert (out == ref).float().mean().item() > 0.9
        assert _ulps_bf16(out, ref, scale).max().item() <= 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["none", "silu_mul"])
def test_gemv_matches_reference(device, act):
    """One-row steps take the GEMV kernel (kernel.GEMV_MAX_ROWS): fp32 over every bias / norm / residual
    combination and ragged N and K (the interpreter's 4-column programs and 32-wide K chunks), bf16 within the
    tile kernel's rounding bounds, and the norm's bf16 rounding exact (identity w)."""
    from prime_spmd.kernels.decode_linear import kernel

    assert kernel.GEMV_MAX_ROWS == 1
    for (k, n), (bias, norm, residual) in itertools.product(
        [(64, 48), (200, 70), (33, 130), (96, 6)], itertools.product((False, True), repeat=3)
    ):
        case = _case(1, k, n, act, torch.float32, device, seed=k + n, bias=bias, norm=norm, residual=residual)
        ref = decode_linear_reference(**case)
        args = (case["x_MK"], case["w_NK"], case["bias_N"], case["norm_w_K"], 1e-6, case["residual_MNo"])
        no = n // 2 if act == "silu_mul" else n
        for preload in (False, True):  # True: PDL's form (the whole w slab loaded first), here without PDL
            cfg = (*kernel.gemv_config(no, k, act == "silu_mul"), preload)
            got = kernel.decode_linear(*args, act == "silu_mul", config=cfg)
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            assert err < FP32_RTOL, (k, n, bias, norm, residual, preload, err)
    case = _case(1, 160, 96, act, torch.bfloat16, device, seed=1, bias=True, norm=True, residual=True)
    ref = decode_linear_reference(**case)
    got = decode_linear(**case, impl="triton")  # the default path at one row
    tiled = kernel.decode_linear(
        *(case[a] for a in ("x_MK", "w_NK", "bias_N", "norm_w_K")), 1e-6, case["residual_MNo"], act == "silu_mul",
        config=kernel.default_config(1, ref.shape[1], 160, act == "silu_mul", 2),
    )  # fmt: skip
    scale = torch.maximum(ref.float().abs(), case["residual_MNo"].float().abs())
    # bit-equal share: the GEMV sums over K in another order than cuBLAS (per-thread runs, then a tree), so more of
    # its fp32 sums round to the other bf16 neighbour: 0.854 of these 48 outputs on the H200 (2026-12-05), the
    # tile kernel > 0.9; the bound that matters, a few rounding steps at most, is the same for both
    for out, share in ((got, 0.75), (tiled, 0.9)):
        assert (out == ref).float().mean().item() > share and _ulps_bf16(out, ref, scale).max().item() <= 4
    preloaded = kernel.decode_linear(
        *(case[a] for a in ("x_MK", "w_NK", "bias_N", "norm_w_K")), 1e-6, case["residual_MNo"], act == "silu_mul",
        config=(*kernel.gemv_config(ref.shape[1], 160, act == "silu_mul"), True),
    )  # fmt: skip
    assert (preloaded == ref).float().mean().item() > 0.75 and _ulps_bf16(preloaded, ref, scale).max().item() <= 4
    eye = _case(1, 64, 64, "none", torch.bfloat16, device, seed=2, norm=True)
    eye["w_NK"] = torch.eye(64, device=device, dtype=torch.bfloat16)
    assert torch.equal(decode_linear(**eye, impl="triton"), decode_linear_reference(**eye))
    for preload in (False, True):
        cfg = (*kernel.gemv_config(64, 64, False), preload)
        args = (eye["x_MK"], eye["w_NK"], None, eye["norm_w_K"], 1e-6, None, False)
        assert torch.equal(kernel.decode_linear(*args, config=cfg), decode_linear_reference(**eye))


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_config_takes_one_row(device):
    from prime_spmd.kernels.decode_linear import kernel

    case = _case(2, 32, 16, "none", torch.float32, device)
    with pytest.raises(ValueError, match="takes one row, got 2"):
        kernel.decode_linear(case["x_MK"], case["w_NK"], None, None, 1e-6, None, False, config=("gemv", 4, 32, 1))
