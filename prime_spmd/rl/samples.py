"""Controller-side turning of rollout groups into packed training micro-batches, and batch metrics."""

from __future__ import annotations

import statistics

from prime_spmd.config.rl_sections import RolloutConfig
from prime_spmd.data.sample import Sample
from prime_spmd.envs.rollout import Rollout
from prime_spmd.rl.advantages import compute_advantages
from prime_spmd.rl.types import Batch


def is_failed(r: Rollout) -> bool:
    """A rollout the environment marked failed (``metrics["failed"]``), or one with no completion tokens.

    Environments give failed rollouts reward 0 and (after a group error) empty completions: neither
    is the policy's score, so they must not enter group means or the loss.
    """
    return r.metrics.get("failed", 0.0) > 0 or not r.completion_ids


def rollouts_to_samples(
    batch: Batch, cfg: RolloutConfig, max_tokens: int, seq_len: int
) -> tuple[list[Sample], dict[str, float]]:
    """Advantages, filtering and token layout; returns training samples and batch metrics.

    Failed rollouts (``is_failed``) are dropped before advantages: a group's mean is over its
    surviving samples, a group with none left is dropped. Counted as ``failed_rollouts`` and
    ``failed_groups``; ``reward_mean`` / ``reward_std`` are over the non-failed rollouts (the environment's reward);
    with ``--rollout.truncated_reward`` or ``--rollout.length_penalty``, ``trained_reward_mean`` is the mean of the
    rewards the advantages came from (the samples that fit ``seq_len``).
    Over-long samples (prompt + completion > ``seq_len``: they cannot be trained) are dropped the same
    way, before advantages, so that every trained group's advantages sum to zero (mean baseline over
    what is trained). Counted as ``too_long_samples`` and ``too_long_groups`` (groups left empty).
    """
    for group in batch.groups:
        for r in group:
            r.validate()
    flat = [r for g in batch.groups for r in g]
    ok_groups = [[r for r in g if not is_failed(r)] for g in batch.groups]
    num_failed_groups = sum(1 for g in ok_groups if not g)
    ok_groups = [g for g in ok_groups if g]
    ok = [r for g in ok_groups for r in g]
    fitting = [[r for r in g if len(r.prompt_ids) + len(r.completion_ids) <= seq_len] for g in ok_groups]
    too_long = len(ok) - sum(len(g) for g in fitting)
    num_too_long_groups = sum(1 for g in fitting if not g)
    adv = compute_advantages([g for g in fitting if g], cfg, max_tokens)
    samples: list[Sample] = []
    for i, (r, a) in enumerate(adv.kept):
        ids = r.prompt_ids + r.completion_ids
        n_p = len(r.prompt_ids)
        samples.append(
            Sample(
                input_ids=ids,
                loss_mask=[0] * n_p + list(r.completion_mask),
                fields={
                    "advantages": [a] * len(ids),
                    "inference_logprobs": [0.0] * n_p + [float(x) for x in r.inference_logprobs],
                    "sample_ids": [float(i)] * len(ids),  # groups a sample's tokens in a packed row (gspo)
                },
                vision=r.vision,
            )
        )
    versions = [r.policy_version for r in flat]
    env_metrics: dict[str, list[float]] = {}
    for r in flat:
        for k, v in r.metrics.items():
            # The verifiers bridge already prefixes rubric metrics with env/; don't double it.
            env_metrics.setdefault(k if k.startswith("env/") else f"env/{k}", []).append(float(v))
    metrics = {
        "reward_mean": statistics.fmean(r.reward for r in ok) if ok else 0.0,
        "reward_std": statistics.pstdev([r.reward for r in ok]) if len(ok) > 1 else 0.0,
        "policy_version_min": float(min(versions, default=0)),
        "groups": float(len(batch.groups)),
        "dropped_groups": float(adv.num_dropped_groups),
        "failed_rollouts": float(len(flat) - len(ok)),
        "failed_groups": float(num_failed_groups),
        "too_long_samples": float(too_long),
        "too_long_groups": float(num_too_long_groups),
        "train_samples": float(len(samples)),
        "generated_tokens": float(sum(sum(r.completion_mask) for r in flat)),
        "completion_len_mean": statistics.fmean(len(r.completion_ids) for r in flat) if flat else 0.0,
        "gen_time_s": batch.gen_time_s,
    }
    if cfg.truncated_reward is not None or cfg.length_penalty:  # what the advantages were computed from
        metrics["trained_reward_mean"] = statistics.fmean(adv.rewards) if adv.rewards else 0.0
    metrics.update({k: statistics.fmean(v) for k, v in env_metrics.items()})
    return samples, metrics
