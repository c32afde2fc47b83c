"""The visual task: images drawn here (PIL, seeded), a question about them and a partial-credit answer.

Two kinds (``VisualTask.kind``), both on a dark background with a little per-pixel color noise:
- ``colors``: the image is cut into ``num_cells`` vertical strips, each a color of ``PALETTE``; the answer names
  them left to right (``"red blue"``). Reward: the words that name their strip right, position by position, over
  the longer of answer and output (a wrong or missing word costs that strip only; extra words cost as much).
- ``count``: 1 to ``max_count`` squares of one palette color on a 4 x 4 grid; the answer is the number (``"3"``).
  Reward: ``1 - |guess - count| / max_count`` (0.0 when the output holds no number): an answer off by one still
  earns most of the credit, so RL sees a gradient between exact and wrong.

The prompt is one user message: an image part (``{"type": "image", "image": <PIL image>}``) and a text part. The
SFT data (``--data.source visual``) and the environment (``--env.name visual``) draw from the same generator.
Scoring never raises.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, fields
from typing import Literal

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (40, 80, 230),
    "yellow": (230, 220, 40),
}
_INT = re.compile(r"\d+")
GRID = 4
"""count: squares sit on a GRID x GRID lattice of cells."""


@dataclass(frozen=True, slots=True)
class VisualTask:
    """The task's knobs; ``--env.args`` / ``--data.args`` keys of the same names (strings on the CLI)."""

    kind: Literal["colors", "count"] = "colors"
    """colors: name the strips' colors left to right; count: how many squares."""
    num_cells: int = 2
    """colors: strips in the image."""
    max_count: int = 4
    """count: most squares in an image (at least 1)."""
    image_size: int = 64
    """Side of the square image in pixels."""
    noise: int = 24
    """Per-pixel color noise amplitude (0-255 scale)."""

    def __post_init__(self) -> None:
        if self.kind not in ("colors", "count"):
            raise ValueError(f"visual args: kind {self.kind!r}: choose colors or count")
        if not 1 <= self.num_cells <= 8:
            raise ValueError(f"visual args: num_cells={self.num_cells} must be in [1, 8]")
        if not 1 <= self.max_count <= GRID * GRID:
            raise ValueError(f"visual args: max_count={self.max_count} must be in [1, {GRID * GRID}]")
        if not 16 <= self.image_size <= 1024:
            raise ValueError(f"visual args: image_size={self.image_size} must be in [16, 1024]")


def parse_task_args(args: dict[str, str] | None, flag: str) -> tuple[VisualTask, dict[str, str]]:
    """(the task, the keys it did not take) from ``--env.args`` / ``--data.args``; ValueError naming ``flag``."""
    args = dict(args or {})
    kw = {}
    for f in fields(VisualTask):
        if f.name in args:
            raw = args.pop(f.name)
            try:
                kw[f.name] = raw if f.name == "kind" else int(raw)
            except ValueError as e:
                raise ValueError(f"{flag}: {f.name}={raw!r} is not an integer") from e
    return VisualTask(**kw), args


def example_rng(seed: int, split: str, index: int) -> random.Random:
    return random.Random(f"visual/{seed}/{split}/{index}")


def _noisy(img, rng: random.Random, amplitude: int):
    """``img`` with uniform per-pixel noise in [-amplitude, amplitude] on each channel (seeded by ``rng``)."""
    if amplitude <= 0:
        return img
    import numpy as np

    arr = np.asarray(img, dtype=np.int16)
    noise = np.random.default_rng(rng.getrandbits(32)).integers(-amplitude, amplitude + 1, arr.shape)
    from PIL import Image

    return Image.fromarray(np.clip(arr + noise, 0, 255).astype(np.uint8))


def visual_example(rng: random.Random, task: VisualTask) -> tuple[list[dict], str]:
    """(prompt messages with one image part, answer text) of one seeded example."""
    from PIL import Image, ImageDraw

    n = task.image_size
    img = Image.new("RGB", (n, n), (20, 20, 20))
    draw = ImageDraw.Draw(img)
    names = list(PALETTE)
    if task.kind == "colors":
        colors = [rng.choice(names) for _ in range(task.num_cells)]
        for i, c in enumerate(colors):
            draw.rectangle([i * n // task.num_cells, 0, (i + 1) * n // task.num_cells - 1, n - 1], fill=PALETTE[c])
        question, answer = "Name the colors from left to right.", " ".join(colors)
    else:
        count = rng.randint(1, task.max_count)
        color = PALETTE[rng.choice(names)]
        cell = n // GRID
        for k in rng.sample(range(GRID * GRID), count):
            x, y = (k % GRID) * cell, (k // GRID) * cell
            draw.rectangle([x + cell // 4, y + cell // 4, x + 3 * cell // 4 - 1, y + 3 * cell // 4 - 1], fill=color)
        question, answer = "How many squares?", str(count)
    img = _noisy(img, rng, task.noise)
    prompt = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": question}]}]
    return prompt, answer


def visual_score(task: VisualTask, answer: str, text: str) -> tuple[float, float]:
    """(reward, exact match) of the completion ``text`` against ``answer`` (module doc)."""
    exact = float(text.strip() == answer)
    if task.kind == "colors":
        want, got = answer.split(), text.lower().replace(",", " ").split()
        return sum(w == g for w, g in zip(want, got)) / max(len(want), len(got)), exact
    m = _INT.search(text)
    if m is None:
        return 0.0, exact
    return max(0.0, 1.0 - abs(int(m.group()) - int(answer)) / task.max_count), exact
