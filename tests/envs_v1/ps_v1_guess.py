"""A multi-turn verifiers v1 taskset: guess the number; the harness answers each wrong guess.

The user turns ("Wrong (n). Try again.") are environment tokens between the model's turns.
"""

from __future__ import annotations

import verifiers.v1 as vf
from ps_v1_harness import ChatHarness


class GuessData(vf.TaskData):
    answer: str = ""


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def solved(self, trace) -> float:
        return 1.0 if trace.last_reply.strip() == self.data.answer else 0.0

    @vf.metric
    async def turns(self, trace) -> float:
        return float(trace.num_turns)


class GuessTasksetConfig(vf.TasksetConfig):
    num_examples: int = 2


class GuessTaskset(vf.Taskset[GuessTask, GuessTasksetConfig]):
    def load(self):
        for i in range(self.config.num_examples):
            yield GuessTask(GuessData(prompt="Guess my number (0-9).", answer=str(i)), self.config.task)


class GuessHarness(ChatHarness):
    MAX_TURNS = 3

    def feedback(self, data, reply: str, turn: int) -> str | None:
        return None if reply.strip() == data.answer else f"Wrong ({turn + 1}). Try again."


__all__ = ["GuessTaskset", "GuessHarness"]
