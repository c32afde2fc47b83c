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


class ImageInputError(ValueError):
    """Bad image input: an image that cannot be read, or an image given to a text-only model. The environment bridges
    re-raise it naming the environment (an environment's other errors fail only its rollouts)."""


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
    image_starts: tuple[int, ...] | None = None
    """Where each image's tokens start in the document (prompt + completion ids), when images follow sampled tokens
    (a multi-turn conversation's later turns: ``join_vision``); None: the document's first image tokens, in order."""

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw_I3.shape[0])

    def tokens_per_image(self) -> list[int]:
        """LM tokens of each image: its patches / merge_size**2."""
        return (self.image_grid_thw_I3.prod(-1) // self.merge_size**2).tolist()

    def image_token_mask(self, ids_T: torch.Tensor) -> torch.Tensor:
        """[T] bool: the tokens of one document (ids [T], its start at index 0) that take these images' features, in
        order: the spans at ``image_starts``, or else the first ``sum(tokens_per_image())`` image tokens (the
        prompt's). Any other image token is text the policy sampled (its own embedding, text positions).
        ``ValueError`` when the document does not hold the images' tokens there."""
        is_image = ids_T == self.image_token_id
        counts = self.tokens_per_image()
        if self.image_starts is None:
            n = sum(counts)
            if int(is_image.sum()) < n:
                raise ValueError(f"a document has {int(is_image.sum())} image tokens but its images make {n}")
            return is_image & (is_image.cumsum(0) <= n)
        mask = torch.zeros_like(is_image)
        for i, (start, n) in enumerate(zip(self.image_starts, counts)):
            if start + n > ids_T.numel() or not bool(is_image[start : start + n].all()):
                raise ValueError(
                    f"image {i} of a document of {ids_T.numel()} tokens should fill its {n} image tokens from "
                    f"index {start}, but the ids there are not all image tokens (id {self.image_token_id})"
                )
            mask[start : start + n] = True
        return mask

    def starts_in(self, ids: list[int]) -> list[int]:
        """Index of each image's first token in the document ``ids`` (``image_token_mask``'s spans)."""
        if self.image_starts is not None:
            return list(self.image_starts)
        where = self.image_token_mask(torch.tensor(ids)).nonzero()[:, 0].tolist()
        offsets = [0]
        for n in self.tokens_per_image()[:-1]:
            offsets.append(offsets[-1] + n)
        return [where[k] for k in offsets]

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


def vision_key(pixels_NC: torch.Tensor, grid_I3: torch.Tensor, starts: tuple[int, ...] | None = None) -> str:
    """``VisionInputs.key``: a hash of the pixels, the grids and the explicit image starts (if any)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(grid_I3.numpy().tobytes())
    h.update(pixels_NC.numpy().tobytes())
    if starts is not None:
        h.update(repr(tuple(starts)).encode())
    return h.hexdigest()


def join_vision(first: VisionInputs | None, new: VisionInputs, starts: list[int]) -> VisionInputs:
    """The images of a conversation: ``first``'s (None: no earlier images), then ``new``'s, with every image's start
    in the document (``starts``: one per image of both, in order). PIL images kept where both have them."""
    parts = [new] if first is None else [first, new]
    pixels = torch.cat([v.pixel_values_NC for v in parts])
    grid = torch.cat([v.image_grid_thw_I3 for v in parts])
    if len(starts) != grid.shape[0]:
        raise ValueError(f"{len(starts)} image starts for {grid.shape[0]} images")
    images = None if any(v.images is None for v in parts) else [im for v in parts for im in v.images]
    return VisionInputs(
        pixel_values_NC=pixels,
        image_grid_thw_I3=grid,
        key=vision_key(pixels, grid, tuple(starts)),
        merge_size=new.merge_size,
        image_token_id=new.image_token_id,
        images=images,
        image_starts=tuple(starts),
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
        raise ImageInputError(f"{where}: cannot read the image {_short(value)}: {e}") from e
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
        return VisionInputs(
            pixel_values_NC=pixels,
            image_grid_thw_I3=grid,
            key=vision_key(pixels, grid),
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

    def images_of(self, messages: list[dict], first_message: int = 0) -> VisionInputs | None:
        """The vision inputs of the image parts of ``messages`` (None without any); ``ImageInputError`` naming the
        message (``first_message`` + its index) and part of an image that cannot be read."""
        parts = image_parts(messages)
        images = [load_image(v, f"message {first_message + i} content part {j}") for i, j, v in parts]
        return self.process_images(images) if images else None

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
    ) -> tuple[list[int], VisionInputs | None]:
        """Prompt ids (generation prompt added, image tokens expanded) and the vision inputs (None without
        images). ``ImageInputError`` naming the message and part of an image that cannot be read."""
        vision = self.images_of(messages)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat_template; chat prompts with images need one")
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return (ids, None) if vision is None else (self.expand(ids, vision), vision)


def no_image_support(where: str, model: str) -> ImageInputError:
    """The error for an image given to a model without vision inputs."""
    return ImageInputError(
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
