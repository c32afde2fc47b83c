"""Classic verifiers environments written the way an Environments Hub package writes them (not ours).

Loaded by tests through the bridge as ``tests.envs_for_tests:<function>`` (``--env.name``).
Tools and reward functions record their calls in module-level lists so tests can assert on them.
"""

from __future__ import annotations

import asyncio
import time

import verifiers as vf
from datasets import Dataset

TOOL_CALLS: list[tuple[int, int]] = []
"""Every (a, b) the tool env's ``add`` tool was called with."""


def _dataset(n: int) -> Dataset:
    return Dataset.from_list([{"question": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1)} for i in range(n)])


def load_environment(num_examples: int = 4, **kwargs) -> vf.Environment:
    """Default entry point (``tests/envs_for_tests.py`` as a file path): the single-turn env."""
    return load_single_turn_env(num_examples=num_examples, **kwargs)


def load_single_turn_env(num_examples: int = 4, failing_rewards: bool = False, hang_s: float = 5.0) -> vf.Environment:
    """Single-turn arithmetic. ``failing_rewards`` adds a raising, an async-hanging and a sync-hanging reward."""

    def exact(completion, answer) -> float:
        text = completion[-1].content or ""
        return 1.0 if answer in text else 0.0

    def length_bonus(completion) -> float:
        return min(len(completion[-1].content or ""), 10) / 100.0

    funcs, weights = [exact, length_bonus], [1.0, 1.0]
    if failing_rewards:

        def raises(completion) -> float:
            raise RuntimeError("reward function bug")

        async def hangs_async(completion) -> float:
            await asyncio.sleep(hang_s)
            return 1.0

        def hangs_sync(completion) -> float:
            time.sleep(hang_s)
            return 1.0

        funcs += [raises, hangs_async, hangs_sync]
        weights += [1.0, 1.0, 1.0]
    rubric = vf.Rubric(funcs=funcs, weights=weights)
    ds = _dataset(num_examples)
    return vf.SingleTurnEnv(dataset=ds, eval_dataset=ds, system_prompt="Answer briefly.", rubric=rubric)


class GuessEnv(vf.MultiTurnEnv):
    """Guess the number: after each guess the environment answers "higher"/"lower"/"correct"."""

    async def env_response(self, messages, state, **kwargs):
        guess = (messages[-1].content or "").strip()
        target = state["answer"]
        if guess == target:
            state["solved"] = True
            return [vf.UserMessage(content="correct")]
        return [vf.UserMessage(content=f"Wrong ({len(state['trajectory'])}). Try again.")]

    @vf.stop
    async def solved(self, state) -> bool:
        return bool(state.get("solved"))


def load_multi_turn_env(num_examples: int = 2, max_turns: int = 3) -> vf.Environment:
    def solved_reward(state) -> float:
        return 1.0 if state.get("solved") else 0.0

    ds = Dataset.from_list([{"question": "Guess my number (0-9).", "answer": str(i)} for i in range(num_examples)])
    return GuessEnv(dataset=ds, rubric=vf.Rubric(funcs=[solved_reward]), max_turns=max_turns)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    TOOL_CALLS.append((a, b))
    return a + b


def load_tool_env(num_examples: int = 2, max_turns: int = 3) -> vf.Environment:
    def correct(completion, answer) -> float:
        return 1.0 if answer in (completion[-1].content or "") else 0.0

    ds = _dataset(num_examples)
    return vf.ToolEnv(dataset=ds, tools=[add], rubric=vf.Rubric(funcs=[correct]), max_turns=max_turns)


class ForgetfulEnv(vf.MultiTurnEnv):
    """Rewrites its history each turn (keeps only the original prompt + a fresh hint), as summarising or
    context-trimming environments do: turn 2's prompt does not extend turn 1's prompt + completion."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Try again.")]

    async def get_prompt_messages(self, state):
        if not state["trajectory"]:
            return state["prompt"]
        n = len(state["trajectory"])
        return list(state["prompt"]) + [vf.UserMessage(content=f"Attempt {n + 1}; earlier answers were wrong.")]


def load_forgetful_env(num_examples: int = 1, max_turns: int = 2) -> vf.Environment:
    ds = Dataset.from_list([{"question": "Guess my number (0-9).", "answer": str(i)} for i in range(num_examples)])
    return ForgetfulEnv(dataset=ds, rubric=vf.Rubric(funcs=[lambda completion: 0.5]), max_turns=max_turns)
