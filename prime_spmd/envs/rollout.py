"""The record an environment returns for one sampled trajectory, which inference ranks send to the controller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prime_spmd.models.vision import VisionInputs


@dataclass(kw_only=True, slots=True)
class Rollout:
    """One sampled trajectory, as token ids the trainer trains on without re-tokenizing.

    ``completion_ids`` is everything after the prompt: engine-sampled tokens and, for multi-turn
    environments, the environment's tokens between turns. ``completion_mask`` is 1 exactly where the
    engine sampled the token (trained), 0 for environment tokens. ``inference_logprobs`` has one
    entry per completion token (0.0 where the mask is 0).
    """

    example_id: int
    """Index of the prompt in the environment's dataset (the group key)."""
    sample_idx: int
    """Index of this sample within its group (0 .. group_size-1)."""
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    inference_logprobs: list[float]
    reward: float
    policy_version: int = 0
    """Optimizer steps of the weights that generated this sample."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-sample environment metrics (e.g. reward_fn_errors), averaged into the step's metrics."""
    info: dict[str, Any] = field(default_factory=dict)
    vision: VisionInputs | None = None
    """The prompt's images (``VisionInputs.without_images``; a group's rollouts share one object)."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when the lengths disagree or values are malformed."""
        n = len(self.completion_ids)
        if len(self.completion_mask) != n or len(self.inference_logprobs) != n:
            raise ValueError(
                f"rollout (example {self.example_id}, sample {self.sample_idx}): completion_ids has {n} tokens but "
                f"completion_mask has {len(self.completion_mask)} and inference_logprobs {len(self.inference_logprobs)}"
            )
        if not self.prompt_ids:
            raise ValueError(f"rollout (example {self.example_id}, sample {self.sample_idx}): empty prompt_ids")
        if self.reward != self.reward:
            raise ValueError(f"rollout (example {self.example_id}, sample {self.sample_idx}): reward is NaN")
