"""reverse_text as a classic ``verifiers`` environment: the template for writing your own.

The same task, dataset and reward as the built-in ``reverse_text`` (prime_spmd/envs/reverse_text.py),
written as an Environments Hub package writes it (verifiers>=0.3.1,<0.4): a ``vf.SingleTurnEnv``
over a ``datasets.Dataset`` with ``prompt`` / ``answer`` columns and a ``vf.Rubric`` of reward
functions. Run it through the verifiers bridge:

    python -m prime_spmd rl --env.name prime_spmd.envs.vf_reverse_text:load_environment \\
        --env.args seed 0 max_chars 10 ...

Example ``i`` of each split is the built-in's example ``i`` for the same ``seed`` and args (both draw
from ``prime_spmd.data.reverse_text``), and ``lcs_reward`` scores the message content (the bridge
cuts it at the first end-of-turn token, as the built-in does), so the two give the same rewards for
the same completions (tests/unit/test_verifiers_bridge.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import verifiers as vf
from datasets import Dataset

from prime_spmd.data.reverse_text import example_rng, lcs_ratio, reverse_text_example


def build_dataset(seed: int, split: str, num_examples: int, min_chars: int, max_chars: int, alphabet: str) -> Dataset:
    """``num_examples`` rows of ``split``: ``prompt`` (one user message: the string) and ``answer`` (reversed).

    Hub envs often give a ``question`` column and let verifiers build ``prompt`` (adding
    ``system_prompt``); writing ``prompt`` directly skips that ``map`` (15 s for 100k rows here).
    """
    rows = []
    for i in range(num_examples):
        text, answer = reverse_text_example(example_rng(seed, split, i), min_chars, max_chars, alphabet)
        rows.append({"prompt": [{"role": "user", "content": text}], "answer": answer, "example_id": i})
    return Dataset.from_list(rows)


def dataset_builders(
    seed: int, num_train_examples: int, num_eval_examples: int, min_chars: int, max_chars: int, alphabet: str
) -> dict[str, Callable[[], Dataset]]:
    """A verifiers env's ``dataset`` and ``eval_dataset`` arguments: builders (callables) of the two splits.

    They run on first use, so loading the env for eval skips the 100k train rows. Raises ``ValueError``
    (naming ``--env.args``) unless 1 <= min_chars <= max_chars.
    """
    if not 1 <= min_chars <= max_chars:
        raise ValueError(f"--env.args: need 1 <= min_chars <= max_chars, got {min_chars}, {max_chars}")
    args = (min_chars, max_chars, alphabet)
    return {
        "dataset": lambda: build_dataset(seed, "train", num_train_examples, *args),
        "eval_dataset": lambda: build_dataset(seed, "eval", num_eval_examples, *args),
    }


def lcs_reward(completion: Any, answer: str) -> float:
    """2 * LCS(answer, last assistant message) / total length: 1.0 for the exact reversal."""
    last = completion[-1] if completion else None
    content = last.get("content") if isinstance(last, dict) else getattr(last, "content", None)
    return lcs_ratio(answer, content or "")


def exact_match(completion: Any, answer: str) -> float:
    """1.0 when the reply is exactly the reversed string (a metric: weight 0)."""
    return float(lcs_reward(completion, answer) == 1.0)


def load_environment(
    seed: int = 0,
    min_chars: int = 5,
    max_chars: int = 10,
    alphabet: str = "abcdefghijklmnopqrstuvwxyz",
    num_train_examples: int = 100_000,
    num_eval_examples: int = 64,
) -> vf.Environment:
    """The environment; arguments as the built-in's ``--env.args`` (plus ``seed``, ``num_eval_examples``)."""
    return vf.SingleTurnEnv(
        **dataset_builders(seed, num_train_examples, num_eval_examples, min_chars, max_chars, alphabet),
        rubric=vf.Rubric(funcs=[lcs_reward, exact_match], weights=[1.0, 0.0]),
    )
