"""Per-role default groups and bridges with real gloo processes (2 and 4 ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from prime_spmd.config.sections import TopologyConfig
from tests.dist_utils import run_ranks


def _roles(rank: int, world: int, num_inference: int) -> dict:
    from prime_spmd.distributed.groups import init_distributed

    ctx = init_distributed(TopologyConfig(num_inference_ranks=num_inference, timeout_s=60))
    topo = ctx.topo
    # A collective on the default group stays inside the role: its size and sum are the role's.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out = {"role_world": dist.get_world_size(), "role_sum": float(t), "is_trainer": topo.is_trainer}
    if topo.is_trainer:
        from prime_spmd.distributed.mesh import build_trainer_mesh

        mesh = build_trainer_mesh(topo, ctx.device)
        out["mesh"] = (mesh.mesh_dim_names, mesh.size())
    # Weight bridge: trainer rank 0 broadcasts to every inference rank.
    if ctx.weight_bridge is not None:
        w = torch.arange(6, dtype=torch.float32) * 7 if rank == 0 else torch.zeros(6)
        ctx.weight_bridge.broadcast(w, src=0)
        out["weights"] = w.tolist()
    # Data bridge: every engine leader sends an object to the controller.
    if ctx.data_bridge is not None:
        if rank == 0:
            out["received"] = sorted(ctx.data_bridge.recv_object(src)["from"] for src in topo.engine_leaders)
        else:
            ctx.data_bridge.isend_object({"from": rank, "payload": list(range(rank))}, dst=0)
            ctx.data_bridge.wait_sends()
    ctx.close()
    return out


def test_two_and_four_rank_role_groups_and_bridges() -> None:
    two = run_ranks(_roles, 2, 1)
    assert [r["role_world"] for r in two] == [1, 1]
    assert [r["role_sum"] for r in two] == [0.0, 1.0]  # each role all-reduces alone
    assert two[0]["mesh"] == (("dp_shard",), 1)
    assert two[1]["weights"] == [0.0, 7.0, 14.0, 21.0, 28.0, 35.0]
    assert two[0]["received"] == [1]

    four = run_ranks(_roles, 4, 2)  # ranks 0,1 train; 2,3 infer (two engines of tp 1)
    assert [r["role_world"] for r in four] == [2, 2, 2, 2]
    assert [r["role_sum"] for r in four] == [1.0, 1.0, 5.0, 5.0]
    assert four[0]["mesh"] == (("dp_shard",), 2) and four[1]["mesh"] == (("dp_shard",), 2)
    assert "weights" not in four[1]  # trainer rank 1 is not on the weight bridge
    assert four[2]["weights"] == four[3]["weights"] == [0.0, 7.0, 14.0, 21.0, 28.0, 35.0]
    assert four[0]["received"] == [2, 3]
