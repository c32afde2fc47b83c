"""A classic verifiers environment for the mixture tests: its environment code raises on even examples.

``load_flaky_env``: a two-turn echo game; ``env_response`` raises ``ConnectionError`` (a tool service that
went away) for even example ids, so those groups fail as a whole while odd ones run.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


class FlakyEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        if int(state["answer"]) % 2 == 0:
            raise ConnectionError(f"tool service unreachable (example {state['answer']})")
        return [vf.UserMessage(content="Again.")]


def load_flaky_env(num_examples: int = 8) -> vf.Environment:
    def length_reward(completion) -> float:
        return min(len(completion[-1].content or ""), 8) / 8.0

    ds = Dataset.from_list([{"question": f"Say {i}.", "answer": str(i)} for i in range(num_examples)])
    return FlakyEnv(dataset=ds, eval_dataset=ds, rubric=vf.Rubric(funcs=[length_reward]), max_turns=2)
