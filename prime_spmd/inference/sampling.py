"""Batched token sampling with per-row parameters and counter-based, batch-independent noise.

Shapes: ``B`` rows (sequences), ``V`` vocabulary. Every function here is pure tensor ops (no
host syncs, no per-row Python loops, no ``torch.Generator``), so a decode step can be captured in a
CUDA graph and a row's sample depends only on its own logits, seed and step, never on its
neighbours in the batch.

Order of operations for a row with temperature T > 0 (the distribution a token is sampled from,
and whose log-probability is reported; see docs/inference.md):
  1. ``logits / T`` in float32;
  2. min-p: drop tokens whose probability is below ``min_p * max_prob``;
  3. top-k: keep the k largest (ties at the k-th value are all kept);
  4. top-p: keep the smallest prefix of the descending-sorted, renormalised distribution whose
     mass reaches ``top_p`` (the token that crosses the threshold is kept);
  5. renormalise over the kept set; sample with the Gumbel-max trick using noise hashed from
     (seed, step, vocab index).
T = 0 is greedy (argmax of the raw logits) and reports ``log_softmax(logits)[token]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from prime_spmd.kernels.gumbel_sample.reference import exponential_from_bits, noise_bits

__all__ = [
    "SamplingTensors",
    "exponential_from_bits",
    "gumbel_noise",
    "make_sampler",
    "noise_bits",
    "sample",
    "sample_flat",
]

Sampler = Literal["auto", "torch", "triton", "triton_lm_head"]


def exponential_noise(seeds_B: torch.Tensor, steps_B: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard exponential noise float32 [B, V]: ``-log(u)`` for ``u = (k + 0.5) / 2^24``, k the hashed bits
    (the hash and the exact ``-log(u)`` are kernels/gumbel_sample/reference.py's, the spec the kernel follows)."""
    return exponential_from_bits(noise_bits(seeds_B, steps_B, vocab_size))


@dataclass(kw_only=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters on the logits' device. Rows with temperature 0 are greedy."""

    temperature_B: torch.Tensor
    """float32 [B]."""
    top_k_B: torch.Tensor
    """int64 [B]; 0 is off."""
    top_p_B: torch.Tensor
    """float32 [B]; 1 is off."""
    min_p_B: torch.Tensor
    """float32 [B]; 0 is off."""
    seeds_B: torch.Tensor
    """int64 [B]."""
    steps_B: torch.Tensor
    """int64 [B]: index of the token being sampled within its completion."""
    needs_sort: bool = False
    """Host-side flag: some row uses top-k or top-p (needs a vocab sort)."""
    needs_min_p: bool = False
    """Host-side flag: some row uses min-p."""


def filter_logits(logits_BV: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Temperature-scaled float32 logits with filtered-out tokens set to -inf (steps 1-4 above).

    Greedy rows (T = 0) are scaled by 1 and never filtered.
    """
    greedy_B = st.temperature_B <= 0
    temp_B = torch.where(greedy_B, torch.ones_like(st.temperature_B), st.temperature_B)
    x_BV = logits_BV.float() / temp_B[:, None]
    # A Python scalar, not torch.tensor(-inf, device=...): that builds a CPU tensor and copies it, which
    # CUDA graph capture refuses (found by the GPU suite, docs/testing.md, 2026-12-03).
    neg_inf = float("-inf")
    if st.needs_min_p:
        logp_BV = torch.log_softmax(x_BV, dim=-1)
        # p_i < min_p * p_max  <=>  logp_i < log(min_p) + logp_max
        thresh_B = torch.log(st.min_p_B.clamp_min(1e-30)) + logp_BV.max(dim=-1).values
        drop_BV = (logp_BV < thresh_B[:, None]) & (st.min_p_B > 0)[:, None] & ~greedy_B[:, None]
        x_BV = x_BV.masked_fill(drop_BV, neg_inf)
    if st.needs_sort:
        x_BV = _top_k_top_p(x_BV, st, greedy_B)
    return x_BV


def _top_k_top_p(x_BV: torch.Tensor, st: SamplingTensors, greedy_B: torch.Tensor) -> torch.Tensor:
    vocab = x_BV.shape[-1]
    sorted_BV, idx_BV = torch.sort(x_BV, dim=-1, descending=True)
    k_B = torch.where(st.top_k_B > 0, st.top_k_B.clamp_max(vocab), torch.full_like(st.top_k_B, vocab))
    kth_B = sorted_BV.gather(1, (k_B - 1)[:, None]).squeeze(1)
    ranks_V = torch.arange(vocab, device=x_BV.device)
    # top-k keeps values >= the k-th value (ties kept) -> in sorted order a prefix.
    keep_sorted_BV = sorted_BV >= kth_B[:, None]
    sorted_BV = sorted_BV.masked_fill(~keep_sorted_BV, float("-inf"))
    probs_BV = torch.softmax(sorted_BV, dim=-1)
    mass_before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV
    keep_p_BV = (mass_before_BV < st.top_p_B[:, None]) | (ranks_V[None, :] == 0)
    keep_sorted_BV = keep_sorted_BV & keep_p_BV
    keep_sorted_BV = keep_sorted_BV | greedy_B[:, None]
    keep_BV = torch.zeros_like(keep_sorted_BV).scatter(1, idx_BV, keep_sorted_BV)
    return x_BV.masked_fill(~keep_BV, float("-inf"))


def gumbel_noise(seeds_B: torch.Tensor, steps_B: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise float32 [B, V], ``-log(e)`` of ``exponential_noise``: finite, in about
    [-2.85, 17.3] (about 30 elementwise ops: worth ``torch.compile`` on CUDA, which fuses them into one kernel)."""
    return -torch.log(exponential_noise(seeds_B, steps_B, vocab_size))


def sample(logits_BV: torch.Tensor, st: SamplingTensors, noise_fn=gumbel_noise) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens int64 [B], logprobs float32 [B]).

    The logprob is log p(token) under the filtered, renormalised distribution the token was drawn
    from (for greedy rows: ``log_softmax(logits)[token]``). ``noise_fn`` is ``gumbel_noise`` or a
    compiled copy of it.
    """
    x_BV = filter_logits(logits_BV, st)
    logp_BV = torch.log_softmax(x_BV, dim=-1)
    gumbel_BV = noise_fn(st.seeds_B, st.steps_B, x_BV.shape[-1])
    sampled_B = torch.argmax(x_BV + gumbel_BV, dim=-1)
    greedy_tok_B = torch.argmax(x_BV, dim=-1)
    tokens_B = torch.where(st.temperature_B <= 0, greedy_tok_B, sampled_B)
    logprobs_B = logp_BV.gather(1, tokens_B[:, None]).squeeze(1)
    return tokens_B, logprobs_B


def sample_flat(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    min_p_B: torch.Tensor,
    seeds_B: torch.Tensor,
    steps_B: torch.Tensor,
    needs_sort: bool,
    needs_min_p: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` over plain tensors and flags (what the engine ``torch.compile``s and captures in
    its decode graph: filtering, log-softmax, noise and argmax fuse into a few kernels)."""
    st = SamplingTensors(
        temperature_B=temperature_B,
        top_k_B=top_k_B,
        top_p_B=top_p_B,
        min_p_B=min_p_B,
        seeds_B=seeds_B,
        steps_B=steps_B,
        needs_sort=needs_sort,
        needs_min_p=needs_min_p,
    )
    return sample(logits_BV, st, gumbel_noise)


def resolve_sampler(impl: str, device: torch.device) -> str:
    """The sampler to run on ``device``: "auto" is "triton_lm_head" on CUDA and "torch" elsewhere (Triton on CPU runs only
    under the interpreter). On an H200 at the Qwen3-0.6B shape (docs/benchmarks.md, 2026-12-05) triton_lm_head beat torch
    at batch 1 / 16 / 64 / 256 (815 vs 743, 11.3k vs 10.2k, 32.9k vs 31.6k, 56.7k vs 56.2k tok/s, attention triton_qkv)
    with the same mismatch KL (3.5e-5). Other names are kept; ValueError for an unknown one."""
    if impl not in ("auto", "torch", "triton", "triton_lm_head"):
        raise ValueError(f"unknown sampler {impl!r}; choose auto, torch, triton or triton_lm_head")
    if impl == "auto":
        return "triton_lm_head" if device.type == "cuda" else "torch"
    return impl


def make_sampler(impl: Sampler, compile_torch: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The engine's ``sample_flat``-shaped sampler over logits. "torch": ``sample_flat`` (``torch.compile``d when
    ``compile_torch``); "triton" (and "triton_lm_head", whose decode steps of few rows sample inside the LM head instead:
    ``NativeEngine._decode_step``): plain sampling (no top-k / top-p / min-p in the step) through the
    split-vocabulary kernels of kernels/gumbel_sample, filtered sampling through the torch one; "auto": torch
    (the engine resolves "auto" by device first: ``resolve_sampler``)."""
    kind = resolve_sampler(impl, torch.device("cpu"))  # checks the name; "auto" is torch here
    torch_fn = torch.compile(sample_flat, dynamic=True) if compile_torch else sample_flat
    if kind not in ("triton", "triton_lm_head"):
        return torch_fn
    import prime_spmd.kernels.gumbel_sample.op  # noqa: F401  registers torch.ops.prime_spmd.gumbel_sample

    def fused(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B, seeds_B, steps_B, needs_sort, needs_min_p):
        if needs_sort or needs_min_p:
            return torch_fn(
                logits_BV, temperature_B, top_k_B, top_p_B, min_p_B, seeds_B, steps_B, needs_sort, needs_min_p
            )
        return torch.ops.prime_spmd.gumbel_sample(logits_BV.float(), temperature_B, seeds_B, steps_B)

    return fused
