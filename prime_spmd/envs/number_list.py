"""Built-in number-list environment: reverse (or sort) a seeded list of integers or words; reward: the item LCS ratio.

Examples come from the generator the SFT data uses (``prime_spmd.data.number_list``), so a model fine-tuned
on ``--data.source number_list`` is trained and evaluated on the same distribution. The prompt is one user
message (``"reverse: 12 5 731 8"``); the answer length follows the list's, so generation lengths vary with
the prompt. The reward and why it gives partial credit: ``prime_spmd/data/number_list.py``.
"""

from __future__ import annotations

from typing import Literal

from prime_spmd.data.number_list import example_rng, item_lcs_ratio, number_list_example, parse_task_args
from prime_spmd.envs.builtin import GeneratedTaskEnv

__all__ = ["NumberListEnv"]


class NumberListEnv(GeneratedTaskEnv):
    """``args``: min_items, max_items, min_digits, max_digits, transform (reverse | sort | mixed), sep, items
    (numbers | words), num_train_examples (the fields of ``NumberListTask``)."""

    name = "number_list"

    parse_args = staticmethod(parse_task_args)

    def draw(self, split: Literal["train", "eval"], index: int) -> tuple[list[dict[str, str]], str]:
        text, answer = number_list_example(example_rng(self.seed, split, index), self.task)
        return [{"role": "user", "content": text}], answer

    def score(self, answer: str, text: str) -> tuple[float, float]:
        return item_lcs_ratio(answer, text, self.task.items), float(text.strip() == answer)
