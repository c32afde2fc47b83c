"""Built-in reverse-text environment: reverse a seeded random string; reward is the LCS ratio.

Examples come from the same generator the SFT data uses (``prime_spmd.data.reverse_text``), so a
model fine-tuned on reverse-text SFT data is evaluated on the same distribution. The prompt is one
user message holding the string (no system prompt: the tiny char models have short contexts).
"""

from __future__ import annotations

from typing import Any, Literal

from prime_spmd.data.reverse_text import example_rng, lcs_ratio, reverse_text_example
from prime_spmd.envs.base import END_MARKERS, completion_text
from prime_spmd.envs.builtin import BuiltinEnv, request_seed

__all__ = ["ReverseTextEnv", "reverse_text_example", "lcs_ratio", "request_seed", "completion_text", "END_MARKERS"]


class ReverseTextEnv(BuiltinEnv):
    """``args``: min_chars, max_chars (string length, inclusive), alphabet, num_train_examples."""

    name = "reverse_text"

    def __init__(self, *, seed: int = 0, num_eval_examples: int = 64, args: dict[str, str] | None = None) -> None:
        args = dict(args or {})
        known = {"min_chars", "max_chars", "alphabet", "num_train_examples"}
        unknown = set(args) - known
        if unknown:
            raise ValueError(f"--env.args: unknown keys {sorted(unknown)} for reverse_text; allowed: {sorted(known)}")
        self.min_chars = int(args.get("min_chars", 5))
        self.max_chars = int(args.get("max_chars", 10))
        self.alphabet = args.get("alphabet", "abcdefghijklmnopqrstuvwxyz")
        self.num_train = int(args.get("num_train_examples", 100_000))
        if not 1 <= self.min_chars <= self.max_chars:
            raise ValueError(f"--env.args: need 1 <= min_chars <= max_chars, got {self.min_chars}, {self.max_chars}")
        self.seed, self.num_eval = seed, num_eval_examples

    def num_examples(self, split: Literal["train", "eval"]) -> int:
        return self.num_train if split == "train" else self.num_eval

    def example(self, split: Literal["train", "eval"], index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_examples(split):
            raise ValueError(f"reverse_text: {split} example {index} out of range [0, {self.num_examples(split)})")
        text, answer = reverse_text_example(
            example_rng(self.seed, split, index), self.min_chars, self.max_chars, self.alphabet
        )
        return {"prompt": [{"role": "user", "content": text}], "answer": answer, "example_id": index}

    def score(self, answer: str, text: str) -> tuple[float, float]:
        return lcs_ratio(answer, text), float(text == answer)
