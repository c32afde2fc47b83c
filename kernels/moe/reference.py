"""The spec: a loop over experts in plain PyTorch, differentiable by autograd, any device and dtype.

Legend: T tokens, K experts per token (top-k), D hidden, E experts, I expert intermediate, F = 2I.
Weights use the nn.Linear layout (out, in): ``w13_EFD`` holds gate rows [0, I) then up rows [I, 2I)
(Hugging Face's ``Qwen3MoeExperts.gate_up_proj``), ``w2_EDI`` the down projection.

    y[t] = sum_k topk_weights[t, k] * W2[e] @ (silu(Wg[e] @ x[t]) * (Wu[e] @ x[t])),  e = topk_ids[t, k]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def experts_reference(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDI: torch.Tensor,
) -> torch.Tensor:
    """The MoE experts output [T, D] in x's dtype (see the module docstring); loops over experts."""
    out_TD = torch.zeros_like(x_TD)
    for e in range(w13_EFD.shape[0]):
        tok, slot = torch.where(topk_ids_TK == e)
        if tok.numel() == 0:
            continue
        gate, up = (x_TD[tok] @ w13_EFD[e].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2_EDI[e].T
        y = y * topk_weights_TK[tok, slot, None].to(y.dtype)
        out_TD = out_TD.index_add(0, tok, y.to(out_TD.dtype))
    return out_TD


def sort_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation of the T*K assignments grouped by expert, and group end offsets.

    Returns ``perm_M`` (int64 [M = T*K]: flat assignment index of each sorted row; its token is
    ``perm // K``) and ``offsets_E`` (int32 [E]: end of each expert's rows, cumulative counts, the
    ``offs`` convention of ``torch._grouped_mm``). Stable, so rows of one expert keep token order.
    No host sync.
    """
    flat = topk_ids_TK.flatten()
    perm_M = torch.sort(flat, stable=True).indices
    counts_E = torch.bincount(flat, minlength=num_experts)
    return perm_M, counts_E.cumsum(0).to(torch.int32)
