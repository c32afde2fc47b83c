"""The adapter of our own Qwen3 / Qwen3-MoE code (``models/adapter.py`` says what an adapter answers).

Legend (docs/conventions.md): B batch, T tokens, D hidden, V vocab, E experts, Dh head dim.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from prime_spmd.models.adapter import ModelAdapter, ModelDims, ModelOutput, plain_projections
from prime_spmd.models.common.moe import GroupedExperts
from prime_spmd.models.qwen3.hf import to_hf
from prime_spmd.models.qwen3.model import Qwen3ForCausalLM


class Qwen3Adapter(ModelAdapter):
    family = "qwen3"
    lm: Qwen3ForCausalLM

    @property
    def model_type(self) -> str:
        return "qwen3_moe (custom)" if self.lm.args.num_experts else "qwen3 (custom)"

    def compiles_by_default(self) -> bool:
        return self.lm.args.num_experts == 0  # MoE blocks: data-dependent routing shapes

    def dims(self) -> ModelDims:
        a = self.lm.args
        return ModelDims(
            num_layers=a.num_hidden_layers,
            num_heads=a.num_attention_heads,
            num_kv_heads=a.num_key_value_heads,
            head_dim=a.head_dim,
            hidden_size=a.hidden_size,
            vocab_size=a.vocab_size,
            num_experts=a.num_experts,
            attn_scale=a.head_dim**-0.5,
            qk_norm=True,
            rms_norm_eps=a.rms_norm_eps,
        )

    def block_lists(self) -> list[nn.ModuleList]:
        return [self.lm.model.layers]

    def expert_modules(self) -> list[nn.Module]:
        return [m for m in self.lm.modules() if isinstance(m, GroupedExperts)]

    def lm_head_weight(self) -> torch.Tensor:
        return self.lm.lm_head_weight()

    def forward_hidden(self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor | None) -> torch.Tensor:
        return self.lm.forward_hidden(input_ids_BT, position_ids_BT)

    def has_router_aux(self) -> bool:
        return self.lm.args.num_experts > 0

    def config_router_aux_coef(self) -> float:
        return float(self.lm.args.router_aux_loss_coef or 0.0)

    def supports_prefix_sharing(self) -> bool:
        # dense only: an MoE would route the shared prompt once instead of once per document, which changes
        # the load-balance loss and the expert counts (and padding would be routed too)
        return self.lm.args.num_experts == 0

    def forward_hidden_routed(
        self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, attn_mask_BTT: torch.Tensor | None = None
    ) -> ModelOutput:
        if attn_mask_BTT is not None and not self.supports_prefix_sharing():
            raise ValueError(f"{self.model_type}: no explicit attention mask (supports_prefix_sharing() is False)")
        hidden_BTD = self.lm.forward_hidden(input_ids_BT, position_ids_BT, attn_mask_BTT)
        if not self.has_router_aux():
            return ModelOutput(hidden_BTD)
        return ModelOutput(hidden_BTD, self.lm.aux_loss(), self.lm.tokens_per_expert())

    def supports_slot_cache(self) -> bool:
        return True

    def supports_fused_decode(self) -> bool:
        # dense: every block is Attention (q/k/v/o, RMSNorm q/k norms) + a SwiGLU MLP without biases, all norms at
        # args.rms_norm_eps; MoE blocks decode through their own modules (grouped experts). The projections must
        # be plain nn.Linear (not wrapped, e.g. by LoRA): the fused layer reads their weights, concatenated
        return self.lm.args.num_experts == 0 and all(plain_projections(layer) for layer in self.lm.model.layers)

    def rope_tables(self, max_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.lm.model.rotary_emb(torch.arange(max_len, device=device)[None], dtype)
        return cos[0].contiguous(), sin[0].contiguous()

    def write_hf(self, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
        cfg = getattr(self.lm, "hf_config", None)  # set by hf.load_qwen3
        if cfg is None:
            raise ValueError("HF export of a custom Qwen3 built without a config.json (load it with load_qwen3)")
        if cfg.get("tie_word_embeddings"):
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        tensors = {n: t.detach().cpu().clone().contiguous() for n, t in to_hf(state_dict.items())}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
