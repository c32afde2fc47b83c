"""The visual task as a classic ``verifiers`` environment: the template for an image environment on the Hub API.

The same task, images and reward as the built-in ``visual`` (prime_spmd/envs/visual.py), written as an Environments
Hub package writes it (verifiers>=0.3.1,<0.4): a ``vf.SingleTurnEnv`` over a ``datasets.Dataset`` whose ``prompt``
messages hold an OpenAI-style image part (``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``)
and a text part, and a ``vf.Rubric``. The bridge renders such prompts with the engine's image processor and carries the
images to the trainer (docs/environments.md, "Image environments"); it needs a vision-language model:

    python -m prime_spmd rl --model.path outputs/visual/sft/hf --env.name prime_spmd.envs.vf_visual:load_environment \\
        --env.args kind colors num_cells 2 ...

Example ``i`` of each split is the built-in's example ``i`` for the same ``seed`` and args, with the same pixels.
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


def load_environment(
    seed: int = 0,
    kind: str = "colors",
    num_cells: int = 2,
    max_count: int = 4,
    image_size: int = 64,
    noise: int = 24,
    num_train_examples: int = 1000,
    num_eval_examples: int = 64,
) -> vf.Environment:
    """The environment; arguments as the built-in's ``--env.args`` (plus ``seed``, ``num_eval_examples``)."""
    task = VisualTask(kind=kind, num_cells=num_cells, max_count=max_count, image_size=image_size, noise=noise)

    def reward(completion: Any, answer: str) -> float:
        last = completion[-1] if completion else None
        content = last.get("content") if isinstance(last, dict) else getattr(last, "content", None)
        return visual_score(task, answer, content or "")[0]

    return vf.SingleTurnEnv(
        dataset=lambda: build_dataset(seed, "train", num_train_examples, task),
        eval_dataset=lambda: build_dataset(seed, "eval", num_eval_examples, task),
        rubric=vf.Rubric(funcs=[reward], weights=[1.0]),
    )
