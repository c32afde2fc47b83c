"""Expert parallelism: experts sharded over the ``ep`` mesh axis, tokens moved by all-to-all.

``apply_ep(experts_module, ep_group)`` keeps rank r's slice [r*El, (r+1)*El) of every stacked expert
weight (dim 0 = expert, El = E / ep) and wraps the module's forward:

    dispatch: sort the T*K (token, slot) assignments by expert (= by owning rank), exchange per-expert
              counts, all-to-all the token rows;
    compute:  the module's own forward on the received rows (each routed to one local expert, weight 1);
    combine:  all-to-all the results back, scale by the routing weights, un-permute, sum the K slots.

The routing weights are applied on the sending rank, so router grads never cross ranks. Model code
stays single-device: the wrapped module keeps its signature ``(x_TD, ids_TK, weights_TK) -> [T, D]``.

Grad placement: the token all-to-alls are differentiable (torch.distributed.nn), so backward runs
the reverse all-to-all and each rank's local expert weights get the full gradient from the tokens of
every rank in its ep group. Expert grads still need a reduction over the data-parallel axes outside
``ep`` (FSDP or an all-reduce); non-expert grads over all data-parallel ranks, as usual.

Legend: T tokens, K top-k, D hidden, E experts, El local experts, M = T*K, R received rows.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def apply_ep(experts: nn.Module, ep_group: dist.ProcessGroup, param_names: tuple[str, ...] = EXPERT_PARAMS) -> None:
    """Shard ``experts``' stacked weights over ``ep_group`` and route its forward through all-to-all.

    In place. Every rank of ``ep_group`` must call it (same module structure, same full weights) and
    then run every forward/backward of the module together (each forward does collectives, even
    with zero local tokens).
    """
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    num_experts = getattr(experts, param_names[0]).shape[0]
    if num_experts % ep:
        raise ValueError(f"--topology.ep={ep} must divide the number of experts ({num_experts})")
    local = num_experts // ep
    for name in param_names:
        full = getattr(experts, name)
        setattr(experts, name, nn.Parameter(full.detach()[rank * local : (rank + 1) * local].clone()))
    experts.num_experts = local
    experts.ep_group, experts.ep_rank, experts.num_global_experts = ep_group, rank, num_experts
    local_forward = experts.forward
    experts.forward = types.MethodType(
        lambda self, x_TD, ids_TK, weights_TK: ep_forward(
            local_forward, x_TD, ids_TK, weights_TK, ep_group, num_experts
        ),
        experts,
    )


def ep_forward(
    local_forward,
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    ep_group: dist.ProcessGroup,
    num_experts: int,
) -> torch.Tensor:
    """Dispatch -> local experts -> combine (see the module docstring). Collective over ``ep_group``;
    syncs with the host once for the all-to-all split sizes."""
    ep = dist.get_world_size(ep_group)
    local = num_experts // ep
    T, K = ids_TK.shape
    flat = ids_TK.flatten()
    perm_M = torch.sort(flat, stable=True).indices
    counts_E = torch.bincount(flat, minlength=num_experts)
    # per-expert counts: rank s receives counts_E[s*El:(s+1)*El] from every rank; ints, no grad
    recv_counts = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts, counts_E, group=ep_group)
    send_splits = counts_E.view(ep, local).sum(1).tolist()
    recv_splits = recv_counts.view(ep, local).sum(1).tolist()
    x_send = x_TD[perm_M // K]
    x_recv = dist_fn.all_to_all_single(
        x_send.new_empty(sum(recv_splits), x_TD.shape[1]), x_send, recv_splits, send_splits, group=ep_group
    )
    # received rows are ordered (source rank, local expert); each goes to one local expert, weight 1
    local_ids = torch.arange(local, device=x_TD.device).repeat(ep).repeat_interleave(recv_counts)
    ones = torch.ones(local_ids.numel(), 1, dtype=weights_TK.dtype, device=x_TD.device)
    y_recv = local_forward(x_recv, local_ids[:, None], ones)
    y_send = dist_fn.all_to_all_single(x_send.new_empty(x_send.shape), y_recv, send_splits, recv_splits, group=ep_group)
    y_send = y_send * weights_TK.flatten()[perm_M, None].to(y_send.dtype)
    y_MD = torch.zeros_like(y_send).index_copy(0, perm_M, y_send)
    return y_MD.view(T, K, -1).sum(1)
