"""Group-relative advantages and the filtering of groups that carry no gradient."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prime_spmd.config.rl_sections import RolloutConfig
from prime_spmd.envs.rollout import Rollout


@dataclass(kw_only=True, slots=True)
class AdvantageResult:
    kept: list[tuple[Rollout, float]]
    """(rollout, advantage) of the groups kept for training."""
    num_groups: int
    num_dropped_groups: int
    rewards: list[float]
    """Every sample's reward (after the length penalty), dropped groups included."""


def shaped_reward(r: Rollout, cfg: RolloutConfig, max_tokens: int) -> float:
    """``reward - length_penalty * sampled tokens / max(max_tokens, 1)``; sampled tokens are
    ``sum(completion_mask)`` (an environment's tokens between turns do not count)."""
    if not cfg.length_penalty:
        return r.reward
    return r.reward - cfg.length_penalty * sum(r.completion_mask) / max(max_tokens, 1)


def compute_advantages(groups: list[list[Rollout]], cfg: RolloutConfig, max_tokens: int) -> AdvantageResult:
    """Advantage = reward - group mean (divided by the group's std with --rollout.std_normalize).

    Rewards are ``shaped_reward``'s. The std is the sample std (n - 1 in the denominator) plus 1e-6;
    a group of one is not divided (its advantage is 0).

    Groups whose advantages are all zero (every sample got the same reward) are dropped and counted
    when --rollout.drop_zero_advantage_groups is set.
    """
    kept: list[tuple[Rollout, float]] = []
    rewards: list[float] = []
    dropped = 0
    for group in groups:
        rs = [shaped_reward(r, cfg, max_tokens) for r in group]
        rewards += rs
        mean = sum(rs) / len(rs)
        advs = [x - mean for x in rs]
        if cfg.std_normalize and len(rs) > 1:
            std = math.sqrt(sum(a * a for a in advs) / (len(rs) - 1))
            advs = [a / (std + 1e-6) for a in advs]
        if cfg.drop_zero_advantage_groups and all(abs(a) < 1e-9 for a in advs):
            dropped += 1
            continue
        kept += list(zip(group, advs))
    return AdvantageResult(kept=kept, num_groups=len(groups), num_dropped_groups=dropped, rewards=rewards)
