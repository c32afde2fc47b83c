"""Group-relative advantages and the filtering of groups that carry no gradient (run on the controller).

Advantage hook (--rollout.advantage), per group of n rewards r (after --rollout.truncated_reward and the length
penalty):
- ``mean``: A_i = r_i - mean(r);
- ``std`` (or --rollout.std_normalize): A_i = (r_i - mean(r)) / (std(r) + 1e-6), the sample std (n - 1);
- ``rloo``: A_i = r_i - mean_{j != i} r_j = n / (n - 1) (r_i - mean(r));
- ``pkg.module:function`` / ``path/to/file.py:function``: ``fn(rewards: list[float]) -> list[float]``, one
  finite advantage per reward, called once per group.
A group of one gets advantage 0 from the built-in choices.

Filter hook (--rollout.group_filter): ``fn(rewards: list[float], advantages: list[float]) -> bool`` (True: the
group trains); by default a group whose advantages are all zero is dropped when
--rollout.drop_zero_advantage_groups is set. Dropped groups are counted (``dropped_groups``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    ``sum(completion_mask)`` (an environment's tokens between turns do not count). A sample cut off at max_tokens
    (``info["finish_reason"] == "length"``) starts from ``--rollout.truncated_reward`` where that is set."""
    reward = r.reward
    if cfg.truncated_reward is not None and r.info.get("finish_reason") == "length":
        reward = cfg.truncated_reward
    if not cfg.length_penalty:
        return reward
    return reward - cfg.length_penalty * sum(r.completion_mask) / max(max_tokens, 1)


@functools.cache
def _user_function(path: str, flag: str) -> Callable[..., Any]:
    """Imported once per process (a path/to/file.py is executed once)."""
    from prime_spmd.rl.mixture import import_function  # here: mixture imports samples, which imports this module

    return import_function(path, flag)


def group_advantages(rs: list[float], cfg: RolloutConfig) -> list[float]:
    """The advantages of one group's rewards under --rollout.advantage (module docstring)."""
    n = len(rs)
    mean = sum(rs) / n
    kind = "std" if cfg.std_normalize else cfg.advantage
    if kind == "mean":
        return [x - mean for x in rs]
    if kind == "std":
        advs = [x - mean for x in rs]
        if n == 1:
            return advs
        std = math.sqrt(sum(a * a for a in advs) / (n - 1))
        return [a / (std + 1e-6) for a in advs]
    if kind == "rloo":
        return [0.0] * n if n == 1 else [(x - mean) * n / (n - 1) for x in rs]
    got = _user_function(kind, "rollout.advantage")(list(rs))
    advs = [float(a) for a in got] if isinstance(got, (list, tuple)) else []
    if len(advs) != n or not all(math.isfinite(a) for a in advs):
        raise ValueError(f"--rollout.advantage {kind} returned {got!r} for rewards {rs}: need {n} finite floats")
    return advs


def keep_group(rs: list[float], advs: list[float], cfg: RolloutConfig) -> bool:
    """Whether a group trains: --rollout.group_filter's answer, else the zero-advantage rule."""
    if cfg.group_filter:
        got = _user_function(cfg.group_filter, "rollout.group_filter")(list(rs), list(advs))
        if not isinstance(got, bool):
            raise ValueError(f"--rollout.group_filter {cfg.group_filter} returned {got!r}: need a bool")
        return got
    return not (cfg.drop_zero_advantage_groups and all(abs(a) < 1e-9 for a in advs))


def compute_advantages(groups: list[list[Rollout]], cfg: RolloutConfig, max_tokens: int) -> AdvantageResult:
    """Each group's advantages (``group_advantages``) and whether it trains (``keep_group``).

    Rewards are ``shaped_reward``'s; dropped groups are counted and their rewards still reported.
    """
    kept: list[tuple[Rollout, float]] = []
    rewards: list[float] = []
    dropped = 0
    for group in groups:
        rs = [shaped_reward(r, cfg, max_tokens) for r in group]
        rewards += rs
        advs = group_advantages(rs, cfg)
        if not keep_group(rs, advs, cfg):
            dropped += 1
            continue
        kept += list(zip(group, advs))
    return AdvantageResult(kept=kept, num_groups=len(groups), num_dropped_groups=dropped, rewards=rewards)
