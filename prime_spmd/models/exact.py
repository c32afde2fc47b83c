"""Exact mode's model math (``--model.exact``): one dense Qwen3 decoder layer written once over the batch-invariant
kernels (kernels/batch_invariant), shared by the trainer's forward and the native engine's prefill and decode, so that
a token's hidden state, logits and logprob do not depend on the batch, the padding, or whether it was prefilled or
decoded: the engine's sampled-token logprob equals the trainer's bit for bit at the same weights.

The rules that make it hold: every matmul, norm, SiLU-gate, attention and log-softmax runs a kernel whose reduction
order is fixed per row; the remaining ops are single IEEE operations per element (embedding lookup, RoPE's
multiply/add, residual adds), the same sequence in both callers; the RoPE tables come from one float64 computation
(``rope_tables``) whatever length asks; attention is causal by position within a row that starts at position 0
(the trainer unpacks documents into rows, the engine's cache slot is a row).

Legend (docs/conventions.md): B rows, T tokens of a row, D hidden, N query heads, Nkv kv heads, Dh head dim, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from prime_spmd.models.common.rope import rotate

ROPE_TABLE_MULTIPLE = 4096
"""Tables are computed for a length rounded up to this, so every position takes the vectorized path of torch's CPU
``cos``/``sin`` (a remainder takes the scalar path, which can differ in the last bit) whatever length was asked."""

_ROPE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rope_tables(head_dim: int, theta: float, length: int, device: torch.device, dtype: torch.dtype):
    """cos, sin [length, Dh] in ``dtype``: the half-split rotary tables of positions [0, length), computed in float64
    on the CPU and rounded once, so position p's value does not depend on ``length`` or the caller."""
    key = (head_dim, float(theta), torch.device(device), dtype)
    cached = _ROPE_CACHE.get(key)
    if cached is None or cached[0].shape[0] < length:
        n = -(-max(length, 1) // ROPE_TABLE_MULTIPLE) * ROPE_TABLE_MULTIPLE
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cached = (emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype))
        _ROPE_CACHE[key] = cached
    return cached[0][:length], cached[1][:length]


@dataclass(slots=True)
class SharedRows:
    """Prompt sharing in exact mode: one flat row [1, G * Pw + S * Sw] holding G prefix rows of Pw tokens (a share
    group's prompt, from position 0, right-padded), then S suffix rows of Sw tokens (a document's tokens after its
    group's prefix: suffix row s starts at position ``start_S[s]``, the prefix length, and attends prefix row
    ``group_S[s]``'s keys [0, start) before its own). Every token attends exactly the keys, at the positions, it
    attends in its unshared row, and the kernels are batch-invariant: the same bits, with each prompt run once."""

    num_groups: int
    prefix_len: int
    num_suffixes: int
    suffix_len: int
    group_S: torch.Tensor
    """int64 [S]: the prefix row of each suffix row"""
    start_S: torch.Tensor
    """int64 [S]: each suffix row's first position (its group's prefix length)"""
    slot_SW: torch.Tensor | None = None
    """int64 [S, Sw]: where each suffix token sits in its key row (``start_S[s] + w``); built by the first ``keys``
    call and reused by every layer's K and V (2 x layers calls a step)"""

    def keys(self, prefix_GPNkvDh: torch.Tensor, suffix_SWNkvDh: torch.Tensor) -> torch.Tensor:
        """Each suffix row's keys (or values) [S, Nkv, Pw + Sw, Dh] (a strided view): its prefix's at [0, Pw), then its
        own at [start, start + Sw), overwriting the prefix's padding; positions past a query are never read."""
        S, W = self.num_suffixes, self.suffix_len
        if self.slot_SW is None:
            self.slot_SW = self.start_S[:, None] + torch.arange(W, device=self.start_S.device)
        full = torch.cat([prefix_GPNkvDh[self.group_S], suffix_SWNkvDh.new_zeros(S, W, *suffix_SWNkvDh.shape[2:])], 1)
        # in place on the fresh cat (an out-of-place scatter would copy it first): 4 launches a call, not 7
        full.scatter_(1, self.slot_SW[:, :, None, None].expand_as(suffix_SWNkvDh), suffix_SWNkvDh)
        return full.transpose(1, 2)


@dataclass(slots=True)
class ExactContext:
    """What an exact block forward needs besides x: rows start at position 0 (``start_B`` zeros, int64 [B]), token t
    of a row at position t (``pos_BT``, int64); with ``shared`` x is one flat row of prefix and suffix rows."""

    start_B: torch.Tensor
    pos_BT: torch.Tensor
    shared: SharedRows | None = None


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def check_exact_model(model: nn.Module) -> None:
    """ValueError naming --model.exact unless ``model`` is a dense Qwen3/Llama-style decoder exact mode covers."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"--model.exact: {type(model).__name__} is not a Llama-style decoder (model.model.layers)")
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"--model.exact covers dense SwiGLU MLPs, not {type(mlp).__name__} (MoE): turn it off")
        attn = layer.self_attn
        for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            mod = getattr(attn, n, None) or getattr(mlp, n, None)
            if type(mod) is not nn.Linear:
                raise ValueError(f"--model.exact: {n} is a {type(mod).__name__}, not nn.Linear (LoRA is not covered)")


def layer_qkv(layer: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], pos: torch.Tensor):
    """Input norm, q/k/v projections, per-head q/k norm and RoPE: x [..., D] -> q [..., N, Dh], k, v [..., Nkv, Dh].
    ``rope``: cos, sin tables [P, Dh] (``rope_tables``); ``pos``: int64 [...], each token's position."""
    from prime_spmd.kernels.batch_invariant import op  # lazily: Triton loads only in exact mode

    attn = layer.self_attn
    h = op.rms_norm(x, layer.input_layernorm.weight, _eps(layer.input_layernorm))
    lead = x.shape[:-1]
    dh = attn.head_dim
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    if all(m.bias is None for m in projs):  # one launch (the same sums as three: op.linear_segments)
        q, k, v = (t.view(*lead, -1, dh) for t in op.linear_segments(h, *(m.weight for m in projs)))
    else:
        q, k, v = (op.linear(h, m.weight, m.bias).view(*lead, -1, dh) for m in projs)
    cos, sin = rope
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: norm and RoPE in one launch
        q = op.rms_norm_rope(q, attn.q_norm.weight, _eps(attn.q_norm), cos, sin, pos)
        k = op.rms_norm_rope(k, attn.k_norm.weight, _eps(attn.k_norm), cos, sin, pos)
        return q, k, v
    c, s = cos[pos][..., None, :], sin[pos][..., None, :]
    return rotate(q, c, s), rotate(k, c, s), v


def layer_out(layer: nn.Module, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The rest of a layer after attention: x + o_proj(o), then + down(silu(gate(h)) * up(h)), h the post-attention
    norm. x [..., D], o [..., N * Dh] -> [..., D]."""
    from prime_spmd.kernels.batch_invariant import op  # lazily: Triton loads only in exact mode

    attn, mlp = layer.self_attn, layer.mlp
    x = op.linear(o, attn.o_proj.weight, attn.o_proj.bias, residual=x)
    h = op.rms_norm(x, layer.post_attention_layernorm.weight, _eps(layer.post_attention_layernorm))
    gated = op.silu_mul(*op.linear_segments(h, mlp.gate_proj.weight, mlp.up_proj.weight))
    return op.linear(gated, mlp.down_proj.weight, residual=x)


def attn_scale(layer: nn.Module) -> float:
    return layer.self_attn.head_dim**-0.5


def block_forward(
    layer: nn.Module, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ExactContext
) -> torch.Tensor:
    """One layer over rows of whole documents (token t at position t): what a Qwen3 ``Block.forward`` runs when
    ``ctx`` is an ``ExactContext``. ``rope``: cos, sin tables [>= T, Dh]."""
    from prime_spmd.kernels.batch_invariant import op  # lazily: Triton loads only in exact mode

    B, T, _ = x_BTD.shape
    q, k, v = layer_qkv(layer, x_BTD, rope, ctx.pos_BT)
    sh = ctx.shared
    if sh is None:
        o = op.attention(q, k.transpose(1, 2), v.transpose(1, 2), ctx.start_B, attn_scale(layer), from_zero=True)
        return layer_out(layer, x_BTD, o.reshape(B, T, -1))
    n = sh.num_groups * sh.prefix_len
    qp, kp, vp = (t[0, :n].unflatten(0, (sh.num_groups, sh.prefix_len)) for t in (q, k, v))
    qs, ks, vs = (t[0, n:].unflatten(0, (sh.num_suffixes, sh.suffix_len)) for t in (q, k, v))
    zeros = torch.zeros(sh.num_groups, dtype=torch.long, device=q.device)
    o_pre = op.attention(qp, kp.transpose(1, 2), vp.transpose(1, 2), zeros, attn_scale(layer), from_zero=True)
    o_suf = op.attention(qs, sh.keys(kp, ks), sh.keys(vp, vs), sh.start_S, attn_scale(layer))
    o = torch.cat([o_pre.flatten(0, 1), o_suf.flatten(0, 1)])
    return layer_out(layer, x_BTD, o.reshape(B, T, -1))


def forward_hidden(
    lm: nn.Module, input_ids_BT: torch.Tensor, pos_1N: torch.Tensor | None = None, shared: SharedRows | None = None
) -> torch.Tensor:
    """Final-norm hidden states [B, T, D] of rows that each hold one document from position 0 (right padding is
    harmless: causal), or with ``shared`` of its one flat row of prefix and suffix rows ([1, N]; ``pos_1N``: each
    token's position). Layers are called as modules (FSDP2's hooks gather their weights) and dispatch to
    ``block_forward`` on the ``ExactContext``."""
    from prime_spmd.kernels.batch_invariant import op  # lazily: Triton loads only in exact mode

    B, T = input_ids_BT.shape
    inner = lm.model
    x = inner.embed_tokens(input_ids_BT)
    pos_BT = torch.arange(T, device=x.device).expand(B, T) if shared is None else pos_1N
    attn = inner.layers[0].self_attn
    rope = rope_tables(attn.head_dim, rope_theta(lm), T if shared is None else int(pos_BT.max()) + 1, x.device, x.dtype)
    ctx = ExactContext(start_B=torch.zeros(B, dtype=torch.long, device=x.device), pos_BT=pos_BT, shared=shared)
    for layer in inner.layers:
        x = layer(x, rope, ctx)
    return op.rms_norm(x, inner.norm.weight, _eps(inner.norm))


def rope_theta(lm: nn.Module) -> float:
    """The model's RoPE base (our Qwen3's args, or an HF config)."""
    args = getattr(lm, "args", None)
    if args is not None:
        return float(args.rope_theta)
    cfg = lm.config
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def lm_head_logits(hidden: torch.Tensor, w_VD: torch.Tensor) -> torch.Tensor:
    """fp32 logits [..., V] of final-norm hidden states (batch-invariant, no grad): what the engine samples from."""
    from prime_spmd.kernels.batch_invariant import op  # lazily: Triton loads only in exact mode

    return op.linear(hidden, w_VD, None, torch.float32)


def sampled_logprobs(logits_BV: torch.Tensor, tokens_B: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """fp32 [B]: log_softmax(logits / T)[token] through the kernel the trainer's ``lm_head_logprobs`` runs (greedy
    rows, T = 0, report T = 1)."""
    from prime_spmd.kernels.batch_invariant import op  # lazily: Triton loads only in exact mode

    temp = torch.where(temperature_B > 0, temperature_B.float(), torch.ones_like(temperature_B, dtype=torch.float32))
    return op.logprobs(logits_BV, tokens_B, temp)[0]
