"""Qwen3 dense and Qwen3-MoE causal LMs, single-device code (parallelism lives in distributed/).

Module names mirror Hugging Face's (``model.layers.3.self_attn.q_proj.weight`` ...) so that only the
stacked MoE experts need a name mapping (``hf.py``). FSDP2-friendly: ``model.layers`` is a
ModuleList of blocks, ``blocks()`` returns it.

Legend (docs/conventions.md): B batch, T tokens, D hidden, N query heads, Nkv kv heads, Dh head dim, V vocab,
E experts, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch import nn

from prime_spmd.models.common.attention import AttnContext, attention, build_attn_context
from prime_spmd.models.common.moe import MoEBlock
from prime_spmd.models.common.norm import RMSNorm
from prime_spmd.models.common.rope import RotaryEmbedding, apply_rope
from prime_spmd.models.exact import ExactContext
from prime_spmd.models.exact import block_forward as exact_block_forward

COMPILED_BLOCK_SHAPES = dict(use_duck_shape=False)
"""How dynamo gives symbols to the sizes of a compiled block's inputs (``--trainer.compile``,
``distributed/fsdp.py: compile_block_forwards``), set around the block calls of ``forward_hidden``. No duck shapes:
two dims equal at the first call (rows and tokens, tokens and head dim) stay two symbols, where a shared one would
later fail its guard and recompile (torch 2.11 on the H100: 7-9 s a recompile; /work/notes/recompile-log.md). Eager
code ignores it."""


@dataclass(kw_only=True, slots=True)
class Qwen3Args:
    """Model shape, read from an HF ``config.json`` of type ``qwen3`` or ``qwen3_moe``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    """0 = dense Qwen3."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.0

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Qwen3Args:
        """Read the fields we use; raise ``ValueError`` for features we do not implement."""
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"custom Qwen3: rope_type {rope_type!r} not implemented; use --model.impl=hf")
        if cfg.get("use_sliding_window"):
            raise ValueError("custom Qwen3: sliding-window attention not implemented; use --model.impl=hf")
        heads = cfg["num_attention_heads"]
        kwargs = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
        )
        if cfg.get("model_type") == "qwen3_moe":
            kwargs.update(
                num_experts=cfg.get("num_experts") or cfg["num_local_experts"],  # newer HF writes the latter
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=cfg.get("norm_topk_prob", True),
                decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
                router_aux_loss_coef=cfg.get("router_aux_loss_coef", 0.0),
            )
        return cls(**kwargs)

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


@dataclass(slots=True)
class CausalLMOutput:
    """``logits`` [B, T, V] (None with ``return_hidden``), ``hidden`` [B, T, D] after the final norm,
    ``aux_loss``: mean MoE load-balance loss over MoE layers (None for dense)."""

    logits: torch.Tensor | None
    hidden: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


class Attention(nn.Module):
    """GQA with per-head RMSNorm on q and k (Qwen3), RoPE, causal within documents."""

    def __init__(self, a: Qwen3Args) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        D, bias = a.hidden_size, a.attention_bias
        self.q_proj = nn.Linear(D, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, D, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, a.rms_norm_eps)

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttnContext) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BTNDh = self.q_norm(self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim))
        k_BTNkvDh = self.k_norm(self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim))
        v_BTNkvDh = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        q_BTNDh, k_BTNkvDh = apply_rope(q_BTNDh, *rope), apply_rope(k_BTNkvDh, *rope)
        return self.o_proj(attention(q_BTNDh, k_BTNkvDh, v_BTNkvDh, ctx).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)) (dense or MoE)."""

    def __init__(self, a: Qwen3Args, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(a)
        if a.is_moe_layer(layer_idx):
            self.mlp: nn.Module = MoEBlock(
                a.hidden_size, a.moe_intermediate_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob
            )
        else:
            self.mlp = MLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(
        self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttnContext | ExactContext
    ) -> torch.Tensor:
        if isinstance(ctx, ExactContext):  # --model.exact: the batch-invariant kernels (models/exact.py)
            return exact_block_forward(self, x_BTD, rope, ctx)
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), rope, ctx)
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))


class Qwen3Backbone(nn.Module):
    """Embedding, blocks, final norm (HF's ``Qwen3Model``; attribute ``model`` of the LM)."""

    def __init__(self, a: Qwen3Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a, i) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(a.head_dim, a.rope_theta)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 / Qwen3-MoE causal LM; ``forward(input_ids [B, T], position_ids [B, T] | None)``.

    ``position_ids`` restarting at 0 inside a row mark packed documents; attention stays within them.
    """

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.args = args
        self.model = Qwen3Backbone(args)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def blocks(self) -> list[nn.Module]:
        return list(self.model.layers)

    def lm_head_weight(self) -> torch.Tensor:
        """[V, D]: the embedding when tied, else ``lm_head.weight``."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_mask_BTT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, T, D] (the input of the LM head). ``attn_mask_BTT``: optional explicit
        bool attention mask [B, T, T] (True = attend) replacing the causal-within-documents rule
        (``common/attention.py: build_attn_context``)."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        x_BTD = self.model.embed_tokens(input_ids)
        attn = self.model.layers[0].self_attn
        groups = attn.num_heads // attn.num_kv_heads
        ctx = build_attn_context(position_ids, x_BTD.dtype, attn_mask_BTT=attn_mask_BTT, query_groups=groups)
        rope = self.model.rotary_emb(position_ids, x_BTD.dtype)
        with fx_config.patch(**COMPILED_BLOCK_SHAPES):
            for block in self.model.layers:
                x_BTD = block(x_BTD, rope, ctx)
        return self.model.norm(x_BTD)

    def aux_loss(self) -> torch.Tensor | None:
        """Mean load-balance loss of the last forward over MoE layers (None for dense models)."""
        losses = [b.mlp.aux_loss for b in self.model.layers if isinstance(b.mlp, MoEBlock)]
        return torch.stack(losses).mean() if losses else None

    def tokens_per_expert(self) -> torch.Tensor | None:
        """[L, E] float token-slot counts per expert of the last forward, L the MoE layers (None for dense models)."""
        counts_E = [b.mlp.tokens_per_expert for b in self.model.layers if isinstance(b.mlp, MoEBlock)]
        return torch.stack(counts_E) if counts_E else None

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, return_hidden: bool = False
    ) -> CausalLMOutput:
        hidden_BTD = self.forward_hidden(input_ids, position_ids)
        logits_BTV = None if return_hidden else F.linear(hidden_BTD, self.lm_head_weight())
        return CausalLMOutput(logits=logits_BTV, hidden=hidden_BTD, aux_loss=self.aux_loss())

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int = 0) -> None:
        """Random init for benchmarks and tests without a checkpoint (normal(std) matrices, unit norms)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for p in self.parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std))
        self.model.rotary_emb.reset_parameters()


def set_moe_impl(model: nn.Module, impl: str) -> None:
    """Switch every MoE layer's experts kernel (``reference`` | ``grouped_mm`` | ``triton``)."""
    for m in model.modules():
        if isinstance(m, MoEBlock):
            m.experts.impl = impl
