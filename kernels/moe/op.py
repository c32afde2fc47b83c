"""The one entry point models use for MoE experts: ``moe_experts(..., impl=...)``.

``reference``: the expert loop (kernels/moe/reference.py). ``grouped_mm``: permute + two
``torch._grouped_mm`` calls, autograd by torch (the baseline). ``triton``: our fused kernels as a
``torch.library`` custom op with an explicit backward (kernels/moe/triton_op.py).

Legend: T tokens, K top-k, D hidden, E experts, I intermediate, F = 2I, M = T*K sorted rows.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from kernels.moe.reference import experts_reference, sort_by_expert

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
    gate, up = torch._grouped_mm(xs_MD, w13_EFD.transpose(-2, -1), offs=offs_E).chunk(2, dim=-1)
    z_MD = torch._grouped_mm(F.silu(gate) * up, w2_EDI.transpose(-2, -1), offs=offs_E)
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
        from kernels.moe.triton_op import experts_triton

        return experts_triton(x_TD, ids_TK, weights_TK, w13_EFD, w2_EDI)
    raise ValueError(f"unknown MoE impl {impl!r}; choose reference, grouped_mm or triton")
