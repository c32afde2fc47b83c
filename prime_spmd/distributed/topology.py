"""Which global rank does what: the pure layout computation (no process groups here).

World of W ranks. Disjoint mode: the first T = W - I ranks train (global rank 0 is also the
controller), the last I ranks run E = I / tp inference engines of ``tp`` consecutive ranks each.
Colocated mode: every rank trains and runs its own engine (tp = 1).

Across nodes (torchrun numbers ranks node by node, ``ranks_per_node`` = LOCAL_WORLD_SIZE each) this
puts trainer ranks on the first nodes and inference ranks on the last ones. A tp group never spans
two nodes (error); a node holding both roles is allowed (one node disjoint is the common case) and
noted once on rank 0 when the job has several nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prime_spmd.config.sections import TopologyConfig
from prime_spmd.log import global_rank, warn_once

CONTROLLER_RANK = 0


@dataclass(frozen=True, slots=True)
class Topology:
    world_size: int
    rank: int
    mode: Literal["colocated", "disjoint"]
    num_trainer_ranks: int
    num_inference_ranks: int
    engine_tp: int
    ep: int
    ranks_per_node: int | None = None
    """torchrun's LOCAL_WORLD_SIZE when every node has that many ranks; None when unknown or unequal."""

    @property
    def trainer_ranks(self) -> list[int]:
        return list(range(self.num_trainer_ranks))

    @property
    def inference_ranks(self) -> list[int]:
        if self.mode == "colocated":
            return list(range(self.world_size))
        return list(range(self.num_trainer_ranks, self.world_size))

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.num_trainer_ranks

    @property
    def is_inference(self) -> bool:
        return self.mode == "colocated" or self.rank >= self.num_trainer_ranks

    @property
    def is_controller(self) -> bool:
        return self.rank == CONTROLLER_RANK

    @property
    def trainer_rank(self) -> int:
        assert self.is_trainer
        return self.rank

    @property
    def inference_rank(self) -> int:
        """Rank within the inference role's default group."""
        assert self.is_inference
        return self.inference_ranks.index(self.rank)

    @property
    def num_engines(self) -> int:
        return len(self.inference_ranks) // self.engine_tp

    @property
    def engine_index(self) -> int:
        return self.inference_rank // self.engine_tp

    @property
    def is_engine_leader(self) -> bool:
        """The tp-rank 0 of its engine: the rank that sends rollouts to the controller."""
        return self.is_inference and self.inference_rank % self.engine_tp == 0

    @property
    def engine_leaders(self) -> list[int]:
        return self.inference_ranks[:: self.engine_tp]

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node if self.ranks_per_node else 1

    def node_roles(self) -> list[str]:
        """One line per node, e.g. ``node 1: trainer ranks 8..11, inference ranks 12..15``."""
        per = self.ranks_per_node or self.world_size
        lines = []
        for node in range(self.world_size // per):
            ranks = range(node * per, (node + 1) * per)
            parts = []
            for role, members in (("trainer", self.trainer_ranks), ("inference", self.inference_ranks)):
                mine = [r for r in ranks if r in members]
                if mine:
                    parts.append(f"{role} ranks {mine[0]}..{mine[-1]}" if len(mine) > 1 else f"{role} rank {mine[0]}")
            lines.append(f"node {node}: " + ", ".join(parts))
        return lines

    def mixed_nodes(self) -> list[int]:
        """Nodes that hold both trainer and inference ranks (disjoint mode only)."""
        if self.mode == "colocated" or not self.ranks_per_node:
            return []
        per, t = self.ranks_per_node, self.num_trainer_ranks
        return [t // per] if t % per else []


def plan_topology(cfg: TopologyConfig, world_size: int, rank: int, local_world_size: int | None = None) -> Topology:
    """Place roles on ranks; raise ``ValueError`` saying what would fit when the layout does not.

    ``local_world_size`` (ranks per node, torchrun's LOCAL_WORLD_SIZE) is used to keep every tp
    group inside one node.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad world: rank {rank} of world size {world_size}")
    mode = cfg.mode
    if mode == "auto":
        mode = "colocated" if world_size == 1 or cfg.num_inference_ranks == 0 else "disjoint"
    if mode == "colocated":
        if cfg.num_inference_ranks not in (0, world_size):
            raise ValueError(
                f"--topology.mode=colocated runs an engine on every rank; --topology.num_inference_ranks="
                f"{cfg.num_inference_ranks} must be 0 (or {world_size}); use --topology.mode=disjoint to split ranks"
            )
        if cfg.engine_tp != 1:
            raise ValueError(
                f"--topology.engine_tp={cfg.engine_tp}: colocated mode runs one engine per rank (tp 1); "
                "use --topology.mode=disjoint for tensor-parallel engines"
            )
        trainers, infer = world_size, world_size
    else:
        infer = cfg.num_inference_ranks
        trainers = world_size - infer
        if infer < 1 or trainers < 1:
            fit = f"1..{world_size - 1}" if world_size > 1 else "none (a world of 1 can only be colocated)"
            raise ValueError(
                f"--topology.num_inference_ranks={infer} does not fit a world of {world_size} ranks in disjoint "
                f"mode: it needs at least one trainer and one inference rank (would fit: {fit}, "
                f"a multiple of --topology.engine_tp={cfg.engine_tp})"
            )
        if infer % cfg.engine_tp:
            raise ValueError(
                f"--topology.num_inference_ranks={infer} is not a multiple of --topology.engine_tp={cfg.engine_tp}"
            )
        if local_world_size and local_world_size > 0:
            for start in range(trainers, world_size, cfg.engine_tp):
                end = start + cfg.engine_tp - 1
                if start // local_world_size != end // local_world_size:
                    raise ValueError(
                        f"inference engine on ranks {start}..{end} spans two nodes ({local_world_size} ranks per node): "
                        f"tp groups must stay inside a node; make --topology.num_inference_ranks a multiple of the "
                        f"ranks per node, or --topology.engine_tp divide {local_world_size}"
                    )
    if trainers % cfg.ep:
        fits = [d for d in range(1, trainers + 1) if trainers % d == 0]
        raise ValueError(f"--topology.ep={cfg.ep} does not divide the {trainers} trainer ranks; would fit: {fits}")
    topo = Topology(
        world_size=world_size,
        rank=rank,
        mode=mode,
        num_trainer_ranks=trainers,
        num_inference_ranks=infer,
        engine_tp=cfg.engine_tp,
        ep=cfg.ep,
        # Nodes of unequal size (agents with different --nproc-per-node): no per-node placement.
        ranks_per_node=local_world_size if local_world_size and world_size % local_world_size == 0 else None,
    )
    if topo.num_nodes > 1 and topo.mixed_nodes() and global_rank() == 0:
        per = topo.ranks_per_node
        warn_once(
            f"{topo.node_roles()[topo.mixed_nodes()[0]]}: this node holds both roles. It works; to give each role "
            f"whole nodes make --topology.num_inference_ranks a multiple of {per} (ranks per node)"
        )
    return topo
