"""The adapter of transformers causal LMs (``AutoModelForCausalLM``), any architecture.

Blocks are found under the usual attribute paths; the native engine's slot-cache runner and fused
decode layer apply to Llama-style decoders (``LLAMA_STYLE`` with full attention); the router
load-balance loss is computed from transformers' router logits for ``HF_ROUTER_AUX_TYPES`` only.

Legend (docs/conventions.md): B batch, T tokens, D hidden, V vocab, E experts, K experts per token.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from torch import nn

from prime_spmd.models.adapter import ModelAdapter, ModelDims, ModelOutput, plain_decoder_layers
from prime_spmd.models.common.meta import on_meta
from prime_spmd.models.common.moe import load_balance_loss

LLAMA_STYLE = {"qwen3", "qwen2", "llama", "mistral"}
# transformers MoE types whose router is a softmax top-k over router logits (our load_balance_loss applies)
HF_ROUTER_AUX_TYPES = ("qwen3_moe",)
_BLOCK_PATHS = ("model.layers", "layers", "transformer.h", "gpt_neox.layers")


class HFAdapter(ModelAdapter):
    family = "hf"
    hf_auto_class = "AutoModelForCausalLM"
    """The transformers auto class ``write_hf`` builds the exported model with, by name: importing a transformers
    auto-model class imports its generation code (transformers 5.17: 2-6 s of start-up with scikit-learn installed),
    which a run on our own model code never needs."""

    @property
    def model_type(self) -> str:
        return getattr(self.lm.config, "model_type", type(self.lm).__name__)

    def dims(self) -> ModelDims:
        cfg = self.lm.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers = getattr(getattr(self.lm, "model", None), "layers", None)
        attn0 = getattr(layers[0], "self_attn", None) if layers else None
        return ModelDims(
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            num_experts=int(getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0) or 0),
            attn_scale=float(getattr(attn0, "scaling", head_dim**-0.5)),
            qk_norm=attn0 is not None and hasattr(attn0, "q_norm"),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", None) or 1e-6),
        )

    def block_lists(self) -> list[nn.ModuleList]:
        for path in _BLOCK_PATHS:
            obj = self.lm
            for part in path.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if isinstance(obj, nn.ModuleList):
                return [obj]
        raise ValueError(f"cannot find the transformer blocks of {type(self.lm).__name__} (looked for {_BLOCK_PATHS})")

    def prepare_for_training(self) -> None:
        self.lm.config.use_cache = False

    def lm_head_weight(self) -> torch.Tensor:
        head = self.lm.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(self.lm).__name__} has no output embeddings (LM head)")
        return head.weight

    def _decoder(self) -> nn.Module:
        return self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else self.lm.model

    def forward_hidden(self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor | None) -> torch.Tensor:
        # transformers detects packed documents from position_ids (no attention mask), as our code does
        out = self._decoder()(input_ids=input_ids_BT, position_ids=position_ids_BT, use_cache=False)
        return out.last_hidden_state

    def has_router_aux(self) -> bool:
        return self.dims().num_experts > 0 and self.model_type in HF_ROUTER_AUX_TYPES

    def config_router_aux_coef(self) -> float:
        return float(getattr(self.lm.config, "router_aux_loss_coef", 0.0) or 0.0)

    def forward_hidden_routed(
        self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, attn_mask_BTT: torch.Tensor | None = None
    ) -> ModelOutput:
        # no prefix sharing (supports_prefix_sharing() is False): transformers' mask handling differs per
        # model and attention implementation, so the trainer keeps the packed path for these models
        if attn_mask_BTT is not None:
            raise ValueError(f"{self.model_type}: no explicit attention mask (supports_prefix_sharing() is False)")
        if not self.has_router_aux():
            return ModelOutput(self.forward_hidden(input_ids_BT, position_ids_BT))
        out = self._decoder()(
            input_ids=input_ids_BT, position_ids=position_ids_BT, use_cache=False, output_router_logits=True
        )
        losses, counts = [], []
        for logits_TE in out.router_logits:  # one per MoE layer; softmax then top-k, as transformers' router
            probs_TE = torch.softmax(logits_TE.reshape(-1, logits_TE.shape[-1]), dim=-1, dtype=torch.float)
            ids_TK = torch.topk(probs_TE, self.lm.config.num_experts_per_tok, dim=-1).indices
            aux, counts_E = load_balance_loss(probs_TE, ids_TK)
            losses.append(aux)
            counts.append(counts_E)
        return ModelOutput(out.last_hidden_state, torch.stack(losses).mean(), torch.stack(counts))

    def supports_slot_cache(self) -> bool:
        cfg = self.lm.config
        if getattr(cfg, "model_type", None) not in LLAMA_STYLE:
            return False
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
            return False
        if getattr(cfg, "use_sliding_window", False):
            return False
        inner = getattr(self.lm, "model", None)
        return all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))

    def supports_fused_decode(self) -> bool:
        if not self.supports_slot_cache() or getattr(self.lm.config, "hidden_act", None) != "silu":
            return False
        return plain_decoder_layers(self.lm.model.layers, self.dims().rms_norm_eps)

    def rope_tables(self, max_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(max_len, device=device)[None]
        probe = torch.zeros(1, device=device, dtype=dtype)  # transformers reads only its dtype and device
        cos, sin = self.lm.model.rotary_emb(probe, pos)
        return cos[0].contiguous(), sin[0].contiguous()

    def write_hf(self, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
        with on_meta():
            fresh = getattr(transformers, self.hf_auto_class).from_config(self.lm.config)
        fresh.load_state_dict(state_dict, strict=False, assign=True)
        fresh.tie_weights()
        missing = [n for n, p in fresh.named_parameters() if p.is_meta]
        assert not missing, f"HF export: parameters missing from the state dict: {missing[:5]}"
        fresh.save_pretrained(out_dir)
