"""A single-turn verifiers v1 taskset (arithmetic), run by the in-process ``ChatHarness``.

Rewards: ``exact`` (the answer appears in the last reply) + ``length_bonus`` (min(len, 10) / 100),
so a random model's groups still have non-zero advantages. ``--env.args task '{"fail_reward": true}'`` makes a reward raise.
"""

from __future__ import annotations

import verifiers.v1 as vf
from ps_v1_harness import ChatHarness


class ArithData(vf.TaskData):
    answer: str = ""


class ArithTaskConfig(vf.TaskConfig):
    fail_reward: bool = False
    """Add a reward function that raises."""


class ArithTask(vf.Task[ArithData, vf.State, ArithTaskConfig]):
    @vf.reward
    async def exact(self, trace) -> float:
        return 1.0 if self.data.answer in trace.last_reply else 0.0

    @vf.reward
    async def length_bonus(self, trace) -> float:
        if self.config.fail_reward:
            raise RuntimeError("reward function bug")
        return min(len(trace.last_reply), 10) / 100.0


class ArithTasksetConfig(vf.TasksetConfig):
    num_examples: int = 4
    task: ArithTaskConfig = ArithTaskConfig()


class ArithTaskset(vf.Taskset[ArithTask, ArithTasksetConfig]):
    def load(self):
        for i in range(self.config.num_examples):
            data = ArithData(
                prompt=f"What is {i} plus {i + 1}?", system_prompt="Answer briefly.", answer=str(2 * i + 1)
            )
            yield ArithTask(data, self.config.task)


class SingleTurnHarness(ChatHarness):
    pass


__all__ = ["ArithTaskset", "SingleTurnHarness"]
