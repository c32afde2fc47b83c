"""Images in chat messages -> the model's vision inputs: ``VisionInputs`` and the ``VisionProcessor``.

A prompt with images is rendered once (``VisionProcessor.render``): the chat template writes one
``<|image_pad|>`` per image, the image processor turns the images into patches (``pixel_values``) and their grid
(``image_grid_thw``), and each placeholder is expanded to the image's number of merged patches, so the prompt ids
are what the model runs (token-exact: engine, rollout and trainer see the same ids). ``VisionInputs`` travels with
the prompt: engine request, rollout, training sample, packed micro-batch. Samples of one group hold the same object
(its ``key`` identifies the pixels), so the vision encoder runs once per prompt.

Image content parts (the OpenAI / classic verifiers forms): ``{"type": "image", "image": X}`` and
``{"type": "image_url", "image_url": {"url": X}}`` where X is a PIL image, a file path, raw bytes, a
``data:image/...;base64,...`` URL or ``{"bytes": ...}`` (a datasets Image). Legend: N patches, I images.
"""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

IMAGE_PART_TYPES = ("image", "image_url")


@dataclass(kw_only=True, slots=True)
class VisionInputs:
    """The images of one prompt, as the model's vision encoder takes them."""

    pixel_values_NC: torch.Tensor
    """[N, C] float32 patches of every image in prompt order (C = channels * temporal_patch * patch * patch)."""
    image_grid_thw_I3: torch.Tensor
    """[I, 3] int64: each image's (temporal, height, width) patch grid."""
    key: str
    """A hash of the pixels and grids: equal keys are equal inputs (vision features computed once)."""
    merge_size: int
    """Patches merged into one LM token along each spatial axis (Qwen-VL: 2)."""
    image_token_id: int
    """The placeholder token the image features replace."""
    images: list | None = None
    """The decoded PIL images (engines that process images themselves: vLLM); None once past the engine."""

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw_I3.shape[0])

    def tokens_per_image(self) -> list[int]:
        """LM tokens of each image: its patches / merge_size**2."""
        return (self.image_grid_thw_I3.prod(-1) // self.merge_size**2).tolist()

    def without_images(self) -> VisionInputs:
        """The same inputs without the PIL images (what rollouts and samples carry)."""
        return self if self.images is None else replace(self, images=None)

    def to(self, device: torch.device) -> VisionInputs:
        return replace(
            self,
            pixel_values_NC=self.pixel_values_NC.to(device),
            image_grid_thw_I3=self.image_grid_thw_I3.to(device),
            images=None,
        )


def image_parts(messages: list[dict]) -> list[tuple[int, int, Any]]:
    """(message index, part index, image value) of every image content part, in order."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                value = part.get("image") if part["type"] == "image" else part.get("image_url")
                if isinstance(value, dict) and "url" in value:
                    value = value["url"]
                out.append((i, j, value))
    return out


def has_images(messages: list[dict]) -> bool:
    return bool(image_parts(messages))


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def load_image(value: Any, where: str):
    """A PIL RGB image from any accepted form (module doc); ``ValueError`` naming ``where`` and the value."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and "bytes" in value:
        value = value["bytes"]
    try:
        if isinstance(value, (bytes, bytearray)):
            img = Image.open(io.BytesIO(value))
        elif isinstance(value, str) and value.startswith("data:image/"):
            head, _, data = value.partition(",")
            if ";base64" not in head:
                raise ValueError("not a base64 data URL")
            img = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        elif isinstance(value, str) and Path(value).is_file():
            img = Image.open(value)
        else:
            raise ValueError("expected a PIL image, bytes, a data:image/...;base64 URL or an image file path")
        img.load()
    except (OSError, UnidentifiedImageError, ValueError, base64.binascii.Error) as e:
        raise ValueError(f"{where}: cannot read the image {_short(value)}: {e}") from e
    return img.convert("RGB")


def image_data_url(img, fmt: str = "PNG") -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL (for ``image_url`` parts)."""
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


class VisionProcessor:
    """A tokenizer (with an image-aware chat template) and an image processor: chat messages with images ->
    (prompt ids with every image's tokens, ``VisionInputs``). Built by ``load_vision_processor``."""

    def __init__(self, tokenizer: Any, image_processor: Any, image_token_id: int, merge_size: int) -> None:
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token_id, self.merge_size = image_token_id, merge_size

    def process_images(self, images: list) -> VisionInputs:
        """PIL images -> ``VisionInputs`` (pixels, grids, key; the images kept for engines that want them)."""
        out = self.image_processor(images=images, return_tensors="pt")
        pixels = out["pixel_values"].float().contiguous()
        grid = out["image_grid_thw"].long().contiguous()
        h = hashlib.blake2b(digest_size=16)
        h.update(grid.numpy().tobytes())
        h.update(pixels.numpy().tobytes())
        return VisionInputs(
            pixel_values_NC=pixels,
            image_grid_thw_I3=grid,
            key=h.hexdigest(),
            merge_size=self.merge_size,
            image_token_id=self.image_token_id,
            images=list(images),
        )

    def expand(self, ids: list[int], vision: VisionInputs) -> list[int]:
        """``ids`` with the i-th placeholder repeated ``tokens_per_image()[i]`` times; ``ValueError`` when the
        template wrote a different number of placeholders than there are images."""
        counts = vision.tokens_per_image()
        found = ids.count(self.image_token_id)
        if found != len(counts):
            raise ValueError(
                f"the chat template wrote {found} image placeholders (id {self.image_token_id}) for {len(counts)} "
                "images: it must render one <|image_pad|> per image content part"
            )
        out: list[int] = []
        k = 0
        for t in ids:
            if t == self.image_token_id:
                out += [t] * counts[k]
                k += 1
            else:
                out.append(t)
        return out

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], VisionInputs | None]:
        """Prompt ids (generation prompt added, image tokens expanded) and the vision inputs (None without
        images). ``ValueError`` naming the message and part of an image that cannot be read."""
        parts = image_parts(messages)
        images = [load_image(v, f"message {i} content part {j}") for i, j, v in parts]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat_template; chat prompts with images need one")
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not images:
            return ids, None
        vision = self.process_images(images)
        return self.expand(ids, vision), vision


def no_image_support(where: str, model: str) -> ValueError:
    """The error for an image given to a model without vision inputs."""
    return ValueError(
        f"{where}: the prompt holds an image but the model {model!r} takes text only (no vision tower and no "
        "preprocessor_config.json); use a vision-language model (e.g. Qwen3-VL) or drop the image parts"
    )


def load_vision_processor(path: str, tokenizer: Any) -> VisionProcessor | None:
    """The ``VisionProcessor`` of the model directory ``path`` (its ``preprocessor_config.json`` and the config's
    image token), or None for a text-only model."""
    import json

    cfg_file, pre_file = Path(path) / "config.json", Path(path) / "preprocessor_config.json"
    if not (cfg_file.is_file() and pre_file.is_file()):
        return None
    cfg = json.loads(cfg_file.read_text())
    if "vision_config" not in cfg:
        return None
    from transformers import Qwen2VLImageProcessorPil

    # the PIL processor: the fast (torchvision) one is not installed everywhere, and the two agree to rounding
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    merge = int(cfg["vision_config"].get("spatial_merge_size", 2))
    return VisionProcessor(tokenizer, image_processor, int(cfg.get("image_token_id", 151655)), merge)
