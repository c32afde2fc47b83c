"""The one entry point models use for MoE experts: ``moe_experts(..., impl=...)``.

``reference``: the expert loop (kernels/moe/reference.py). ``grouped_mm``: permute + two
``torch._grouped_mm`` calls, autograd by torch (the baseline). ``triton``: our fused kernels as a
``torch.library`` custom op (below) with an explicit backward; kernels in kernel.py.

Triton backward, with h = silu(g) * u, z = h W2^T, out[t] = sum_k w[t,k] z[t,k]:
    dz_un = dout[tok] @ W2[e]          (grouped GEMM, gathers dout rows)
    dw    = rowsum(h * dz_un)           (router-weight grads)
    dh    = w * dz_un ; dg, du from the SwiGLU derivative
    dx    = sum_k (dg|du) @ W13[e]      (grouped GEMM, scatters to (token, slot) order, then K-sum)
    dW2[e]  = sum_r (w dout[tok])^T h   (grouped weight-grad GEMM)
    dW13[e] = sum_r (dg|du)^T x[tok]
Only the grads autograd asks for are computed (``ctx.needs_input_grad``): with frozen expert weights (LoRA) the
two weight-grad GEMMs do not run and their [E, F, D] + [E, D, I] outputs are never allocated (1.2 GB bf16 a layer
at the Qwen3-30B-A3B shape), and h and x are not saved for them; without a grad for x the dx GEMM is skipped.

Legend (docs/conventions.md): T tokens, K top-k, D hidden, E experts, I intermediate, F = 2I, M = T*K rows
sorted by expert.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from prime_spmd.kernels.moe.reference import experts_reference, sort_by_expert

MoeImpl = Literal["reference", "grouped_mm", "triton"]


def unpermute_sum(z_MD: torch.Tensor, perm_M: torch.Tensor, T: int, K: int) -> torch.Tensor:
    """Put sorted rows back in (token, slot) order and sum the K slots: [M, D] -> [T, D]. Deterministic."""
    y_MD = torch.zeros_like(z_MD).index_copy(0, perm_M, z_MD)
    return y_MD.view(T, K, -1).sum(1)


def experts_grouped_mm(
    x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, w13_EFD: torch.Tensor, w2_EDI: torch.Tensor
) -> torch.Tensor:
    """Same math as the reference with ``torch._grouped_mm`` (CUDA: bf16, dims multiple of 8)."""
    T, K = ids_TK.shape
    perm_M, offs_E = sort_by_expert(ids_TK, w13_EFD.shape[0])
    xs_MD = x_TD[perm_M // K]
    gate_MI, up_MI = torch._grouped_mm(xs_MD, w13_EFD.transpose(-2, -1), offs=offs_E).chunk(2, dim=-1)
    z_MD = torch._grouped_mm(F.silu(gate_MI) * up_MI, w2_EDI.transpose(-2, -1), offs=offs_E)
    z_MD = z_MD * weights_TK.flatten()[perm_M, None].to(z_MD.dtype)
    return unpermute_sum(z_MD, perm_M, T, K)


def moe_experts(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDI: torch.Tensor,
    impl: MoeImpl = "reference",
) -> torch.Tensor:
    """MoE experts output [T, D] (see reference.py for the math); differentiable in x, weights, w13, w2."""
    if impl == "reference":
        return experts_reference(x_TD, ids_TK, weights_TK, w13_EFD, w2_EDI)
    if impl == "grouped_mm":
        return experts_grouped_mm(x_TD, ids_TK, weights_TK, w13_EFD, w2_EDI)
    if impl == "triton":
        store = torch.is_grad_enabled() and any(t.requires_grad for t in (x_TD, weights_TK, w13_EFD, w2_EDI))
        return torch.ops.prime_spmd.moe_experts_fwd(x_TD, ids_TK, weights_TK, w13_EFD, w2_EDI, store)[0]
    raise ValueError(f"unknown MoE impl {impl!r}; choose reference, grouped_mm or triton")


# ---- the Triton path as a torch.library op ----


@torch.library.custom_op("prime_spmd::moe_experts_fwd", mutates_args=())
def moe_experts_fwd(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDI: torch.Tensor,
    store_for_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, D], gate|up pre-activations [M, F] (0 rows unless stored), h [M, I], perm [M], offs [E])."""
    from prime_spmd.kernels.moe import kernel

    T, K = ids_TK.shape
    M = T * K
    perm_M, offs_E = sort_by_expert(ids_TK, w13_EFD.shape[0])
    tok_M = perm_M // K
    sched = kernel.tile_schedule(offs_E, M)
    x_TD, w13_EFD, w2_EDI = x_TD.contiguous(), w13_EFD.contiguous(), w2_EDI.contiguous()
    h_MI, gu_MF = kernel.gate_up_swiglu(x_TD, tok_M, w13_EFD, sched, store_for_backward)
    scale_M = weights_TK.flatten()[perm_M].contiguous()
    # down projection: row r's result, times its routing weight, lands at its (token, slot) index
    z_MD = kernel.grouped_gemm(h_MI, w2_EDI, sched, M, out_idx=perm_M, scale=scale_M)
    out_TD = z_MD.view(T, K, -1).sum(1)
    return out_TD, gu_MF, h_MI, perm_M, offs_E


@moe_experts_fwd.register_fake
def _(x_TD, ids_TK, weights_TK, w13_EFD, w2_EDI, store_for_backward):
    M, (E, F, _) = ids_TK.numel(), w13_EFD.shape
    return (
        torch.empty_like(x_TD),
        x_TD.new_empty(M if store_for_backward else 0, F),
        x_TD.new_empty(M, F // 2),
        ids_TK.new_empty(M, dtype=torch.int64),
        ids_TK.new_empty(E, dtype=torch.int32),
    )


@torch.library.custom_op("prime_spmd::moe_experts_bwd", mutates_args=())
def moe_experts_bwd(
    dout_TD: torch.Tensor,
    x_TD: torch.Tensor | None,
    weights_TK: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDI: torch.Tensor,
    gu_MF: torch.Tensor,
    h_MI: torch.Tensor | None,
    perm_M: torch.Tensor,
    offs_E: torch.Tensor,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [T, D], dweights [T, K], dw13 [E, F, D], dw2 [E, D, I]) for the forward above.

    ``needs_grad``: which of the four to compute; one not asked for comes back as an empty [0] tensor and its
    kernels do not run. ``x_TD`` may be None unless dw13 is asked for, ``h_MI`` unless dw2 is.
    """
    from prime_spmd.kernels.moe import kernel

    need_dx, need_dweights, need_dw13, need_dw2 = needs_grad
    T, K = weights_TK.shape
    M = perm_M.shape[0]
    tok_M = perm_M // K
    sched = kernel.tile_schedule(offs_E, M)
    dout_TD = dout_TD.contiguous().to(gu_MF.dtype)  # x's dtype
    w13_EFD, w2_EDI = w13_EFD.contiguous(), w2_EDI.contiguous()
    scale_M = weights_TK.flatten()[perm_M].contiguous()
    # one not asked for: a fresh empty tensor (a custom op's outputs may not alias each other)
    dx_TD, dweights_TK, dw13_EFD, dw2_EDI = (t.new_empty(0) for t in (gu_MF, weights_TK, w13_EFD, w2_EDI))
    if need_dx or need_dweights or need_dw13:
        # dz_un[r] = dout[tok r] @ W2[e] with the SwiGLU backward and rowsum(h * dz_un) in its epilogue
        dgu_MF, dw_M = kernel.dz_swiglu_bwd(dout_TD, tok_M, w2_EDI, gu_MF, scale_M, sched)
        if need_dweights:
            dweights_M = torch.empty(M, dtype=weights_TK.dtype, device=dout_TD.device)
            dweights_M[perm_M] = dw_M.to(weights_TK.dtype)
            dweights_TK = dweights_M.view(T, K)
        if need_dx:
            # dx rows: dgu[r] @ W13[e], W13 [E, F, D] read as the GEMM's [E, N, K] = [E, D, F]; scattered to
            # (token, slot)
            dx_TD = kernel.grouped_gemm(dgu_MF, w13_EFD.transpose(1, 2), sched, M, out_idx=perm_M).view(T, K, -1).sum(1)
        if need_dw13:
            assert x_TD is not None
            dw13_EFD = kernel.grouped_wgrad(dgu_MF, x_TD.contiguous(), offs_E, b_idx=tok_M).to(w13_EFD.dtype)
    if need_dw2:
        assert h_MI is not None
        dw2_EDI = kernel.grouped_wgrad(dout_TD, h_MI, offs_E, a_idx=tok_M, scale=scale_M).to(w2_EDI.dtype)
    return dx_TD, dweights_TK, dw13_EFD, dw2_EDI


@moe_experts_bwd.register_fake
def _(dout_TD, x_TD, weights_TK, w13_EFD, w2_EDI, gu_MF, h_MI, perm_M, offs_E, needs_grad):
    T, D = dout_TD.shape
    like = (dout_TD.new_empty(T, D, dtype=gu_MF.dtype), weights_TK, w13_EFD, w2_EDI)
    return tuple(torch.empty_like(t) if need else t.new_empty(0) for t, need in zip(like, needs_grad))


def _setup_context(ctx, inputs, output):
    x_TD, _, weights_TK, w13_EFD, w2_EDI, _ = inputs
    _, gu_MF, h_MI, perm_M, offs_E = output
    # indices into the op's inputs (x, ids, weights, w13, w2, store); x and h are saved only for the weight grads
    need_dw13, need_dw2 = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
    ctx.save_for_backward(
        x_TD if need_dw13 else None, weights_TK, w13_EFD, w2_EDI, gu_MF, h_MI if need_dw2 else None, perm_M, offs_E
    )


def _backward(ctx, dout_TD, _dgu, _dh, _dperm, _doffs):
    x_TD, weights_TK, w13_EFD, w2_EDI, gu_MF, h_MI, perm_M, offs_E = ctx.saved_tensors
    need_dx, _, need_dweights, need_dw13, need_dw2 = ctx.needs_input_grad[:5]
    if gu_MF.shape[0] != perm_M.shape[0] and (need_dx or need_dweights or need_dw13):
        raise RuntimeError("moe_experts_fwd ran with store_for_backward=False; its output has no backward")
    needs_grad = [need_dx, need_dweights, need_dw13, need_dw2]
    grads = torch.ops.prime_spmd.moe_experts_bwd(
        dout_TD, x_TD, weights_TK, w13_EFD, w2_EDI, gu_MF, h_MI, perm_M, offs_E, needs_grad
    )
    dx_TD, dweights_TK, dw13_EFD, dw2_EDI = (g if need else None for g, need in zip(grads, needs_grad))
    return dx_TD, None, dweights_TK, dw13_EFD, dw2_EDI, None


moe_experts_fwd.register_autograd(_backward, setup_context=_setup_context)
