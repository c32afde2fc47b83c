"""The visual task as a classic ``verifiers`` environment: the template for an image environment on the Hub API.

The same task, images and reward as the built-in ``visual`` (prime_spmd/envs/visual.py), written as an Environments
Hub package writes it (verifiers>=0.3.1,<0.4): a ``vf.SingleTurnEnv`` over a ``datasets.Dataset`` whose ``prompt``
messages hold an OpenAI-style image part (``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``)
and a text part, and a ``vf.Rubric``. The bridge renders such prompts with the engine's image processor and carries the
images to the trainer (docs/environments.md, "Image environments"); it needs a vision-language model:

    python -m prime_spmd rl --model.path outputs/visual/sft/hf --env.name prime_spmd.envs.vf_visual:load_environment \\
        --env.args kind colors num_cells 2 ...

Example ``i`` of each split is the built-in's example ``i`` for the same ``seed`` and args, with the same pixels.

``max_turns`` > 1 makes it a ``vf.MultiTurnEnv`` with images in later turns: a wrong answer gets a user message
holding the image again (an image part, as a tool result or a new observation would) and another try; the reward is
that of the last answer. The bridge stitches each later turn token-exact with its images expanded, and the rollout
carries every image of the conversation in order.
"""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset

from prime_spmd.data.visual import VisualTask, example_rng, visual_example, visual_score
from prime_spmd.models.vision import image_data_url


def build_dataset(seed: int, split: str, num_examples: int, task: VisualTask) -> Dataset:
    """``num_examples`` rows of ``split``: ``prompt`` (one user message: the image as a PNG data URL, the question)
    and ``answer``."""
    rows = []
    for i in range(num_examples):
        prompt, answer = visual_example(example_rng(seed, split, i), task)
        image, text = prompt[0]["content"]
        content = [{"type": "image_url", "image_url": {"url": image_data_url(image["image"])}}, text]
        rows.append({"prompt": [{"role": "user", "content": content}], "answer": answer, "example_id": i})
    return Dataset.from_list(rows)


RETRY_TEXT = "Wrong. Look again:"


class VisualRetryEnv(vf.MultiTurnEnv):
    """The visual task with another look after a wrong answer (module doc)."""

    def __init__(self, task: VisualTask, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.task = task

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> list:
        last = messages[-1] if messages else None
        content = last.get("content") if isinstance(last, dict) else getattr(last, "content", None)
        if visual_score(self.task, state["answer"], content or "")[1] == 1.0:
            state["final_env_response"] = []  # verifiers 0.3.1 asks again after an env_response without it
            return []
        image = next(p for p in state["prompt"][0]["content"] if p["type"] == "image_url")
        return [vf.UserMessage(content=[{"type": "text", "text": RETRY_TEXT}, image])]


def load_environment(
    seed: int = 0,
    kind: str = "colors",
    num_cells: int = 2,
    max_count: int = 4,
    image_size: int = 64,
    noise: int = 24,
    num_train_examples: int = 1000,
    num_eval_examples: int = 64,
    max_turns: int = 1,
) -> vf.Environment:
    """The environment; arguments as the built-in's ``--env.args`` (plus ``seed``, ``num_eval_examples``,
    ``max_turns``: answers per rollout, module doc)."""
    if max_turns < 1:
        raise ValueError(f"--env.args max_turns={max_turns}: need at least 1")
    task = VisualTask(kind=kind, num_cells=num_cells, max_count=max_count, image_size=image_size, noise=noise)

    def reward(completion: Any, answer: str) -> float:
        last = completion[-1] if completion else None
        content = last.get("content") if isinstance(last, dict) else getattr(last, "content", None)
        return visual_score(task, answer, content or "")[0]

    datasets = dict(
        dataset=lambda: build_dataset(seed, "train", num_train_examples, task),
        eval_dataset=lambda: build_dataset(seed, "eval", num_eval_examples, task),
        rubric=vf.Rubric(funcs=[reward], weights=[1.0]),
    )
    if max_turns == 1:
        return vf.SingleTurnEnv(**datasets)
    return VisualRetryEnv(task, max_turns=max_turns, **datasets)
