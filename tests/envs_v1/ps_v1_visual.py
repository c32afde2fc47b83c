"""A multi-turn verifiers v1 taskset with images: name the color of a square; a wrong answer gets the image again.

The task's prompt is a user message with an ``image_url`` part (a PNG data URL) and a text part; each wrong reply
gets a user turn holding the image once more (images in later turns), up to ``MAX_TURNS`` replies.
``--env.args image_url ...`` replaces the image URL (tests of unreadable images).
"""

from __future__ import annotations

import base64
import io

import verifiers.v1 as vf
from PIL import Image
from ps_v1_harness import ChatHarness

COLORS = {"red": (220, 20, 20), "blue": (20, 20, 220), "green": (20, 200, 20)}


def data_url(color: tuple[int, int, int]) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class ColorData(vf.TaskData):
    answer: str = ""


class ColorTask(vf.Task[ColorData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace) -> float:
        return 1.0 if self.data.answer in trace.last_reply else 0.0


class ColorTasksetConfig(vf.TasksetConfig):
    num_examples: int = 2
    image_url: str = ""
    """Replaces every task's image URL when set."""


class ColorTaskset(vf.Taskset[ColorTask, ColorTasksetConfig]):
    def load(self):
        for i in range(self.config.num_examples):
            name = list(COLORS)[i % len(COLORS)]
            image = vf.ImageUrlContentPart(
                image_url=vf.ImageUrlSource(url=self.config.image_url or data_url(COLORS[name]))
            )
            prompt = [vf.UserMessage(content=[image, vf.TextContentPart(text="Which color?")])]
            yield ColorTask(ColorData(prompt=prompt, answer=name), self.config.task)


class ColorHarness(ChatHarness):
    MAX_TURNS = 3

    def feedback(self, data, reply: str, turn: int):
        if data.answer in reply:
            return None
        image = data.prompt[0].content[0].model_dump()
        return [{"type": "text", "text": "Wrong. Look again:"}, image]


__all__ = ["ColorTaskset", "ColorHarness"]
