"""The environment interface the RL loop and `eval` use.

An environment owns a dataset of examples and the rollout logic + rubric. Inference ranks call
``run_groups`` with their in-process engine; the result is token-exact (``Rollout``), so the trainer
never re-tokenizes. The built-in environments and the verifiers bridge implement this.
"""

from __future__ import annotations

import abc
import weakref
from typing import Any, Literal

from prime_spmd.envs.rollout import Rollout
from prime_spmd.inference.engine import InferenceEngine, SamplingParams

END_MARKERS = ("<|im_end|>", "<|endoftext|>")
"""Special tokens that end a turn wherever the tokenizer has them (besides its eos)."""


_END_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def end_token_ids(tokenizer: Any) -> set[int]:
    """The ids that end a turn: the tokenizer's eos and whichever ``END_MARKERS`` it has. Computed once per
    tokenizer object: ``get_vocab`` builds the whole vocab dict on every call (0.14 s for the real Qwen3
    tokenizer's 151k entries, 2-core CPU; per rollout that was ~9 s of a 64-rollout RL step)."""
    ends = _END_IDS.get(tokenizer)
    if ends is None:
        vocab = tokenizer.get_vocab()
        ends = frozenset({vocab[m] for m in END_MARKERS if m in vocab})
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ends = ends | {tokenizer.eos_token_id}
        _END_IDS[tokenizer] = ends
    return set(ends)


def completion_text(tokenizer: Any, token_ids: list[int], ends: set[int] | None = None) -> str:
    """Decoded completion cut at the first eos / end-of-turn token (special tokens dropped).

    The text environments score: the built-ins and the verifiers bridge (message content) alike.
    ``ends``: ``end_token_ids(tokenizer)`` (cached per tokenizer; a caller may pass it to skip the lookup).
    """
    if ends is None:
        ends = end_token_ids(tokenizer)
    cut = next((i for i, t in enumerate(token_ids) if t in ends), len(token_ids))
    return tokenizer.decode(token_ids[:cut], skip_special_tokens=True)


class Environment(abc.ABC):
    name: str

    @abc.abstractmethod
    def num_examples(self, split: Literal["train", "eval"]) -> int:
        """Examples in the split (the train split may be large and generated on demand)."""

    @abc.abstractmethod
    def example(self, split: Literal["train", "eval"], index: int) -> dict[str, Any]:
        """Example ``index`` of ``split``: at least ``prompt`` (chat messages) and ``answer``. Deterministic."""

    @abc.abstractmethod
    def run_groups(
        self,
        engine: InferenceEngine,
        split: Literal["train", "eval"],
        example_ids: list[int],
        group_size: int,
        sampling: SamplingParams,
        seed: int,
    ) -> list[list[Rollout]]:
        """Sample ``group_size`` rollouts per example and score them; one list per example, in order.

        ``seed`` seeds the per-request sampling (request seeds are derived from it, the example id and
        the sample index), so results do not depend on batch composition. ``policy_version`` is left 0
        for the caller to set.
        """
