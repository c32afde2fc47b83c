"""Mixture-of-experts block: top-k softmax router and stacked experts.

Expert weights are stacked ([E, ...] tensors, dim 0 = expert) so that one grouped kernel runs all
experts and EP can shard dim 0; Hugging Face checkpoints store them per expert, and the mapping
lives in ``models/qwen3/hf.py``. The experts compute goes through ``prime_spmd.kernels.moe.op``.

Legend (docs/conventions.md): B batch, T tokens, K experts per token, D hidden, E experts, I expert intermediate,
F = 2I.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prime_spmd.kernels.moe.op import MoeImpl, moe_experts
from prime_spmd.kernels.moe.reference import expert_counts


class TopKRouter(nn.Module):
    """Softmax router (fp32) with top-k selection; ``norm_topk_prob`` renormalizes the kept weights."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, dim))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (probs_TE fp32, topk_weights_TK in x dtype, topk_ids_TK int64)."""
        logits_TE = F.linear(x_TD, self.weight)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float)
        weights_TK, ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return probs_TE, weights_TK.to(logits_TE.dtype), ids_TK


class GroupedExperts(nn.Module):
    """E SwiGLU experts as two stacked weights: ``gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I].

    ``impl`` picks the kernel: ``reference`` (loop, CPU default), ``triton`` (ours), ``grouped_mm``
    (``torch._grouped_mm``). EP replaces ``forward`` through ``distributed/ep.py``; the model code
    here stays single-device.
    """

    def __init__(self, dim: int, inter: int, num_experts: int, impl: MoeImpl = "reference") -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, inter))
        self.impl: MoeImpl = impl

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return self.compute(x_TD, ids_TK, weights_TK, self.gate_up_proj, self.down_proj)

    def compute(
        self,
        x_TD: torch.Tensor,
        ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        w13_EFD: torch.Tensor,
        w2_EDI: torch.Tensor,
    ) -> torch.Tensor:
        """The experts math with explicit weights (EP passes its local shards of the stacked weights)."""
        return moe_experts(x_TD, ids_TK, weights_TK, w13_EFD, w2_EDI, impl=self.impl)


def load_balance_loss(probs_TE: torch.Tensor, ids_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Switch-Transformer load-balance loss E * sum_e f_e * P_e and the per-expert counts [E] (float).

    f_e: fraction of the T*K token-slot assignments that went to expert e (no grad), P_e: mean router
    probability of expert e (fp32, carries the grad to the router). 1.0 at perfect balance, up to E / K
    when every token picks the same K experts. Unlike transformers' ``load_balancing_loss_func`` it is not
    multiplied by K and is taken per layer (the model averages layers).
    """
    E = probs_TE.shape[-1]
    with torch.no_grad():
        counts_E = expert_counts(ids_TK, E).float()
    return E * (counts_E / max(ids_TK.numel(), 1) * probs_TE.mean(0)).sum(), counts_E


GRAPH_SAFE_IMPLS = ("triton",)
"""Experts kernels a CUDA graph can hold: ``triton`` (device-side sort, counts and tile schedule; captured and
replayed on the H100 by tests/gpu/test_moe_engine_graphs_gpu.py). ``reference`` loops over the experts a batch routes
to (``torch.where``: a host sync); ``grouped_mm`` is not tried in a graph."""


def moe_graph_safe(model: nn.Module) -> bool:
    """True when every mixture-of-experts module of ``model`` is a ``MoEBlock`` whose experts run a graph-safe kernel
    (``GRAPH_SAFE_IMPLS``): the engine may capture its decode. Any other MoE module (a Hugging Face ``*Moe*`` block,
    whose expert loop reads routed ids on the host) makes it False."""
    for m in model.modules():
        if isinstance(m, MoEBlock):
            if m.experts.impl not in GRAPH_SAFE_IMPLS:
                return False
        elif "moe" in type(m).__name__.lower() and not any(isinstance(c, MoEBlock) for c in m.modules()):
            return False
    return True


class MoEBlock(nn.Module):
    """Router + experts; keeps the last forward's load-balance loss (``load_balance_loss``, with grad)
    and per-expert token counts. The router runs before the experts, so under EP both stay local to
    the rank (its own tokens, global expert ids).
    """

    def __init__(self, dim: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate = TopKRouter(dim, num_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(dim, inter, num_experts)
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(-1, D)
        probs_TE, weights_TK, ids_TK = self.gate(x_TD)
        self.aux_loss, self.tokens_per_expert = load_balance_loss(probs_TE, ids_TK)
        return self.experts(x_TD, ids_TK, weights_TK).view(B, T, D)
