"""Per-environment metrics (``env/<label>/...``) of a trained batch and of an evaluation.

Train (every logged step): ``reward`` (mean over non-failed rollouts), ``pass_rate`` (share of them with
reward >= 1 - 1e-6), ``completion_len`` (sampled tokens), ``truncated`` (share that hit max_tokens),
``groups``, ``failed_groups`` (isolated failures plus groups whose every rollout failed),
``failed_rollouts``; rl/mixture.py adds the planning counts (``prompts``, ``weight``, ``skipped_prompts``,
``rechecked_prompts``, ``filtered_prompts``). Eval: ``eval_reward``, ``eval_pass@k`` for k = 1 ..
``--eval.samples_per_example`` (the unbiased estimator of the ``eval`` job), ``eval_completion_len``,
``eval_truncated``, ``eval_failed_groups``, plus ``eval_step`` (the weights version evaluated).
"""

from __future__ import annotations

import math
import statistics

from prime_spmd.rl.mixture import PASS
from prime_spmd.rl.samples import is_failed
from prime_spmd.rl.types import Batch, EvalShare


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one example (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def batch_env_metrics(batch: Batch, labels: list[str]) -> dict[str, float]:
    """The train metrics of each environment in ``labels`` from batch's groups and failures."""
    m: dict[str, float] = {}
    for label in labels:
        groups = [g for e, g in zip(batch.group_envs, batch.groups) if e == label]
        isolated = sum(1 for f in batch.failures if f[0] == label)
        flat = [r for g in groups for r in g]
        ok = [r for r in flat if not is_failed(r)]
        m[f"env/{label}/reward"] = statistics.fmean(r.reward for r in ok) if ok else 0.0
        m[f"env/{label}/pass_rate"] = statistics.fmean(float(r.reward >= PASS) for r in ok) if ok else 0.0
        m[f"env/{label}/completion_len"] = statistics.fmean(sum(r.completion_mask) for r in flat) if flat else 0.0
        m[f"env/{label}/truncated"] = (
            statistics.fmean(float(r.info.get("finish_reason") == "length") for r in flat) if flat else 0.0
        )
        m[f"env/{label}/groups"] = float(len(groups) + isolated)
        m[f"env/{label}/failed_groups"] = float(isolated + sum(1 for g in groups if all(is_failed(r) for r in g)))
        m[f"env/{label}/failed_rollouts"] = float(len(flat) - len(ok))
    return m


def eval_env_metrics(ev: EvalShare) -> dict[str, float]:
    """The eval metrics of each environment of ``ev``; ``eval_step`` is the weights version."""
    m: dict[str, float] = {"eval_step": float(ev.version), "eval_time_s": ev.gen_time_s}
    for label, groups in ev.rewards.items():
        flat = [x for g in groups for x in g]
        m[f"env/{label}/eval_reward"] = statistics.fmean(flat) if flat else 0.0
        n = max((len(g) for g in groups), default=0)
        for k in range(1, n + 1):
            passes = [pass_at_k(len(g), sum(x >= PASS for x in g), k) for g in groups]
            m[f"env/{label}/eval_pass@{k}"] = statistics.fmean(passes) if passes else 0.0
        lens = ev.completion_lens[label]
        m[f"env/{label}/eval_completion_len"] = statistics.fmean(lens) if lens else 0.0
        m[f"env/{label}/eval_truncated"] = ev.truncated[label] / len(flat) if flat else 0.0
        m[f"env/{label}/eval_failed_groups"] = float(ev.failed_groups[label])
    return m
