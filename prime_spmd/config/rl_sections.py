"""Config sections used only by the `rl` subcommand."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from prime_spmd.config.sections import _check


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    prompts_per_step: int = 16
    """Prompts per training batch; each is sampled --rollout.group_size times."""
    group_size: int = 8
    """Completions per prompt (the group of group-relative advantages)."""
    max_async: int | None = None
    """Off-policy bound k: batch j is generated with weights w_max(0, j-k); 0 is synchronous on-policy. Unset: 0 when the engine and the trainer share the ranks (colocated: one process generates and trains in turn, so a lag overlaps nothing and only makes the batch older; H100, 0.6B: 695 samples/s at 0 against 598 at 1), 1 in disjoint mode (the engines generate batch j+1 while the trainer steps on batch j)."""
    std_normalize: bool = False
    """Divide advantages by the group's reward std (GRPO) instead of only subtracting the mean (the same as --rollout.advantage std)."""
    advantage: str = "mean"
    """A group's advantages (docs/algorithms.md): mean (reward - group mean), std (also / group std), rloo (reward - mean of the others), or a function rewards -> advantages (pkg.module:function or path/to/file.py:function)."""
    group_filter: str = ""
    """A function (rewards, advantages) -> bool deciding whether a group trains (pkg.module:function or path/to/file.py:function); "": --rollout.drop_zero_advantage_groups decides."""
    length_penalty: float = 0.0
    """Subtract this times (completion tokens / max_tokens) from each reward."""
    truncated_reward: float | None = None
    """The reward a sample cut off at max_tokens trains on (its last turn's finish_reason "length"), in place of the environment's (before the length penalty); None: the environment's. 0 stops a partial-credit reward from paying for never stopping. Metrics and evals still report the environment's reward."""
    drop_zero_advantage_groups: bool = True
    """Drop groups whose advantages are all zero (they carry no gradient) and count them."""
    filter_difficulty: bool = False
    """Skip train prompts whose last group was all solved (every reward >= 1) or earned nothing (every reward <= 0); re-checked after --rollout.filter_recheck_steps."""
    filter_recheck_steps: int = 8
    """With --rollout.filter_difficulty: a skipped prompt comes back (to be re-checked) this many batches later."""
    curriculum: str = ""
    """A function step -> {env label: weight} (pkg.module:function or path/to/file.py:function) replacing the [[envs]] weights each batch; "": fixed weights."""
    max_env_failure_rate: float = 0.5
    """Stop the run when an environment's failed groups (raised, timed out, bad rewards) exceed this fraction of its groups so far (after 4 groups); 1: never."""

    def __post_init__(self) -> None:
        _check(
            self.filter_recheck_steps >= 1, "rollout.filter_recheck_steps", self.filter_recheck_steps, "must be >= 1"
        )
        _check(
            0 <= self.max_env_failure_rate <= 1,
            "rollout.max_env_failure_rate",
            self.max_env_failure_rate,
            "must be in [0, 1]",
        )
        _check(self.prompts_per_step >= 1, "rollout.prompts_per_step", self.prompts_per_step, "must be >= 1")
        _check(self.group_size >= 1, "rollout.group_size", self.group_size, "must be >= 1")
        _check(self.max_async is None or self.max_async >= 0, "rollout.max_async", self.max_async, "must be >= 0")
        _check(self.length_penalty >= 0, "rollout.length_penalty", self.length_penalty, "must be >= 0")
        _check(
            self.truncated_reward is None or math.isfinite(self.truncated_reward),
            "rollout.truncated_reward",
            self.truncated_reward,
            "must be a finite number",
        )
        _check(
            self.advantage in ("mean", "std", "rloo") or ":" in self.advantage,
            "rollout.advantage",
            self.advantage,
            "must be mean, std, rloo or pkg.module:function / path/to/file.py:function",
        )
        _check(
            not self.std_normalize or self.advantage in ("mean", "std"),
            "rollout.std_normalize",
            self.std_normalize,
            f"conflicts with --rollout.advantage {self.advantage} (std_normalize is --rollout.advantage std)",
        )


@dataclass(kw_only=True, slots=True)
class LossConfig:
    type: Literal["dppo", "ipo", "ppo", "cispo", "gspo"] = "dppo"
    """Policy-gradient loss (docs/algorithms.md): dppo (PRIME-RL's DPPO), ipo (PRIME-RL's IPO), ppo (clipped ratio), cispo (clipped IS weight, MiniMax-M1), gspo (sequence-level ratio)."""
    prob_delta_high: float = 0.2
    """dppo: mask a token with A > 0 when p_train - p_inf exceeds this."""
    prob_delta_low: float = 0.2
    """dppo: mask a token with A < 0 when p_inf - p_train exceeds this."""
    ipo_eps: float = 0.3
    """ipo: mask a token when abs(p_train - p_inf) exceeds this (either sign of A)."""
    kl_coef: float = 1e-3
    """Weight of the (log r)^2 term that keeps the trainer near the inference policy."""
    clip_low: float = 0.2
    """ppo: lower clip of the ratio is 1 - clip_low."""
    clip_high: float = 0.28
    """ppo: upper clip of the ratio is 1 + clip_high."""
    cispo_clip_low: float = 1.0
    """cispo: the importance weight is clipped below at 1 - cispo_clip_low (1: no lower clip, as in MiniMax-M1)."""
    cispo_clip_high: float = 0.28
    """cispo: the importance weight is clipped above at 1 + cispo_clip_high."""
    gspo_clip_low: float = 3e-4
    """gspo: lower clip of the sequence ratio is 1 - gspo_clip_low (the GSPO paper's 3e-4)."""
    gspo_clip_high: float = 4e-4
    """gspo: upper clip of the sequence ratio is 1 + gspo_clip_high (the GSPO paper's 4e-4)."""
    token_mask: Literal["none", "icepop"] = "none"
    """icepop: also drop the policy-gradient term of tokens whose ratio p_train / p_inf is outside [mask_ratio_low, mask_ratio_high] (any --loss.type)."""
    mask_ratio_low: float = 0.5
    """With --loss.token_mask icepop: the lowest kept ratio p_train / p_inf (0.5 and 5 are INTELLECT-3's alpha, beta)."""
    mask_ratio_high: float = 5.0
    """With --loss.token_mask icepop: the highest kept ratio p_train / p_inf."""
    max_log_ratio: float = 10.0
    """Clamp log r to [-max_log_ratio, max_log_ratio] before exp so ratios cannot overflow."""

    def __post_init__(self) -> None:
        for name in ("prob_delta_high", "prob_delta_low", "ipo_eps"):
            v = getattr(self, name)
            _check(0 < v <= 1, f"loss.{name}", v, "must be in (0, 1]")
        _check(self.kl_coef >= 0, "loss.kl_coef", self.kl_coef, "must be >= 0")
        for name in ("clip_low", "gspo_clip_low"):
            _check(0 < getattr(self, name) < 1, f"loss.{name}", getattr(self, name), "must be in (0, 1)")
        _check(0 <= self.cispo_clip_low <= 1, "loss.cispo_clip_low", self.cispo_clip_low, "must be in [0, 1]")
        for name in ("clip_high", "cispo_clip_high", "gspo_clip_high"):
            _check(getattr(self, name) > 0, f"loss.{name}", getattr(self, name), "must be > 0")
        _check(
            0 <= self.mask_ratio_low < 1 < self.mask_ratio_high,
            "loss.mask_ratio_low/high",
            (self.mask_ratio_low, self.mask_ratio_high),
            "need 0 <= low < 1 < high",
        )
        _check(self.max_log_ratio > 0, "loss.max_log_ratio", self.max_log_ratio, "must be > 0")


@dataclass(kw_only=True, slots=True)
class RLEvalConfig:
    interval_steps: int = 0
    """Run every environment's eval split on the in-process engine with the current weights every N steps (0: never)."""
    final: bool = True
    """With --eval.interval_steps > 0: also evaluate the final weights (after the last step)."""
    samples_per_example: int = 2
    """Completions per eval example; pass@k is logged for k up to this."""

    def __post_init__(self) -> None:
        _check(self.interval_steps >= 0, "eval.interval_steps", self.interval_steps, "must be >= 0 (0: never)")
        _check(self.samples_per_example >= 1, "eval.samples_per_example", self.samples_per_example, "must be >= 1")
