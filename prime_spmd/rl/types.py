"""What crosses from the generating ranks to the controller: a generated batch, an eval share."""

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
    group_envs: list[str] = field(default_factory=list)
    """The environment label of each group (parallel to ``groups``)."""
    failures: list[tuple[str, int, str]] = field(default_factory=list)
    """Groups an environment failed to produce (rl/isolation.py): (label, example id, reason); not in ``groups``."""

    def __post_init__(self) -> None:
        if not self.group_envs:
            self.group_envs = [""] * len(self.groups)


@dataclass(kw_only=True)
class EvalShare:
    """Eval results of the weights ``version`` (one engine's share, or all of them once merged)."""

    version: int
    rewards: dict[str, list[list[float]]]
    """label -> one list of sample rewards per eval example."""
    completion_lens: dict[str, list[int]]
    truncated: dict[str, int]
    failed_groups: dict[str, int]
    gen_time_s: float = 0.0
