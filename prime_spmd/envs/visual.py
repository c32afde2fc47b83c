"""Built-in visual environment (vision-language models): name the colors of an image's strips or count its squares.

Examples come from the generator the SFT data uses (``prime_spmd.data.visual``, ``--data.source visual``), so a
model fine-tuned there is trained and evaluated on the same distribution. The prompt is one user message with an
image part and a question; the engine renders it with the model's image processor (``render_prompt``), so it needs
a vision-language model (``--model.init_tiny qwen3-vl-nano`` on CPU). Reward and partial credit: ``data/visual.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from prime_spmd.data.visual import example_rng, parse_task_args, visual_example, visual_score
from prime_spmd.envs.builtin import GeneratedTaskEnv

__all__ = ["VisualEnv"]


class VisualEnv(GeneratedTaskEnv):
    """``args``: kind (colors | count), num_cells, max_count, image_size, noise (the fields of ``VisualTask``),
    num_train_examples."""

    name = "visual"

    parse_args = staticmethod(parse_task_args)

    def draw(self, split: Literal["train", "eval"], index: int) -> tuple[Any, str]:
        return visual_example(example_rng(self.seed, split, index), self.task)

    def score(self, answer: str, text: str) -> tuple[float, float]:
        return visual_score(self.task, answer, text)
