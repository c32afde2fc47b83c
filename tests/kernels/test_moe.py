"""MoE experts: Triton and torch._grouped_mm paths vs the reference loop, forward and all grads.

CPU runs Triton under TRITON_INTERPRET=1 (tests/conftest.py), so shapes are small; they still cover
experts with zero tokens, one hot expert (skewed routing), several row tiles per expert and
ragged tails (sizes not multiples of the 32-wide interpreter tiles). With a GPU the same cases run
compiled on CUDA (the `device` fixture); Qwen3-30B-A3B shapes in bf16 are in tests/gpu/test_moe_real_shapes.py.
"""

from __future__ import annotations

import pytest
import torch
from prime_spmd.kernels.moe.op import moe_experts

# fp32: measured max rel. error (vs max |ref|) 5.3e-7 over all outputs and grads; sums run in another order
FP32_RTOL = 1e-5
# fp32 Triton on CUDA: tl.dot takes fp32 tiles as TF32 (kernels/moe/README.md, "Limits"), 10-bit mantissa;
# passed at this tolerance on the H200 (docs/testing.md run 2, 2026-12-03; the error itself was not recorded).
FP32_TF32_RTOL = 1e-2
# bf16 inputs and outputs vs the fp32 reference on the same bf16 inputs: measured up to 1.1e-2 relative (dw13)
BF16_RTOL = 3e-2


def _routing(T: int, K: int, E: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    # skewed: every token picks expert 0; the other slots among experts 1..E/2 (the rest get nothing)
    rest = torch.stack([torch.randperm(E // 2 - 1, generator=gen)[: K - 1] + 1 for _ in range(T)])
    return torch.cat([torch.zeros(T, 1, dtype=torch.long), rest], dim=1)


def _case(T, K, D, E, inter, kind, dtype, device, seed=0):
    """Drawn on the CPU from one generator, then moved: the same numbers on every device."""
    gen = torch.Generator().manual_seed(seed)
    ids = _routing(T, K, E, kind, gen)
    x = torch.randn(T, D, generator=gen)
    w = torch.rand(T, K, generator=gen)
    w13 = torch.randn(E, 2 * inter, D, generator=gen) * D**-0.5
    w2 = torch.randn(E, D, inter, generator=gen) * inter**-0.5
    dout = torch.randn(T, D, generator=gen)
    return ids.to(device), [t.to(device, dtype) for t in (x, w, w13, w2)], dout.to(device, dtype)


def _run(impl, ids, tensors, dout):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    x, w, w13, w2 = leaves
    y = moe_experts(x, ids, w, w13, w2, impl=impl)
    grads = torch.autograd.grad(y, leaves, dout)
    return [y, *grads]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-6)).item()


@pytest.mark.parametrize(
    "T,K,D,E,inter,kind",
    [
        (37, 2, 48, 6, 24, "uniform"),  # expert counts ~12: one partial tile each
        (70, 4, 40, 8, 20, "skewed"),  # expert 0: 70 rows (3 tiles), experts 4..7: zero tokens
        (5, 1, 32, 4, 16, "uniform"),  # fewer rows than experts: some experts empty
    ],
)
@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
def test_matches_reference_fp32(T, K, D, E, inter, kind, impl, device):
    ids, tensors, dout = _case(T, K, D, E, inter, kind, torch.float32, device)
    ref = _run("reference", ids, tensors, dout)
    got = _run(impl, ids, tensors, dout)
    tol = FP32_TF32_RTOL if impl == "triton" and device.type == "cuda" else FP32_RTOL
    for name, a, b in zip(["out", "dx", "dweights", "dw13", "dw2"], got, ref):
        assert _rel(a, b) < tol, (name, _rel(a, b))
    if kind == "skewed":  # experts that got no token have exactly zero weight grads
        assert got[3][E // 2 :].abs().max() == 0 and got[4][E // 2 :].abs().max() == 0


def test_triton_bf16(device):
    ids, tensors, dout = _case(40, 2, 32, 4, 16, "skewed", torch.bfloat16, device)
    ref = _run("reference", ids, [t.float() for t in tensors], dout.float())
    got = _run("triton", ids, tensors, dout)
    for name, a, b in zip(["out", "dx", "dweights", "dw13", "dw2"], got, ref):
        assert a.dtype == torch.bfloat16
        assert _rel(a, b) < BF16_RTOL, (name, _rel(a, b))


def test_triton_no_grad_skips_saving(device):
    ids, (x, w, w13, w2), _ = _case(9, 2, 32, 4, 16, "uniform", torch.float32, device)
    with torch.no_grad():
        out, gu, *_ = torch.ops.prime_spmd.moe_experts_fwd(x, ids, w, w13, w2, False)
    assert gu.shape[0] == 0
    tol = FP32_TF32_RTOL if device.type == "cuda" else FP32_RTOL
    assert _rel(out, moe_experts(x, ids, w, w13, w2, impl="reference")) < tol


def test_opcheck(device):
    ids, (x, w, w13, w2), _ = _case(9, 2, 32, 4, 16, "uniform", torch.float32, device)
    args = (x.requires_grad_(), ids, w.requires_grad_(), w13.requires_grad_(), w2.requires_grad_(), True)
    torch.library.opcheck(
        torch.ops.prime_spmd.moe_experts_fwd.default,
        args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_triton_split_swiglu_backward(monkeypatch, device):
    """The unfused variant (dz GEMM, then an elementwise SwiGLU backward) gives the same grads."""
    from prime_spmd.kernels.moe import kernel

    monkeypatch.setattr(kernel, "FUSE_SWIGLU_BWD", False)
    ids, tensors, dout = _case(70, 4, 40, 8, 20, "skewed", torch.float32, device)
    ref = _run("reference", ids, tensors, dout)
    got = _run("triton", ids, tensors, dout)
    tol = FP32_TF32_RTOL if device.type == "cuda" else FP32_RTOL
    for name, a, b in zip(["out", "dx", "dweights", "dw13", "dw2"], got, ref):
        assert _rel(a, b) < tol, (name, _rel(a, b))


# which of (x, router weights, w13, w2) require grad: all, frozen experts (LoRA), frozen experts and x, only w2
GRAD_MASKS = [
    (True, True, True, True),
    (True, True, False, False),
    (False, True, False, False),
    (False, False, False, True),
]
# the Triton backward's launches (kernel.py's kernel names) for each mask, in order; forward: gate_up, grouped_gemm
BWD_LAUNCHES = {
    (True, True, True, True): ["dz_swiglu_bwd", "grouped_gemm", "grouped_wgrad", "grouped_wgrad"],
    (True, True, False, False): ["dz_swiglu_bwd", "grouped_gemm"],
    (False, True, False, False): ["dz_swiglu_bwd"],
    (False, False, False, True): ["grouped_wgrad"],
}


def _run_masked(impl, ids, tensors, dout, mask):
    """Forward and backward with only the tensors of ``mask`` requiring grad; their .grad (None for the others)."""
    leaves = [t.detach().clone().requires_grad_(m) for t, m in zip(tensors, mask)]
    y = moe_experts(*leaves[:1], ids, *leaves[1:], impl=impl)
    y.backward(dout)
    return y, [t.grad for t in leaves]


@pytest.mark.parametrize("mask", GRAD_MASKS)
@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
def test_frozen_inputs_get_no_grad_and_the_rest_match(impl, mask, device):
    """Frozen expert weights (LoRA) or a frozen input: those grads are None, the others match the reference."""
    ids, tensors, dout = _case(70, 4, 40, 8, 20, "skewed", torch.float32, device)
    ref = _run("reference", ids, tensors, dout)
    y, grads = _run_masked(impl, ids, tensors, dout, mask)
    tol = FP32_TF32_RTOL if impl == "triton" and device.type == "cuda" else FP32_RTOL
    assert _rel(y, ref[0]) < tol
    for name, g, r, m in zip(["dx", "dweights", "dw13", "dw2"], grads, ref[1:], mask):
        assert (g is None) == (not m), name
        if m:
            assert _rel(g, r) < tol, (name, _rel(g, r))


@pytest.mark.parametrize("mask", GRAD_MASKS)
def test_triton_backward_launches_only_the_asked_grads(monkeypatch, mask, device):
    """The weight-grad kernel does not run for frozen expert weights (nor the dx GEMM without a grad for x), and
    the forward saves h [M, I] only for dw2 and x only for dw13."""
    from prime_spmd.kernels.moe import kernel

    launches: list[str] = []
    launch = kernel._launch
    monkeypatch.setattr(kernel, "_launch", lambda name, *a, **kw: (launches.append(name), launch(name, *a, **kw)))
    T, K, D, E, inter = 37, 2, 48, 6, 24
    ids, tensors, dout = _case(T, K, D, E, inter, "uniform", torch.float32, device)
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(tuple(t.shape)), t)[1], lambda t: t):
        leaves = [t.detach().clone().requires_grad_(m) for t, m in zip(tensors, mask)]
        y = moe_experts(*leaves[:1], ids, *leaves[1:], impl="triton")
    assert launches == ["gate_up", "grouped_gemm"]
    launches.clear()
    y.backward(dout)
    assert launches == BWD_LAUNCHES[mask]
    assert ((T * K, inter) in saved) == mask[3] and ((T, D) in saved) == mask[2], saved


def test_grouped_mm_backward_skips_frozen_weight_grads(device):
    """torch's autograd runs only the grad GEMMs it needs: 4 ``_grouped_mm`` in the backward, 2 with frozen experts."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountGroupedMm(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._grouped_mm.default
            return func(*args, **(kwargs or {}))

    ids, tensors, dout = _case(37, 2, 48, 6, 24, "uniform", torch.float32, device)
    for mask, expected in [((True, True, True, True), 4), ((True, True, False, False), 2)]:
        leaves = [t.detach().clone().requires_grad_(m) for t, m in zip(tensors, mask)]
        y = moe_experts(*leaves[:1], ids, *leaves[1:], impl="grouped_mm")
        with CountGroupedMm() as mode:
            y.backward(dout)
        assert mode.count == expected, mask
