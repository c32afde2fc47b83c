"""The trainer DeviceMesh: named axes over the trainer role's default group.

Axes: ``dp_shard`` (FSDP2) and, for MoE models with ep > 1, ``ep`` (experts sharded along it; the
dense parameters are FSDP-sharded over the flattened ``dp_shard_ep`` axis). ``cp`` is not built yet.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from prime_spmd.distributed.topology import Topology


def build_trainer_mesh(topo: Topology, device: torch.device) -> DeviceMesh:
    """Build the trainer mesh. Collective over the trainer role: every trainer rank calls it, no inference rank."""
    assert topo.is_trainer, "only trainer ranks build the trainer mesh"
    n = topo.num_trainer_ranks
    if topo.ep == 1:
        return init_device_mesh(device.type, (n,), mesh_dim_names=("dp_shard",))
    mesh = init_device_mesh(device.type, (n // topo.ep, topo.ep), mesh_dim_names=("dp_shard", "ep"))
    mesh["dp_shard", "ep"]._flatten("dp_shard_ep")
    return mesh


def fsdp_axis(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh dense parameters are FSDP-sharded over (all trainer ranks)."""
    names = mesh.mesh_dim_names or ()
    if "ep" in names:
        return mesh["dp_shard_ep"]
    assert names == ("dp_shard",), f"unexpected trainer mesh axes {names}"
    return mesh
