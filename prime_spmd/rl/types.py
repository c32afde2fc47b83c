"""A generated batch as the controller holds it: the rollout groups of batch j."""

from __future__ import annotations

from dataclasses import dataclass, field

from prime_spmd.envs.rollout import Rollout


@dataclass(kw_only=True)
class Batch:
    """One generated batch j as the controller holds it."""

    index: int
    groups: list[list[Rollout]]
    gen_time_s: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
