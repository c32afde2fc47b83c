"""The native engine's runner for vision-language models (Qwen3-VL, ``models/vlm.py``): images in the prompt.

Prefill encodes each prompt's images once (``VisionInputs.key``: the samples of a GRPO group, admitted together or
not, share the features while any of their slots runs), scatters the features into the image tokens and the
DeepStack layers, and gives the tokens the model's multimodal rotary positions (``get_rope_index``); a completion
token at sequence index t takes position t + delta on all three axes (delta: the prompt's MRoPE offset), as
transformers' own generation does. Like ``runner.GenericRunner`` it keeps each slot's token ids and re-runs whole
sequences (with the cached image features) at every decode step: no KV cache, so the engine's sampled-token
logprobs are a plain forward of the same positions and features the trainer runs.

Legend (docs/conventions.md): B batch (slots), T tokens, V vocab; local: P prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prime_spmd.models.registry import adapter_for
from prime_spmd.models.vision import VisionInputs
from prime_spmd.models.vlm import mrope_positions


@dataclass(slots=True)
class _Slot:
    ids: list[int]
    vision: VisionInputs | None
    rope_3P: torch.Tensor
    """[3, P] MRoPE positions of the prompt."""
    delta: int
    """A token at sequence index t >= P has position t + delta on every axis."""


class VisionRunner:
    """Runs a Qwen3-VL for ``NativeEngine`` (module doc). The engine calls ``set_vision(slot, vision)`` for each
    slot it prefills, then ``prefill``; ``decode`` re-runs the slots' sequences."""

    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int, device: torch.device) -> None:
        self.model, self.device, self.max_len = model, device, max_len
        self.adapter = adapter_for(model)
        self.vocab_size = model.config.text_config.vocab_size
        self.cache = None
        # what resolved.py reports of a runner: no decode kernels here (whole sequences through the model's modules)
        self.attention = self.linear = "model (vision runner)"
        self.prefill_layer = None
        self.slots: list[_Slot | None] = [None] * num_slots
        self._next_vision: dict[int, VisionInputs | None] = {}
        self._features: dict[str, tuple] = {}
        self.num_encoded_images = 0
        """Images run through the vision encoder so far (one per distinct prompt image)."""

    def rebuild_rope(self) -> None:
        """The weights changed (the engine calls this after a weight load, between generations): drop the cached
        image features and the slots' sequences (a finished slot's dummy decode row must not read stale features)."""
        self._features.clear()
        self.slots = [None] * len(self.slots)

    def check_request(self, request) -> None:
        """``ValueError`` naming the request when its image tokens and its images disagree (e.g. a prompt rendered
        by a text-only path: the chat template wrote a placeholder but no image came with it)."""
        image_id = self.model.config.image_token_id
        n = sum(1 for t in request.prompt_ids if t == image_id)
        want = 0 if request.vision is None else sum(request.vision.tokens_per_image())
        if n != want:
            raise ValueError(
                f"request {request.request_id!r}: the prompt holds {n} image tokens (id {image_id}) but its images "
                f"make {want}: render prompts with images through the engine's render_prompt"
            )

    def set_vision(self, slot: int, vision: VisionInputs | None) -> None:
        self._next_vision[slot] = vision

    def _encode(self, visions: list[VisionInputs]) -> None:
        live = {s.vision.key for s in self.slots if s is not None and s.vision is not None}
        live |= {v.key for v in visions}
        self._features = {k: f for k, f in self._features.items() if k in live}
        todo = [v.to(self.device) for v in visions if v.key not in self._features]
        if todo:
            self._features.update(self.adapter.image_features(todo))
            self.num_encoded_images += sum(v.num_images for v in {v.key: v for v in todo}.values())

    def _slot_positions(self, s: _Slot) -> torch.Tensor:
        p = s.rope_3P.shape[1]
        tail = torch.arange(p, len(s.ids), device=self.device) + s.delta
        return torch.cat([s.rope_3P, tail[None].expand(3, -1)], dim=1)

    @torch.no_grad()
    def _last_logits(self, slots: list[_Slot]) -> torch.Tensor:
        t = max(len(s.ids) for s in slots)
        ids_BT = torch.zeros(len(slots), t, dtype=torch.long, device=self.device)
        pos_4BT = torch.arange(t, device=self.device)[None, None].repeat(4, len(slots), 1)
        spans = []
        for i, s in enumerate(slots):
            ids_BT[i, : len(s.ids)] = torch.tensor(s.ids, device=self.device)
            pos_4BT[1:, i, : len(s.ids)] = self._slot_positions(s)  # pads keep text positions (never attended)
            if s.vision is not None:
                assert s.vision.key in self._features, "a running slot's image features were dropped"
                spans.append((i, 0, len(s.ids), s.vision))
        # right padding + causal attention: real positions see only real tokens
        hidden = self.adapter.forward_embedded(ids_BT, pos_4BT, spans, self._features)
        last = torch.tensor([len(s.ids) - 1 for s in slots], device=self.device)
        h = hidden[torch.arange(len(slots), device=self.device), last]
        return self.model.lm_head(h).float()

    def prefill(self, ids_BT: torch.Tensor, slots_B: torch.Tensor, last_B: torch.Tensor) -> torch.Tensor:
        visions = [self._next_vision.pop(s, None) for s in slots_B.tolist()]
        self._encode([v for v in visions if v is not None])
        for slot, row, last, v in zip(slots_B.tolist(), ids_BT.tolist(), last_B.tolist(), visions):
            ids = row[: last + 1]
            rope = mrope_positions(self.model, torch.tensor(ids, device=self.device), v)
            delta = int(rope.max()) + 1 - len(ids)
            self.slots[slot] = _Slot(ids, v, rope, delta)
        return self._last_logits([self.slots[s] for s in slots_B.tolist()])

    def decode(self, ids_B: torch.Tensor, pos_B: torch.Tensor, kv_len: int) -> torch.Tensor:
        for slot, (tok, pos) in enumerate(zip(ids_B.tolist(), pos_B.tolist())):
            s = self.slots[slot]
            if s is None or pos < s.rope_3P.shape[1]:  # a free slot's dummy row
                s = self.slots[slot] = _Slot([], None, torch.zeros(3, 0, dtype=torch.long, device=self.device), 0)
            s.ids = s.ids[:pos] + [tok]
        return self._last_logits(self.slots[: ids_B.shape[0]])
