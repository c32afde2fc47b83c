"""Running one environment's groups so that its failures stay its own (issue 41.5).

An environment that raises, or returns a malformed result (another number of groups or rollouts than
asked, a reward that is not a finite number, token lists of different lengths), loses only the groups
concerned: they are left out of the batch and reported as failures (label, example id, reason), which the
controller counts per environment (``env/<label>/failed_groups``) against ``--rollout.max_env_failure_rate``.
Hangs are cut by the bridges' per-group timeout (``--env.group_timeout_s``), which fails the group the same
way (its rollouts marked failed).
"""

from __future__ import annotations

import math
import numbers
from typing import Literal

from prime_spmd.envs.base import Environment
from prime_spmd.envs.rollout import Rollout
from prime_spmd.inference.engine import EngineFailure, InferenceEngine, SamplingParams
from prime_spmd.log import logger


def bad_group(group: object, group_size: int) -> str | None:
    """Why ``group`` cannot be trained (None when it can): its size, a reward, or a rollout's token lists."""
    if not isinstance(group, list) or len(group) != group_size:
        size = len(group) if isinstance(group, list) else type(group).__name__
        return f"returned {size} rollouts for group_size {group_size}"
    for r in group:
        if not isinstance(r, Rollout):
            return f"returned a {type(r).__name__}, not a Rollout"
        if isinstance(r.reward, bool) or not isinstance(r.reward, numbers.Real):
            return f"reward {r.reward!r} is not a number"
        if not math.isfinite(r.reward):
            return f"reward {r.reward!r} is not finite"
        try:
            r.validate()
        except ValueError as e:
            return str(e)
    return None


def run_isolated(
    label: str,
    env: Environment,
    engine: InferenceEngine,
    split: Literal["train", "eval"],
    example_ids: list[int],
    group_size: int,
    sampling: SamplingParams,
    seed: int,
) -> tuple[list[list[Rollout]], list[tuple[str, int, str]]]:
    """``env.run_groups`` with its failures isolated. Returns (good groups, failures as (label, example id, reason))."""
    try:
        groups = env.run_groups(engine, split, example_ids, group_size, sampling, seed)
    # An environment's own error must not end the run (issue 41.5): its groups are dropped and counted,
    # and the failure rate decides when to stop. The engine's own failure is not the environment's.
    except Exception as e:  # noqa: BLE001
        if isinstance(e, EngineFailure):
            raise
        reason = f"raised {type(e).__name__}: {e}"
        logger.warning(f"environment {label!r} {reason} ({len(example_ids)} {split} groups dropped)")
        return [], [(label, eid, reason) for eid in example_ids]
    if not isinstance(groups, list) or len(groups) != len(example_ids):
        n = len(groups) if isinstance(groups, list) else type(groups).__name__
        reason = f"returned {n} groups for {len(example_ids)} prompts"
        logger.warning(f"environment {label!r} {reason} ({split} groups dropped)")
        return [], [(label, eid, reason) for eid in example_ids]
    good, failures = [], []
    for eid, group in zip(example_ids, groups):
        reason = bad_group(group, group_size)
        if reason is None:
            good.append(group)
        else:
            logger.warning(f"environment {label!r}, {split} example {eid}: {reason} (group dropped)")
            failures.append((label, eid, reason))
    return good, failures
