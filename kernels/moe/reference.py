"""The spec: a loop over experts in plain PyTorch, differentiable by autograd, any device and dtype.

Legend (docs/conventions.md): T tokens, K experts per token (top-k), D hidden, E experts, I expert intermediate,
F = 2I, M = T*K routed rows; local letter of this file: Me the rows routed to expert e (a subset of M).
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
        tok_Me, slot_Me = torch.where(topk_ids_TK == e)
        if tok_Me.numel() == 0:
            continue
        gate_MeI, up_MeI = (x_TD[tok_Me] @ w13_EFD[e].T).chunk(2, dim=-1)
        y_MeD = (F.silu(gate_MeI) * up_MeI) @ w2_EDI[e].T
        y_MeD = y_MeD * topk_weights_TK[tok_Me, slot_Me, None].to(y_MeD.dtype)
        out_TD = out_TD.index_add(0, tok_Me, y_MeD.to(out_TD.dtype))
    return out_TD


def sort_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation of the T*K assignments grouped by expert, and group end offsets.

    Returns ``perm_M`` (int64 [M = T*K]: flat assignment index of each sorted row; its token is
    ``perm // K``) and ``offsets_E`` (int32 [E]: end of each expert's rows, cumulative counts, the
    ``offs`` convention of ``torch._grouped_mm``). Stable, so rows of one expert keep token order.
    No host sync.
    """
    ids_M = topk_ids_TK.flatten()
    perm_M = torch.sort(ids_M, stable=True).indices
    return perm_M, expert_counts(ids_M, num_experts).cumsum(0).to(torch.int32)


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: how many of ``ids`` (any shape, values in [0, E)) name each expert. Unlike ``torch.bincount``, which
    reads the largest id on the host on CUDA, no host sync, so a CUDA graph can hold it (the engine's MoE decode)."""
    flat = ids.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
