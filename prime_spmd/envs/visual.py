"""Built-in visual environment (vision-language models): name the colors of an image's strips or count its squares.

Examples come from the generator the SFT data uses (``prime_spmd.data.visual``, ``--data.source visual``), so a
model fine-tuned there is trained and evaluated on the same distribution. The prompt is one user message with an
image part and a question; the engine renders it with the model's image processor (``render_prompt``), so it needs
a vision-language model (``--model.init_tiny qwen3-vl-nano`` on CPU). Reward and partial credit: ``data/visual.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from prime_spmd.data.visual import example_rng, parse_task_args, visual_example, visual_score
from prime_spmd.envs.builtin import BuiltinEnv

__all__ = ["VisualEnv"]


class VisualEnv(BuiltinEnv):
    """``args``: kind (colors | count), num_cells, max_count, image_size, noise (the fields of ``VisualTask``),
    num_train_examples."""

    name = "visual"

    def __init__(self, *, seed: int = 0, num_eval_examples: int = 64, args: dict[str, str] | None = None) -> None:
        self.task, rest = parse_task_args(args, "--env.args")
        num_train = rest.pop("num_train_examples", "100000")
        if rest:
            raise ValueError(f"--env.args: unknown keys {sorted(rest)} for visual")
        self.num_train = int(num_train)
        self.seed, self.num_eval = seed, num_eval_examples

    def num_examples(self, split: Literal["train", "eval"]) -> int:
        return self.num_train if split == "train" else self.num_eval

    def example(self, split: Literal["train", "eval"], index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_examples(split):
            raise ValueError(f"visual: {split} example {index} out of range [0, {self.num_examples(split)})")
        prompt, answer = visual_example(example_rng(self.seed, split, index), self.task)
        return {"prompt": prompt, "answer": answer, "example_id": index}

    def score(self, answer: str, text: str) -> tuple[float, float]:
        return visual_score(self.task, answer, text)
