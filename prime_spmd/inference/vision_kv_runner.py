"""Qwen3-VL with the KV cache: prefill with images, then text decode one token a step (``LlamaStyleRunner``'s path).

Prefill (the prompts the engine admits: a group's shared prompt once, the others get its K/V as for text) embeds the
tokens, scatters each prompt's image features into its image tokens (the encoder once per distinct ``key``, cached
while a slot of that prompt may still be admitted), rotates q/k by the prompt's MRoPE positions (``get_rope_index``:
[B, T, Dh] tables from the model's own rotary module), adds the DeepStack features after the first layers as
transformers does, and writes the rotated K/V. Prefill stays eager (no prefill graphs: images, per-prompt positions).

Decode is text only: the completion token at cache index t rotates at text position t + delta (delta: its prompt's
MRoPE offset, max position + 1 - length, as transformers' generation does). Text positions have all three MRoPE axes
equal, so that rotation is the ordinary 1-D RoPE with the model's (interleaved-MRoPE) frequencies, the tables
``rope_tables`` builds. So the dense model decodes through ``LlamaStyleRunner``'s fused decode layer (compiled on CUDA;
decode linears, decode attention and the decode glue kernels as for Qwen3), its RoPE rows gathered at t + delta; MoE
(``qwen3_vl_moe``) through the submodule path. ``delta_S`` (per slot, int64) is one device buffer for the runner's
life, written in place by prefill and by a shared prompt's copy, read by every decode step: a captured CUDA graph
sees each new prompt's offset.

Legend (docs/conventions.md): B batch (rows), T tokens, D hidden, V vocab, N heads, Dh head dim; local: S slots.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from prime_spmd.inference.runner import (
    DecodeAttention,
    DecodeLinear,
    KVCacheKind,
    LlamaStyleRunner,
    resolve_decode_attention,
)
from prime_spmd.models.adapter import plain_decoder_layers
from prime_spmd.models.common.rope import rotate
from prime_spmd.models.vision import VisionInputs
from prime_spmd.models.vlm import mrope_positions


class VisionKVRunner(LlamaStyleRunner):
    """``NativeEngine``'s runner for Qwen3-VL with a KV cache (module doc). The engine calls ``set_vision(slot,
    vision)`` for each prompt it prefills, then ``prefill``. ``compile_decode``, ``attention``, ``linear`` and the
    cache arguments as ``LlamaStyleRunner``'s; the fused decode layer (``self.layer_args`` set) for dense models whose
    language model has the plain Qwen3 layer shape (``fused_decode_ok``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int,
        max_len: int,
        device: torch.device,
        compile_decode: bool = True,
        attention: DecodeAttention = "auto",
        linear: DecodeLinear = "auto",
        kv_cache: KVCacheKind = "slot",
        kv_block_size: int = 16,
        kv_cache_tokens: int = 0,
    ) -> None:
        # the adapter answers supports_fused_decode False (no ``model.model.layers``): the base builds the cache,
        # the RoPE tables and the submodule path; the fused decode layer is set up below over the language model
        super().__init__(
            model,
            num_slots,
            max_len,
            device,
            compile_decode=False,
            attention=attention,
            linear=linear,
            kv_cache=kv_cache,
            kv_block_size=kv_block_size,
            kv_cache_tokens=kv_cache_tokens,
            prefill_layer_fn=False,
        )
        self.inner = model.model.language_model
        if fused_decode_ok(model):
            self.attention = resolve_decode_attention(attention, device)  # the base took triton_qkv back to triton
            # _setup_fused_decode reads ``.model.layers`` and ``.model.norm``: the language model's
            self._setup_fused_decode(SimpleNamespace(model=self.inner), compile_decode and device.type == "cuda")
            self._setup_glue()
            if self.glue:
                self.step_inputs = self._shifted_step_inputs(self.step_inputs)
        self.delta_S = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.slot_keys: list[str | None] = [None] * num_slots
        self._next_vision: dict[int, VisionInputs | None] = {}
        self._features: dict[str, tuple] = {}
        self.num_encoded_images = 0
        """Images run through the vision encoder so far (one per distinct prompt image)."""
        copy_prefix = self.cache.copy_prefix

        def copy_prefix_and_delta(src: list[int], dst: list[int], num_tokens: int) -> None:
            copy_prefix(src, dst, num_tokens)  # a shared prompt's K/V, then its MRoPE offset (in place: graphs read it)
            self.delta_S[torch.tensor(dst, device=device)] = self.delta_S[torch.tensor(src, device=device)]
            for s, d in zip(src, dst):
                self.slot_keys[d] = self.slot_keys[s]

        self.cache.copy_prefix = copy_prefix_and_delta

    def _shifted_step_inputs(self, step_inputs):
        """The decode glue's ``step_inputs`` with the RoPE rows at ``pos + delta`` and the attended lengths from the
        cache positions (the kernel reads both from one position)."""

        def shifted(ids_B, pos_B, embed_VD, cos_TcDh, sin_TcDh, kv_len: int):
            x, cos, sin, _ = step_inputs(ids_B, self._rope_positions(pos_B), embed_VD, cos_TcDh, sin_TcDh, kv_len)
            return x, cos, sin, (pos_B + 1).clamp(max=kv_len)

        return shifted

    def rebuild_rope(self) -> None:
        """Text rotation tables (the engine calls this after a weight load, between generations: the cached image
        features are stale then)."""
        super().rebuild_rope()
        if hasattr(self, "_features"):
            self._features.clear()

    def check_request(self, request) -> None:
        """``ValueError`` naming the request when its image tokens and its images disagree."""
        image_id = self.model.config.image_token_id
        n = sum(1 for t in request.prompt_ids if t == image_id)
        want = 0 if request.vision is None else sum(request.vision.tokens_per_image())
        if n < want or (request.vision is None and n):
            raise ValueError(
                f"request {request.request_id!r}: the prompt holds {n} image tokens (id {image_id}) but its images "
                f"make {want}: render prompts with images through the engine's render_prompt"
            )
        if request.vision is not None and request.vision.image_starts is not None:
            try:  # images at explicit starts (later turns of a conversation): they must be image tokens there
                request.vision.image_token_mask(torch.tensor(request.prompt_ids))
            except ValueError as e:
                raise ValueError(f"request {request.request_id!r}: {e}") from e

    def set_vision(self, slot: int, vision: VisionInputs | None) -> None:
        self._next_vision[slot] = vision

    def _encode(self, visions: list[VisionInputs]) -> None:
        """Image features of ``visions`` not cached yet; drops those no running slot's prompt holds."""
        live = {k for k in self.slot_keys if k is not None} | {v.key for v in visions}
        self._features = {k: f for k, f in self._features.items() if k in live}
        todo = {v.key: v.to(self.device) for v in visions if v.key not in self._features}
        if todo:
            self._features.update(self.adapter.image_features(list(todo.values())))
            self.num_encoded_images += sum(v.num_images for v in todo.values())

    @torch.no_grad()
    def prefill(self, ids_BT: torch.Tensor, slots_B: torch.Tensor, last_B: torch.Tensor) -> torch.Tensor:
        slots = slots_B.tolist()
        visions = [self._next_vision.pop(s, None) for s in slots]
        self._encode([v for v in visions if v is not None])
        b, t = ids_BT.shape
        pos_3BT = torch.arange(t, device=self.device)[None, None].repeat(3, b, 1)  # pads: text positions
        spans = []
        for i, (slot, v, last) in enumerate(zip(slots, visions, last_B.tolist())):
            rope_3P = mrope_positions(self.model, ids_BT[i, : last + 1], v)
            pos_3BT[:, i, : last + 1] = rope_3P
            self.delta_S[slot] = int(rope_3P.max()) + 1 - (last + 1)
            self.slot_keys[slot] = None if v is None else v.key
            if v is not None:
                spans.append((i, 0, last + 1, v))
        x, mask_BT, deep = self.adapter.embed_with_images(ids_BT, spans, self._features)
        cos_BTDh, sin_BTDh = self.inner.rotary_emb(x, pos_3BT)
        cos, sin = cos_BTDh[:, None], sin_BTDh[:, None]  # [B, 1, T, Dh] against q/k [B, N, T, Dh]
        for li, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x))
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            self.cache.write_prefill(li, slots_B, k, v)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if li < len(deep):  # DeepStack: the vision tower's earlier features join the first layers' output
                x[mask_BT] = x[mask_BT] + deep[li]
        x_BD = x[torch.arange(b, device=x.device), last_B]
        return self._lm_head(self.inner.norm(x_BD))

    def _rope_positions(self, pos_B: torch.Tensor) -> torch.Tensor:
        """Decode rotates at ``pos_B + delta`` (module doc), read from ``delta_S`` at every step (graph replays too).
        delta <= 0 (an image's MRoPE span is its grid's longest side, fewer positions than its tokens), so the rows
        stay inside the tables."""
        return pos_B + self.delta_S[: pos_B.shape[0]]


def fused_decode_ok(model: torch.nn.Module) -> bool:
    """Whether Qwen3-VL ``model``'s language model has the layer shape ``make_decode_layer`` reads (the test of
    ``HFAdapter.supports_fused_decode`` on ``model.model.language_model``): dense (no experts), SiLU, plain linears,
    RMSNorms of one epsilon."""
    cfg = model.config.text_config
    if getattr(cfg, "num_experts", 0) or getattr(cfg, "hidden_act", None) != "silu":
        return False
    return plain_decoder_layers(model.model.language_model.layers, float(cfg.rms_norm_eps))
