"""What the trainer, the engines and checkpoints need to know about a model, in one object per family.

Every user of a model goes through its adapter (``models/registry.py: adapter_for``) instead of
probing the module: the transformer blocks (FSDP2 units, activation checkpointing), the stacked
experts (EP), final hidden states and the LM-head weight (the trainer's fused logprob head), the
router statistics (MoE load-balance loss), the shapes and RoPE tables the native engine's KV cache
and decode path need, the HF parameter names an engine receives, and how to write an HF directory.

Families: ``hf_adapter.HFAdapter`` (any transformers causal LM; the decode fast paths for
Llama-style decoders) and ``qwen3/adapter.Qwen3Adapter`` (our own Qwen3 / Qwen3-MoE code). A new
family implements this class and registers it in ``registry.ADAPTERS``.

Legend (docs/conventions.md): B batch, T tokens, D hidden, V vocab, L layers, E experts, Dh head dim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# Per-expert MoE weight names of HF checkpoints; transformers 5 (qwen3_moe) and our code hold the experts
# stacked instead: gate_up_proj [E, 2I, D] (gate rows, then up rows), down_proj [E, D, I]
HF_EXPERT_NAME = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def hf_expert_view(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The view of a stacked expert parameter (``gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I]) that
    the per-expert HF name ``name`` maps to; None when ``name`` is not an expert weight of ``params``."""
    m = HF_EXPERT_NAME.match(name)
    if m is None:
        return None
    prefix, e, proj = m[1], int(m[2]), m[3]
    if proj == "down_proj":
        p = params.get(f"{prefix}.down_proj")
        return None if p is None or p.ndim != 3 else p[e]
    p = params.get(f"{prefix}.gate_up_proj")
    if p is None or p.ndim != 3:
        return None
    inter = p.shape[1] // 2
    return p[e, :inter] if proj == "gate_proj" else p[e, inter:]


@dataclass(slots=True)
class ModelOutput:
    """What the trainer's forward of a causal LM returns (``ModelAdapter.forward_hidden_routed``)."""

    hidden_BTD: torch.Tensor
    """Final hidden states [B, T, D] (after the final norm), with grad."""
    aux_loss: torch.Tensor | None = None
    """MoE load-balance loss (scalar fp32, with grad; mean over MoE layers, 1.0 at perfect balance); None unless
    the adapter ``has_router_aux()``."""
    tokens_per_expert_LE: torch.Tensor | None = None
    """Routed token slots per expert [MoE layers, E] (float counts, no grad); None unless ``has_router_aux()``."""


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The shapes the native engine sizes its KV cache and decode step by."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    num_experts: int
    """Routed experts per MoE layer; 0 for a dense model."""
    attn_scale: float
    """Softmax scale of attention scores (head_dim ** -0.5 unless the model says otherwise)."""
    qk_norm: bool
    """Whether attention RMS-normalizes each head of q and k (Qwen3's ``q_norm`` / ``k_norm``)."""
    rms_norm_eps: float
    """The epsilon of every RMSNorm (the fused decode layer normalizes with it)."""


def plain_projections(layer: nn.Module) -> bool:
    """Whether a decoder layer's ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj`` are all plain
    ``nn.Linear`` (not wrapped, e.g. by LoRA) and the MLP's have no bias: what the fused decode layer reads."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    lins = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    lins += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return all(type(m) is nn.Linear for m in lins) and all(m.bias is None for m in lins[4:])


def plain_decoder_layers(layers, eps: float) -> bool:
    """Whether every decoder layer of ``layers`` has the plain shape the fused decode layer reads
    (``plain_projections``) and RMSNorms (input, post-attention, q/k where present) of epsilon ``eps``."""
    for layer in layers:
        if not plain_projections(layer):
            return False
        attn = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        if not all(type(n).__name__.endswith("RMSNorm") and getattr(n, "variance_epsilon", None) == eps for n in norms):
            return False
    return True


class ModelAdapter:
    """One model family's answers; ``lm`` is the causal LM (not a wrapper of it). Subclasses implement
    the methods that raise ``NotImplementedError`` and override the defaults that do not fit."""

    family = "base"

    def __init__(self, lm: nn.Module) -> None:
        self.lm = lm

    @property
    def model_type(self) -> str:
        """The name to put in messages (an HF ``model_type`` where there is one)."""
        return type(self.lm).__name__

    # ---- structure ------------------------------------------------------------------------------
    def dims(self) -> ModelDims:
        raise NotImplementedError

    def block_lists(self) -> list[nn.ModuleList]:
        """The ModuleLists holding the transformer blocks, in order (activation checkpointing replaces
        their entries, FSDP2 shards each block before the root)."""
        raise NotImplementedError

    def blocks(self) -> list[nn.Module]:
        return [b for layers in self.block_lists() for b in layers]

    def expert_modules(self) -> list[nn.Module]:
        """Stacked-expert modules that EP shards along the ``ep`` axis (none unless the family stacks them)."""
        return []

    # ---- trainer --------------------------------------------------------------------------------
    def prepare_for_training(self) -> None:
        """Switch off what training does not use (e.g. transformers' KV cache). Called once after loading."""

    def lm_head_weight(self) -> torch.Tensor:
        """The LM-head weight [V, D] (the embedding when tied)."""
        raise NotImplementedError

    def forward_hidden(self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor | None) -> torch.Tensor:
        """Final hidden states [B, T, D] (after the final norm), without logits. ``position_ids`` restarting
        at 0 inside a row mark packed documents; attention stays within them."""
        raise NotImplementedError

    def compiles_by_default(self) -> bool:
        """Whether ``--trainer.compile auto`` compiles this model's blocks on CUDA: only code tested compiled there
        (tests/unit/test_train_compile.py); not transformers models."""
        return False

    def has_router_aux(self) -> bool:
        """Whether ``forward_hidden_routed`` returns the router's load-balance loss."""
        return False

    def config_router_aux_coef(self) -> float:
        """The load-balance loss coefficient the model's own config asks for (0.0 when none)."""
        return 0.0

    def supports_prefix_sharing(self) -> bool:
        """Whether ``forward_hidden_routed`` takes an explicit attention mask (``attn_mask_BTT``), so that the
        trainer can forward a shared prompt once for a group of documents (``trainer/packing.py: ShareLayout``).
        False where routing would see a different token multiset than unshared (MoE: load-balance loss)."""
        return False

    def forward_hidden_routed(
        self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, attn_mask_BTT: torch.Tensor | None = None
    ) -> ModelOutput:
        """The final hidden states and, where ``has_router_aux()``, the router's load-balance loss and expert
        counts (``ModelOutput``). ``attn_mask_BTT``: explicit bool mask [B, T, T] (True = attend), only where
        ``supports_prefix_sharing()``."""
        if attn_mask_BTT is not None:
            raise ValueError(f"{self.model_type}: no explicit attention mask (supports_prefix_sharing() is False)")
        return ModelOutput(self.forward_hidden(input_ids_BT, position_ids_BT))

    # ---- native engine ----------------------------------------------------------------------------
    def supports_slot_cache(self) -> bool:
        """Whether ``inference/runner.LlamaStyleRunner`` can run the model: ``lm.model`` with
        ``embed_tokens``, ``layers`` (``self_attn.{q,k,v,o}_proj``, ``mlp``, ``input_layernorm``,
        ``post_attention_layernorm``), ``norm`` and ``rotary_emb``, and full attention in every layer."""
        return False

    def supports_fused_decode(self) -> bool:
        """Whether every layer has the plain shape ``runner.make_decode_layer`` assumes: ``nn.Linear``
        projections (``self_attn.{q,k,v,o}_proj``), a SiLU ``mlp.{gate,up,down}_proj`` without biases, and
        RMSNorms with a ``weight`` and the one epsilon ``dims().rms_norm_eps``."""
        return False

    def rope_tables(self, max_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [max_len, Dh] for positions 0..max_len-1, from the model's own rotary module."""
        raise NotImplementedError

    # ---- names and checkpoints ------------------------------------------------------------------
    def param_for_hf_name(self, params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
        """The parameter (or view of one) that the HF-named tensor ``name`` is copied into; None if none.
        ``params``: ``lm.named_parameters(remove_duplicate=False)`` as a dict. Per-expert names land in
        the slices of stacked experts (``hf_expert_view``)."""
        p = params.get(name)
        return hf_expert_view(params, name) if p is None else p

    def write_hf(self, state_dict: dict[str, torch.Tensor], out_dir: Path) -> None:
        """Write ``state_dict`` (the LM's own parameter names, merged weights) as an HF model directory
        (safetensors + config.json) into the existing, empty ``out_dir``. Call on one rank only."""
        raise NotImplementedError
