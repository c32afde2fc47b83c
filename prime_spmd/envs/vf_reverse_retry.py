"""Multi-turn reverse-text (classic ``verifiers`` API): a wrong answer gets feedback and another try.

Turn 1 is the reverse-text task of ``vf_reverse_text`` (same dataset for the same seed and args).
While the reply is not the exact reversal and turns remain, the environment answers
``"Wrong. Try again."`` as a user message and the model answers again, seeing its earlier attempts
(``max_turns`` attempts in all). Rewards: ``lcs_reward`` of the LAST answer, minus
``retry_penalty`` per extra attempt (so a first-try solution beats a later one); metrics
``exact_match`` and ``attempts``. Recipe: configs/reverse_text_retry/.
"""

from __future__ import annotations

from typing import Any

import verifiers as vf

from prime_spmd.envs.vf_reverse_text import dataset_builders, exact_match, lcs_reward

FEEDBACK = "Wrong. Try again."


class ReverseRetryEnv(vf.MultiTurnEnv):
    """Reverse the string; on a wrong reply, the feedback message and another attempt."""

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> list:
        if exact_match(messages, state["answer"]):
            state["solved"] = True
            # verifiers 0.3.1 asks the model again after an env_response unless it sets final_env_response
            # (its stop conditions run before env_response): without it a solved rollout got one more,
            # scored, answer
            state["final_env_response"] = []
            return []
        return [vf.UserMessage(content=FEEDBACK)]

    @vf.stop
    async def solved(self, state: Any) -> bool:
        return bool(state.get("solved"))


def attempts(state: Any) -> float:
    """Model turns the rollout used (a metric: weight 0)."""
    return float(len(state["trajectory"]))


def load_environment(
    seed: int = 0,
    min_chars: int = 5,
    max_chars: int = 10,
    alphabet: str = "abcdefghijklmnopqrstuvwxyz",
    num_train_examples: int = 100_000,
    num_eval_examples: int = 64,
    max_turns: int = 3,
    retry_penalty: float = 0.1,
) -> vf.Environment:
    """The environment; ``max_turns`` attempts, ``retry_penalty`` off the reward per extra attempt."""
    datasets = dataset_builders(seed, num_train_examples, num_eval_examples, min_chars, max_chars, alphabet)
    if max_turns < 1 or not 0 <= retry_penalty < 1:
        raise ValueError(
            f"--env.args: need max_turns >= 1 and 0 <= retry_penalty < 1, got {max_turns}, {retry_penalty}"
        )

    def reward(completion: Any, answer: str, state: Any) -> float:
        return lcs_reward(completion, answer) - retry_penalty * (len(state["trajectory"]) - 1)

    return ReverseRetryEnv(
        **datasets,
        rubric=vf.Rubric(funcs=[reward, exact_match, attempts], weights=[1.0, 0.0, 0.0]),
        max_turns=max_turns,
    )
