"""Controller-side batch -> training samples: over-long samples leave the group before advantages."""

from __future__ import annotations

import pytest

from prime_spmd.config.rl_sections import RolloutConfig
from prime_spmd.envs.rollout import Rollout
from prime_spmd.rl.samples import rollouts_to_samples
from prime_spmd.rl.types import Batch


def _rollout(eid: int, k: int, reward: float, num_tokens: int) -> Rollout:
    return Rollout(
        example_id=eid,
        sample_idx=k,
        prompt_ids=[1, 2],
        completion_ids=[5] * num_tokens,
        completion_mask=[1] * num_tokens,
        inference_logprobs=[-1.0] * num_tokens,
        reward=reward,
    )


def test_overlong_samples_are_dropped_before_group_advantages() -> None:
    """seq_len 8: a 2-token prompt fits completions of <= 6 tokens. The over-long sample (reward 1)
    must not enter its group's mean, so the trained advantages of every group sum to zero."""
    groups = [
        [_rollout(0, 0, 1.0, 10), _rollout(0, 1, 0.5, 3), _rollout(0, 2, 0.0, 3)],  # sample 0 too long
        [_rollout(1, 0, 1.0, 3), _rollout(1, 1, 0.0, 3)],
        [_rollout(2, 0, 1.0, 9), _rollout(2, 1, 0.0, 7)],  # nothing fits: the group is gone
    ]
    samples, m = rollouts_to_samples(Batch(index=0, groups=groups), RolloutConfig(group_size=3), 16, 8)
    advs = [s.fields["advantages"][0] for s in samples]
    # group 0 keeps rewards (0.5, 0): mean 0.25 -> +-0.25 (with the long sample in the mean: -0.0, -0.5)
    assert advs == pytest.approx([0.25, -0.25, 0.5, -0.5])
    assert sum(advs[:2]) == pytest.approx(0.0) and sum(advs[2:]) == pytest.approx(0.0)
    assert m["too_long_samples"] == 3.0 and m["too_long_groups"] == 1.0 and m["train_samples"] == 4.0
    # the rewards the policy got are reported over every scored rollout, long ones included
    assert m["reward_mean"] == pytest.approx(3.5 / 7)


def test_trained_reward_is_reported_beside_the_environments() -> None:
    """--rollout.truncated_reward: reward_mean stays the environment's; trained_reward_mean is what the advantages
    came from (only logged where a shaping flag is set)."""
    cut = _rollout(0, 0, 0.9, 3)
    cut.info["finish_reason"] = "length"
    groups = [[cut, _rollout(0, 1, 0.5, 3)]]
    _, m = rollouts_to_samples(Batch(index=0, groups=groups), RolloutConfig(group_size=2, truncated_reward=0.0), 3, 8)
    assert m["reward_mean"] == pytest.approx(0.7) and m["trained_reward_mean"] == pytest.approx(0.25)
    _, m = rollouts_to_samples(Batch(index=0, groups=groups), RolloutConfig(group_size=2), 3, 8)
    assert "trained_reward_mean" not in m
