"""The training sample record that datasets produce and the trainer packs (``trainer/packing.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prime_spmd.models.vision import VisionInputs


@dataclass(kw_only=True, slots=True)
class Sample:
    """One document: token ids, a loss mask over them and optional per-token float fields."""

    input_ids: list[int]
    loss_mask: list[int]
    """Per token of input_ids: 1 where the token is a training target (completion tokens)."""
    fields: dict[str, list[float]] = field(default_factory=dict)
    """Per-token floats aligned with input_ids (e.g. advantages, inference_logprobs)."""
    vision: VisionInputs | None = None
    """The prompt's images (vision-language models): input_ids hold their image tokens, never trained."""
