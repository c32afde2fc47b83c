"""Tool-use reverse-text (classic ``verifiers`` API): the model may call a ``reverse`` tool.

The reverse-text task of ``vf_reverse_text`` as a ``vf.ToolEnv`` with one tool, ``reverse(text)``.
A model that calls it (Hermes ``<tool_call>{"name": "reverse", "arguments": {"text": ...}}</tool_call>``,
parsed by the bridge) gets the reversed string back as a tool message and can then answer; one that
answers directly is scored the same way. Reward: ``lcs_reward`` of the last assistant message;
metrics ``exact_match`` and verifiers' tool-call counts. Recipe: configs/reverse_text_tool/.
"""

from __future__ import annotations

import verifiers as vf

from prime_spmd.envs.vf_reverse_text import dataset_builders, exact_match, lcs_reward


def reverse(text: str) -> str:
    """Reverse a string.

    Args:
        text: The string to reverse.
    """
    return text[::-1]


def load_environment(
    seed: int = 0,
    min_chars: int = 5,
    max_chars: int = 10,
    alphabet: str = "abcdefghijklmnopqrstuvwxyz",
    num_train_examples: int = 100_000,
    num_eval_examples: int = 64,
    max_turns: int = 3,
) -> vf.Environment:
    """The environment; ``max_turns`` model turns at most (tool calls included)."""
    datasets = dataset_builders(seed, num_train_examples, num_eval_examples, min_chars, max_chars, alphabet)
    if max_turns < 1:
        raise ValueError(f"--env.args: need max_turns >= 1, got {max_turns}")
    return vf.ToolEnv(
        **datasets,
        tools=[reverse],
        rubric=vf.Rubric(funcs=[lcs_reward, exact_match], weights=[1.0, 0.0]),
        max_turns=max_turns,
    )
