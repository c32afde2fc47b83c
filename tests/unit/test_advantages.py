"""Group-relative advantages (rl/advantages.py) against hand-computed values: mean subtraction,
--rollout.std_normalize (sample std, n - 1), --rollout.length_penalty, groups of one and
--rollout.drop_zero_advantage_groups."""

from __future__ import annotations

import pytest

from prime_spmd.config.rl_sections import RolloutConfig
from prime_spmd.envs.rollout import Rollout
from prime_spmd.rl.advantages import compute_advantages, shaped_reward


def _r(reward: float, mask: list[int] | None = None, example_id: int = 0, sample_idx: int = 0) -> Rollout:
    mask = [1, 1] if mask is None else mask
    return Rollout(
        example_id=example_id,
        sample_idx=sample_idx,
        prompt_ids=[1],
        completion_ids=[7] * len(mask),
        completion_mask=mask,
        inference_logprobs=[-0.5] * len(mask),
        reward=reward,
    )


def _group(rewards: list[float], example_id: int = 0) -> list[Rollout]:
    return [_r(x, example_id=example_id, sample_idx=i) for i, x in enumerate(rewards)]


def _advs(result) -> list[float]:
    return [a for _, a in result.kept]


def test_mean_subtracted_per_group() -> None:
    groups = [_group([1.0, 0.0, 0.0, 1.0]), _group([0.2, 0.8, 0.5], example_id=1)]
    res = compute_advantages(groups, RolloutConfig(std_normalize=False), max_tokens=8)
    assert _advs(res) == pytest.approx([0.5, -0.5, -0.5, 0.5, -0.3, 0.3, 0.0], abs=1e-12)
    assert [r.example_id for r, _ in res.kept] == [0] * 4 + [1] * 3
    assert res.rewards == [1.0, 0.0, 0.0, 1.0, 0.2, 0.8, 0.5]
    assert (res.num_groups, res.num_dropped_groups) == (2, 0)


def test_std_normalize_uses_the_sample_std() -> None:
    # rewards 1, 0, 0, 0: mean 0.25, deviations 0.75, -0.25 x3; sum of squares 0.75, / (n - 1) = 0.25 -> std 0.5
    # (the population std sqrt(0.75 / 4) = 0.433 would give 1.732, -0.577)
    res = compute_advantages([_group([1.0, 0.0, 0.0, 0.0])], RolloutConfig(std_normalize=True), max_tokens=8)
    assert _advs(res) == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)  # the 1e-6 guard is 2e-6 relative
    # rewards 2, 4 (mean 3, deviations -1, 1, std sqrt(2 / 1)): +-1/sqrt(2)
    res = compute_advantages([_group([2.0, 4.0])], RolloutConfig(std_normalize=True), max_tokens=8)
    assert _advs(res) == pytest.approx([-(0.5**0.5), 0.5**0.5], rel=1e-5)


@pytest.mark.parametrize("std_normalize", [False, True])
def test_zero_advantage_groups_are_dropped_or_kept_as_zeros(std_normalize: bool) -> None:
    # a group of one (its advantage is 0 by definition; std_normalize must not divide by n - 1 = 0),
    # a group with equal rewards (std 0: no division by ~0 blowing up), and one mixed group
    groups = [_group([0.7]), _group([1.0, 1.0, 1.0], example_id=1), _group([0.0, 1.0], example_id=2)]
    mixed = [-0.5, 0.5] if not std_normalize else [-(0.5**0.5), 0.5**0.5]
    res = compute_advantages(groups, RolloutConfig(std_normalize=std_normalize), max_tokens=8)
    assert (res.num_groups, res.num_dropped_groups) == (3, 2)
    assert [r.example_id for r, _ in res.kept] == [2, 2]
    assert _advs(res) == pytest.approx(mixed, rel=1e-5)
    assert res.rewards == [0.7, 1.0, 1.0, 1.0, 0.0, 1.0]  # dropped groups' rewards are still reported

    cfg = RolloutConfig(std_normalize=std_normalize, drop_zero_advantage_groups=False)
    res = compute_advantages(groups, cfg, max_tokens=8)
    assert (res.num_groups, res.num_dropped_groups) == (3, 0)
    assert [r.example_id for r, _ in res.kept] == [0, 1, 1, 1, 2, 2]
    assert _advs(res) == pytest.approx([0.0, 0.0, 0.0, 0.0, *mixed], rel=1e-5, abs=1e-12)


def test_length_penalty_counts_sampled_tokens_over_max_tokens() -> None:
    # 6 completion tokens of which 4 were sampled (mask 1); the environment's 2 do not count
    r = _r(1.0, mask=[1, 1, 0, 0, 1, 1])
    assert shaped_reward(r, RolloutConfig(length_penalty=0.5), max_tokens=8) == pytest.approx(1.0 - 0.5 * 4 / 8)
    assert shaped_reward(r, RolloutConfig(length_penalty=0.0), max_tokens=8) == 1.0
    assert shaped_reward(r, RolloutConfig(length_penalty=0.5), max_tokens=0) == pytest.approx(1.0 - 0.5 * 4)


def test_length_penalty_in_advantages() -> None:
    # equal rewards, 2 and 6 sampled tokens, penalty 0.4, max_tokens 8: shaped 0.9 and 0.7, so the
    # group is not dropped and the shorter completion gets the positive advantage
    group = [_r(1.0, mask=[1, 1], sample_idx=0), _r(1.0, mask=[1] * 6, sample_idx=1)]
    res = compute_advantages([group], RolloutConfig(length_penalty=0.4), max_tokens=8)
    assert res.rewards == pytest.approx([0.9, 0.7])
    assert res.num_dropped_groups == 0
    assert _advs(res) == pytest.approx([0.1, -0.1])
    res = compute_advantages([group], RolloutConfig(length_penalty=0.4, std_normalize=True), max_tokens=8)
    # deviations +-0.1, sample std sqrt(0.02 / 1) = 0.1414: +-1/sqrt(2)
    assert _advs(res) == pytest.approx([0.5**0.5, -(0.5**0.5)], rel=1e-5)


def test_truncated_reward_replaces_the_reward_of_samples_cut_at_max_tokens() -> None:
    cut, done = _r(0.8, mask=[1] * 4), _r(0.6, mask=[1] * 4, sample_idx=1)
    cut.info["finish_reason"], done.info["finish_reason"] = "length", "stop"
    assert shaped_reward(cut, RolloutConfig(), max_tokens=4) == 0.8  # None: the environment's
    assert shaped_reward(cut, RolloutConfig(truncated_reward=0.0), max_tokens=4) == 0.0
    assert shaped_reward(done, RolloutConfig(truncated_reward=0.0), max_tokens=4) == 0.6
    # before the length penalty, and in the group's advantages: the cut sample, higher by the environment, loses
    cfg = RolloutConfig(truncated_reward=-0.5, length_penalty=0.5)
    assert shaped_reward(cut, cfg, max_tokens=8) == pytest.approx(-0.5 - 0.25)
    res = compute_advantages([[cut, done]], RolloutConfig(truncated_reward=0.0), max_tokens=4)
    assert res.rewards == [0.0, 0.6] and _advs(res) == pytest.approx([-0.3, 0.3])
    with pytest.raises(ValueError, match="rollout.truncated_reward"):
        RolloutConfig(truncated_reward=float("nan"))


# --- --rollout.advantage and --rollout.group_filter hooks -----------------------------------------------


def test_advantage_choices_by_hand() -> None:
    groups = [_group([1.0, 0.0, 0.0, 0.0]), _group([0.7], example_id=1)]
    # rloo: 1 - mean(0, 0, 0) = 1, 0 - mean(1, 0, 0) = -1/3 (= 4/3 of the mean-baseline advantages); one: 0
    res = compute_advantages(groups, RolloutConfig(advantage="rloo", drop_zero_advantage_groups=False), max_tokens=8)
    assert _advs(res) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0], abs=1e-12)
    # std is std_normalize under another name (sample std 0.5: 1.5, -0.5 x3)
    res = compute_advantages(groups[:1], RolloutConfig(advantage="std"), max_tokens=8)
    assert _advs(res) == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)
    with pytest.raises(ValueError, match="rollout.std_normalize"):
        RolloutConfig(advantage="rloo", std_normalize=True)
    with pytest.raises(ValueError, match="rollout.advantage"):
        RolloutConfig(advantage="median")


def _write_hooks(tmp_path) -> str:
    path = tmp_path / "hooks.py"
    path.write_text(
        "def rank(rewards):\n"
        "    order = sorted(range(len(rewards)), key=lambda i: rewards[i])\n"
        "    return [float(order.index(i)) - (len(rewards) - 1) / 2 for i in range(len(rewards))]\n"
        "def bad(rewards):\n"
        "    return [0.0]\n"
        "def not_bool(rewards, advantages):\n"
        "    return 1\n"
        "def any_solved(rewards, advantages):\n"
        "    return max(rewards) >= 1.0\n"
    )
    return str(path)


def test_user_advantage_function_per_group(tmp_path) -> None:
    hooks = _write_hooks(tmp_path)
    groups = [_group([0.2, 0.9, 0.5]), _group([3.0, -1.0], example_id=1)]
    res = compute_advantages(groups, RolloutConfig(advantage=f"{hooks}:rank"), max_tokens=8)
    assert _advs(res) == [-1.0, 1.0, 0.0, 0.5, -0.5]  # centred ranks, per group
    with pytest.raises(ValueError, match=r"--rollout.advantage .*:bad returned \[0.0\]"):
        compute_advantages(groups, RolloutConfig(advantage=f"{hooks}:bad"), max_tokens=8)
    with pytest.raises(ValueError, match="rollout.advantage"):
        compute_advantages(groups, RolloutConfig(advantage=f"{hooks}:missing"), max_tokens=8)


def test_user_group_filter_replaces_the_zero_advantage_rule(tmp_path) -> None:
    hooks = _write_hooks(tmp_path)
    # all-equal solved group (advantages 0): kept by the filter; a mixed unsolved group: dropped
    groups = [_group([1.0, 1.0]), _group([0.2, 0.6], example_id=1), _group([0.0, 1.0], example_id=2)]
    res = compute_advantages(groups, RolloutConfig(group_filter=f"{hooks}:any_solved"), max_tokens=8)
    assert (res.num_groups, res.num_dropped_groups) == (3, 1)
    assert [r.example_id for r, _ in res.kept] == [0, 0, 2, 2]
    assert _advs(res) == pytest.approx([0.0, 0.0, -0.5, 0.5])
    with pytest.raises(ValueError, match="rollout.group_filter .*:not_bool returned 1"):
        compute_advantages(groups, RolloutConfig(group_filter=f"{hooks}:not_bool"), max_tokens=8)
