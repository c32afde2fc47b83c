"""A tool-using verifiers v1 taskset: the harness offers an ``add`` tool and runs the model's calls.

The tool results (``<tool_response>`` blocks in Qwen's template) are environment tokens.
"""

from __future__ import annotations

import verifiers.v1 as vf
from ps_v1_harness import ChatHarness

TOOL_CALLS: list[tuple[int, int]] = []
"""Every (a, b) the ``add`` tool was called with."""


def add(a: int, b: int) -> int:
    """Add two integers."""
    TOOL_CALLS.append((a, b))
    return a + b


class AddData(vf.TaskData):
    answer: str = ""


class AddTask(vf.Task[AddData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace) -> float:
        return 1.0 if self.data.answer in trace.last_reply else 0.0


class AddTasksetConfig(vf.TasksetConfig):
    num_examples: int = 2


class AddTaskset(vf.Taskset[AddTask, AddTasksetConfig]):
    def load(self):
        for i in range(self.config.num_examples):
            yield AddTask(AddData(prompt=f"What is {i} plus {i + 1}?", answer=str(2 * i + 1)), self.config.task)


class ToolHarness(ChatHarness):
    MAX_TURNS = 3
    TOOLS = (add,)


__all__ = ["AddTaskset", "ToolHarness"]
