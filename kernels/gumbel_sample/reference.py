"""Gumbel-max sampling of one token per row with counter-based noise, the spec (plain sampling: no top-k,
top-p or min-p; prime_spmd/inference/sampling.py filters first and then samples the same way).

For row b with temperature T_b > 0: ``x = logits / T_b`` in float32, the token is
``argmax(x + g)`` with Gumbel noise ``g = -log(e)``, ``e = exponential_from_bits(noise_bits(seed_b, step_b, V))``,
a pure function of (seed, step, vocab index), so a row's sample never depends on its neighbours; its logprob is
``log_softmax(x)[token]``. T_b <= 0 is greedy: ``argmax(logits)`` (first index on ties) and
``log_softmax(logits)[token]``. Legend (docs/conventions.md): B rows, V vocabulary.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
NOISE_BITS = 24
_HALF = 1 << (NOISE_BITS - 1)
_SCALE = 1.0 / (1 << NOISE_BITS)
VOCAB_SALT = 0x3C6EF372
"""Added to the vocab index before hashing it."""
SEED_SALT = 0x5BD1E995
"""XORed into the seed's low word."""


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32-style) on int64 tensors holding values in [0, 2^32).

    Multipliers are < 2^31 so every product stays below 2^63: no signed overflow anywhere.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x297A2D39) & MASK32
    x = x ^ (x >> 15)
    return x


def row_keys(seeds_B: torch.Tensor, steps_B: torch.Tensor) -> torch.Tensor:
    """Per-row 32-bit keys from (seed, step): int64 [B] -> int64 [B] in [0, 2^32)."""
    lo = seeds_B & MASK32
    hi = (seeds_B >> 32) & MASK32
    k = mix32(lo ^ SEED_SALT)
    k = mix32(k ^ hi)
    return mix32(k ^ (steps_B & MASK32))


def noise_bits(seeds_B: torch.Tensor, steps_B: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """24 hashed bits per (row, vocab index): int64 [B, V] in [0, 2^24), a pure function of (seed, step, index)."""
    keys_B = row_keys(seeds_B, steps_B)
    v_V = torch.arange(vocab_size, device=seeds_B.device, dtype=torch.int64)
    return mix32(keys_B[:, None] ^ mix32(v_V + VOCAB_SALT)[None, :]) >> (32 - NOISE_BITS)


def exponential_from_bits(k_BV: torch.Tensor) -> torch.Tensor:
    """``-log((k + 0.5) / 2^24)`` in float32 for int64 k in [0, 2^24), accurate to float32 rounding.

    Computed so that no u rounds to 1: ``(k + 0.5)`` needs 25 significant bits once k >= 2^23, and
    float32 has 24, so the naive ``-log(float(k) + 0.5) / 2^24)`` maps k = 2^24 - 1 to u = 1, e = 0 and
    a Gumbel of +inf: a uniformly random token forced at rate 2^-24 per vocab entry, 0.9% of all samples
    with Qwen3's 151,936-token vocabulary (found by comparing our samples with transformers' generate on the GPU:
    docs/log.md, 2026-12-04).
    The upper half uses ``w = 1 - u = (2^24 - 1 - k + 0.5) / 2^24`` (exact) and ``-log1p(-w)``, which
    is also accurate where e is small, i.e. in the large-Gumbel tail that decides unlikely tokens.
    """
    low_BV = k_BV < _HALF
    u_low_BV = (k_BV.to(torch.float32) + 0.5) * _SCALE  # exact for k < 2^23
    w_high_BV = (((1 << NOISE_BITS) - 1 - k_BV).to(torch.float32) + 0.5) * _SCALE  # exact for k >= 2^23
    return torch.where(low_BV, -torch.log(u_low_BV), -torch.log1p(-w_high_BV))


def gumbel_sample_reference(
    logits_BV: torch.Tensor, temperature_B: torch.Tensor, seeds_B: torch.Tensor, steps_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], logprobs float32 [B]); see the module docstring. ``logits_BV`` any float dtype."""
    greedy_B = temperature_B <= 0
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B)
    x_BV = logits_BV.float() / temp_B[:, None]
    gumbel_BV = -torch.log(exponential_from_bits(noise_bits(seeds_B, steps_B, x_BV.shape[-1])))
    tokens_B = torch.where(greedy_B, torch.argmax(x_BV, dim=-1), torch.argmax(x_BV + gumbel_BV, dim=-1))
    logprobs_B = torch.log_softmax(x_BV, dim=-1).gather(1, tokens_B[:, None]).squeeze(1)
    return tokens_B, logprobs_B


def gumbel_sample_lm_head_reference(
    hidden_BD: torch.Tensor,
    weight_VD: torch.Tensor,
    temperature_B: torch.Tensor,
    seeds_B: torch.Tensor,
    steps_B: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gumbel_sample_reference`` of the fp32 logits ``hidden_BD @ weight_VD.T`` (bf16 products are exact in fp32)."""
    logits_BV = hidden_BD.float() @ weight_VD.float().T
    return gumbel_sample_reference(logits_BV, temperature_B, seeds_B, steps_B)
