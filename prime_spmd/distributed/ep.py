"""Expert parallelism: experts sharded over the ``ep`` mesh axis, tokens moved by all-to-all.

``apply_ep(experts_module, ep_mesh)`` turns every stacked expert weight (dim 0 = expert) into a DTensor
on the 1-D ``ep`` mesh with placement Shard(0): rank r holds experts [r*El, (r+1)*El), El = E / ep.
``full_tensor()`` then returns the full stacked experts (weight sync, HF export), and FSDP2 composes
with it: ``fully_shard(experts, mesh=mesh["dp_shard"])`` shards the local experts further over the
axis orthogonal to ``ep`` (a 2-D DTensor over (dp_shard, ep)). The forward is wrapped:

    dispatch: sort the T*K (token, slot) assignments by expert (= by owning rank), exchange per-expert
              counts, all-to-all the token rows;
    compute:  the module's ``compute`` on the received rows with its local expert shards (each row to
              one local expert, weight 1);
    combine:  all-to-all the results back, scale by the routing weights, un-permute, sum the K slots.

The routing weights are applied on the sending rank, so router grads never cross ranks. Model code
stays single-device: the wrapped module keeps its signature ``(x_TD, ids_TK, weights_TK) -> [T, D]``.

Grad placement: the token all-to-alls are differentiable (torch.distributed.nn), so backward runs
the reverse all-to-all and each rank's local expert weights get the full gradient from the tokens of
every rank in its ep group. Expert grads still need a reduction over the data-parallel axes outside
``ep`` (FSDP over ``dp_shard`` or an all-reduce); non-expert grads over all data-parallel ranks.
With FSDP2 the expert grads are reduced over ``dp_shard`` only, so their divide factor must be the
dense one (see ``distributed/fsdp.py``).

Legend: T tokens, K top-k, D hidden, E experts, El local experts, M = T*K, R received rows.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def apply_ep(experts: nn.Module, ep_mesh: DeviceMesh, param_names: tuple[str, ...] = EXPERT_PARAMS) -> None:
    """Shard ``experts``' stacked weights over the ``ep`` axis and route its forward through all-to-all.

    In place; before FSDP. ``experts`` must have ``compute(x_TD, ids_TK, weights_TK, *weights)`` (the
    experts math with explicit weights, in ``param_names`` order). Every rank of the ``ep`` axis
    must call it (same module structure, same full weights: no communication, each rank keeps its
    slice) and then run every forward/backward of the module together (each forward does
    collectives, even with zero local tokens).
    """
    assert ep_mesh.ndim == 1 and ep_mesh.mesh_dim_names == ("ep",), f"apply_ep needs the 1-D ep axis, got {ep_mesh}"
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    num_experts = getattr(experts, param_names[0]).shape[0]
    if num_experts % ep:
        raise ValueError(f"--topology.ep={ep} must divide the number of experts ({num_experts})")
    local = num_experts // ep
    for name in param_names:
        full = getattr(experts, name)
        shard = full.detach()[rank * local : (rank + 1) * local].clone()
        dt = DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(dt, requires_grad=full.requires_grad))  # frozen by LoRA stays frozen
    experts.num_experts = local
    experts.ep_group = ep_mesh.get_group()

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        # to_local: this rank's experts (all-gathered over dp_shard by FSDP when composed). Grad
        # placement: the local grad becomes the DTensor grad with the same Shard(0) over ep.
        weights = [_local(getattr(self, n)) for n in param_names]
        return ep_forward(
            lambda x, ids, w: self.compute(x, ids, w, *weights), x_TD, ids_TK, weights_TK, self.ep_group, num_experts
        )

    experts.forward = types.MethodType(forward, experts)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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
