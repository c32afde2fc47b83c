"""The native engine's prefill and decode in exact mode (``--model.exact``): the layer math of ``models/exact.py``
over the slot KV cache, so that each sampled token's logprob is the one the trainer computes bit for bit
(docs/algorithms.md, "Exact mode").

Prefill runs right-padded prompts as rows from position 0, exactly as the trainer runs documents; decode runs one
token per slot at ``pos_B`` against the slot's cached K/V with the same attention kernel, whose reduction over KV
positions is the same blocks in the same order whatever the query's row or launch. The sampler picks the token from
the fp32 logits and the logprob comes from the kernel the trainer's ``lm_head_logprobs`` runs (``exact_sampler``).

Legend (docs/conventions.md): B rows (a decode step's rows are slots 0..B-1), T prompt length, D hidden, V vocab,
Dh head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from prime_spmd.models.exact import (
    attn_scale,
    check_exact_model,
    layer_out,
    layer_qkv,
    lm_head_logits,
    rope_tables,
    rope_theta,
    sampled_logprobs,
)


def setup(runner, kv_cache: str) -> None:
    """Check that exact mode covers the runner's model and cache; build the RoPE tables it reads (before any CUDA
    graph captures a read of them; the runner holds them, so they outlive any rebuild of the shared cache)."""
    from prime_spmd.kernels.batch_invariant import op

    check_exact_model(runner.model)
    if kv_cache != "slot":
        raise ValueError(f"--model.exact reads the slot KV cache: set --inference.native.kv_cache slot, not {kv_cache}")
    op.check_device(runner.cache.k)
    runner.exact_rope = rope_tables(
        runner.head_dim, rope_theta(runner.model), runner.cache.max_len, runner.device, runner.dtype
    )


def _final(runner, x_BD: torch.Tensor) -> torch.Tensor:
    from prime_spmd.kernels.batch_invariant import op

    norm = runner.inner.norm
    return op.rms_norm(x_BD, norm.weight, float(getattr(norm, "variance_epsilon", getattr(norm, "eps", runner.eps))))


@torch.no_grad()
def prefill(runner, ids_BT: torch.Tensor, slots_B: torch.Tensor, last_B: torch.Tensor) -> torch.Tensor:
    """``LlamaStyleRunner.prefill`` in exact mode: fp32 logits [B, V] at ``last_B``; writes K/V [0, T) of ``slots_B``."""
    from prime_spmd.kernels.batch_invariant import op

    b, t = ids_BT.shape
    x = runner.inner.embed_tokens(ids_BT)
    pos_BT = torch.arange(t, device=x.device).expand(b, t)
    start_B = torch.zeros(b, dtype=torch.long, device=x.device)
    for li, layer in enumerate(runner.inner.layers):
        q, k, v = layer_qkv(layer, x, runner.exact_rope, pos_BT)  # [B, T, N or Nkv, Dh]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Nkv, T, Dh]
        runner.cache.write_prefill(li, slots_B, k, v)
        o = op.attention(q, k, v, start_B, attn_scale(layer))
        x = layer_out(layer, x, o.reshape(b, t, -1))
    h = _final(runner, x[torch.arange(b, device=x.device), last_B])
    return lm_head_logits(h, runner.adapter.lm_head_weight())


@torch.no_grad()
def decode(runner, ids_B: torch.Tensor, pos_B: torch.Tensor, head: bool) -> torch.Tensor:
    """``LlamaStyleRunner.decode`` in exact mode: slot b's token at ``pos_B[b]`` attends its positions [0, pos_B[b]]
    (the length bucket plays no part); fp32 logits [B, V], or with ``head=False`` the final-norm hidden [B, D]."""
    from prime_spmd.kernels.batch_invariant import op

    b = ids_B.shape[0]
    x = runner.inner.embed_tokens(ids_B)[:, None]  # [B, 1, D]
    k_cache, v_cache = runner.cache.k, runner.cache.v
    for li, layer in enumerate(runner.inner.layers):
        q, k, v = layer_qkv(layer, x, runner.exact_rope, pos_B[:, None])  # [B, 1, N or Nkv, Dh]
        runner.cache.write_decode(li, pos_B, k[:, 0], v[:, 0])
        o = op.attention(q, k_cache[li][:b], v_cache[li][:b], pos_B, attn_scale(layer))
        x = layer_out(layer, x, o.reshape(b, 1, -1))
    h = _final(runner, x[:, 0])
    return lm_head_logits(h, runner.adapter.lm_head_weight()) if head else h


def exact_sampler(sample: Callable) -> Callable:
    """Wrap a ``sample_flat``-shaped sampler: it picks the tokens from the logits; their logprobs come from
    ``sampled_logprobs`` (the trainer's log-softmax kernel). Only unfiltered sampling (``check_sampling``)."""

    def fn(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B, seeds_B, steps_B, needs_sort, needs_min_p):
        tokens_B, _ = sample(
            logits_BV, temperature_B, top_k_B, top_p_B, min_p_B, seeds_B, steps_B, needs_sort, needs_min_p
        )
        return tokens_B, sampled_logprobs(logits_BV, tokens_B, temperature_B)

    return fn


def check_sampling(request) -> None:
    """ValueError for a request exact mode cannot serve: top-k / top-p / min-p (the trainer's logprobs are of the
    unfiltered tempered distribution)."""
    s = request.sampling
    if s.temperature > 0 and (s.top_k > 0 or s.top_p < 1.0 or s.min_p > 0):
        raise ValueError(
            f"request {request.request_id!r}: --model.exact samples without top-k/top-p/min-p (got top_k={s.top_k}, "
            f"top_p={s.top_p}, min_p={s.min_p}); the trainer's logprobs are of the unfiltered distribution"
        )
