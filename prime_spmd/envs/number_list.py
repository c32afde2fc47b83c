"""Built-in number-list environment: reverse (or sort) a seeded list of integers; reward is the item LCS ratio.

Examples come from the generator the SFT data uses (``prime_spmd.data.number_list``), so a model fine-tuned
on ``--data.source number_list`` is trained and evaluated on the same distribution. The prompt is one user
message (``"reverse: 12 5 731 8"``); the answer length follows the list's, so generation lengths vary with
the prompt. The reward and why it gives partial credit: ``prime_spmd/data/number_list.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from prime_spmd.data.number_list import example_rng, item_lcs_ratio, number_list_example, parse_task_args
from prime_spmd.envs.builtin import BuiltinEnv

__all__ = ["NumberListEnv"]


class NumberListEnv(BuiltinEnv):
    """``args``: min_items, max_items, min_digits, max_digits, transform (reverse | sort | mixed), sep,
    num_train_examples (the fields of ``NumberListTask``)."""

    name = "number_list"

    def __init__(self, *, seed: int = 0, num_eval_examples: int = 64, args: dict[str, str] | None = None) -> None:
        self.task, rest = parse_task_args(args, "--env.args")
        num_train = rest.pop("num_train_examples", "100000")
        if rest:
            raise ValueError(f"--env.args: unknown keys {sorted(rest)} for number_list")
        self.num_train = int(num_train)
        self.seed, self.num_eval = seed, num_eval_examples

    def num_examples(self, split: Literal["train", "eval"]) -> int:
        return self.num_train if split == "train" else self.num_eval

    def example(self, split: Literal["train", "eval"], index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_examples(split):
            raise ValueError(f"number_list: {split} example {index} out of range [0, {self.num_examples(split)})")
        text, answer = number_list_example(example_rng(self.seed, split, index), self.task)
        return {"prompt": [{"role": "user", "content": text}], "answer": answer, "example_id": index}

    def score(self, answer: str, text: str) -> tuple[float, float]:
        return item_lcs_ratio(answer, text), float(text.strip() == answer)
