"""FSDP2 and activation checkpointing, applied in one fixed order.

Order: (TP: not yet) -> EP (models with experts, distributed/ep.py) -> activation checkpointing
-> FSDP2 per transformer block -> FSDP2 on the root. The model's forward stays single-device code.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from prime_spmd.distributed.mesh import fsdp_axis


def apply_activation_checkpointing(blocks: list[nn.Module], parent_lists: list[nn.ModuleList]) -> None:
    """Wrap every transformer block so its activations are recomputed in the backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for layers in parent_lists:
        for i, block in enumerate(list(layers)):
            layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_fsdp(
    root: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """``fully_shard`` each block, then the root (embeddings, final norm, LM head, wrapper).

    Collective over the trainer role: every trainer rank calls it with the same model structure.
    Parameters become DTensors sharded on dim 0 over the FSDP axis; gradients are reduce-scattered
    in ``reduce_dtype`` and averaged over the FSDP axis.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    axis = fsdp_axis(mesh)
    for block in blocks:
        fully_shard(block, mesh=axis, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # The root keeps its parameters gathered after the forward: the backward needs them at once.
    fully_shard(root, mesh=axis, mp_policy=mp, reshard_after_forward=False)
    return root
