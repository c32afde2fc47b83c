"""The sampler on fixed logits: empirical frequencies, filters, logprobs, batch independence."""

from __future__ import annotations

import pytest
import torch

from prime_spmd.inference.sampling import SamplingTensors, exponential_from_bits, gumbel_noise, noise_bits, sample

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])
V = LOGITS.numel()
# chi-square critical value, df = 7, p = 0.001
CHI2_CRIT_DF7 = 24.32


def _st(n: int, *, t=1.0, k=0, p=1.0, min_p=0.0, seeds=None, steps=None) -> SamplingTensors:
    return SamplingTensors(
        temperature_B=torch.full((n,), t),
        top_k_B=torch.full((n,), k, dtype=torch.long),
        top_p_B=torch.full((n,), p),
        min_p_B=torch.full((n,), min_p),
        seeds_B=torch.arange(n, dtype=torch.long) if seeds is None else seeds,
        steps_B=torch.zeros(n, dtype=torch.long) if steps is None else steps,
        needs_sort=k > 0 or p < 1,
        needs_min_p=min_p > 0,
    )


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()


def test_frequencies_match_softmax_over_seeds_and_over_steps():
    n = 20000
    for t in (1.0, 0.6, 1.7):
        probs = torch.softmax(LOGITS / t, -1)
        tok, lp = sample(LOGITS.expand(n, V), _st(n, t=t))
        assert _chi2(tok, probs) < CHI2_CRIT_DF7, t
        assert torch.allclose(lp, probs.log()[tok], atol=1e-6)
        # one seed, successive steps: the noise stream along a completion is also unbiased
        seeds = torch.full((n,), 1234, dtype=torch.long)
        tok2, _ = sample(LOGITS.expand(n, V), _st(n, t=t, seeds=seeds, steps=torch.arange(n)))
        assert _chi2(tok2, probs) < CHI2_CRIT_DF7, t


def test_greedy_rows_take_the_argmax_and_report_raw_logprob():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    st = _st(2, t=0.0, k=2, p=0.5, min_p=0.5)
    tok, lp = sample(logits, st)
    assert tok.tolist() == [0, V - 1]
    assert torch.allclose(lp, torch.log_softmax(logits, -1)[torch.arange(2), tok])


def _check_filtered(st: SamplingTensors, allowed: list[int], t: float = 1.0) -> None:
    n = st.temperature_B.numel()
    tok, lp = sample(LOGITS.expand(n, V), st)
    x = torch.full((V,), float("-inf"))
    x[allowed] = LOGITS[allowed] / t
    probs = torch.softmax(x, -1)
    assert set(tok.tolist()) <= set(allowed)
    assert _chi2(tok, probs) < 3 * len(allowed) + 20
    assert torch.allclose(lp, probs.log()[tok], atol=1e-6)  # logprob under the renormalised distribution


def test_top_k_top_p_min_p():
    n = 8000
    _check_filtered(_st(n, k=3), [0, 1, 2])
    probs = torch.softmax(LOGITS, -1)  # 0.39, 0.24, 0.14, 0.07, ...
    cum = probs.cumsum(0)
    # top-p keeps the smallest prefix whose mass reaches p: mass before token 2 is 0.63 < 0.7
    assert cum[1] < 0.7 < cum[2]
    _check_filtered(_st(n, p=0.7), [0, 1, 2])
    # top-p is computed on the top-k renormalised distribution (k first)
    _check_filtered(_st(n, k=2, p=0.55), [0])
    # min-p: keep p_i >= 0.3 * p_max -> tokens 0, 1, 2 (0.14 / 0.39 = 0.37), not 3 (0.18)
    _check_filtered(_st(n, min_p=0.3), [0, 1, 2])
    _check_filtered(_st(n, t=0.5, k=4), [0, 1, 2, 3], t=0.5)


def test_mixed_parameters_per_row():
    st = SamplingTensors(
        temperature_B=torch.tensor([0.0, 1.0, 1.0]),
        top_k_B=torch.tensor([0, 1, 0]),
        top_p_B=torch.tensor([1.0, 1.0, 1.0]),
        min_p_B=torch.tensor([0.0, 0.0, 0.0]),
        seeds_B=torch.tensor([1, 2, 3]),
        steps_B=torch.tensor([0, 0, 0]),
        needs_sort=True,
    )
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    tok, lp = sample(logits, st)
    assert tok[:2].tolist() == [0, V - 1]
    assert abs(lp[1].item()) < 1e-6  # top-k 1 leaves one token: probability 1


def test_noise_depends_only_on_seed_step_and_vocab_index():
    seeds = torch.tensor([5, 2**40 + 3, 7, 5])
    steps = torch.tensor([0, 9, 3, 1])
    k = noise_bits(seeds, steps, 50)
    for i in range(4):
        assert torch.equal(k[i], noise_bits(seeds[i : i + 1], steps[i : i + 1], 50)[0])
    assert not torch.equal(k[0], k[3])  # same seed, next step: fresh noise
    big = noise_bits(torch.arange(64), torch.zeros(64, dtype=torch.long), 4096).double() / 2**24
    assert big.min() >= 0 and big.max() < 1
    assert abs(big.mean().item() - 0.5) < 0.005 and abs(big.var().item() - 1 / 12) < 0.002


def _devices_and_compile():
    out = [pytest.param("cpu", False, id="cpu")]
    if torch.cuda.is_available():  # the engine's path on CUDA: the sampler compiled by inductor (Triton's log/log1p)
        out.append(pytest.param("cuda", True, id="cuda-compiled"))
    return out


@pytest.mark.parametrize("device,compiled", _devices_and_compile())
def test_exponential_noise_is_exact_over_every_24_bit_value(device, compiled):
    """Every one of the 2^24 hashed values maps to -log(u) within float32 rounding, u never 1: the earlier
    ``(float(k) + 0.5) / 2^24`` rounded k = 2^24 - 1 to u = 1, a Gumbel of +inf, a forced random token at
    rate 2^-24 per vocab entry (0.9% of samples with a 151,936-token vocab)."""
    fn = torch.compile(exponential_from_bits, dynamic=True) if compiled else exponential_from_bits
    k = torch.arange(1 << 24, dtype=torch.int64, device=device)
    e = fn(k).double().cpu()
    ref = -torch.log((k.cpu().double() + 0.5) / 2**24)
    assert torch.isfinite(e).all() and (e > 0).all()
    rel = ((e - ref).abs() / ref).max().item()
    assert rel < 2e-6, rel  # a few float32 ulps, also at the top of the range (e ~ 3e-8, the Gumbel tail)


def test_gumbel_noise_is_finite_at_a_real_vocab_size():
    g = gumbel_noise(torch.arange(256), torch.zeros(256, dtype=torch.long), 151_936)
    assert torch.isfinite(g).all()
    assert -2.9 < g.min().item() and g.max().item() < 17.4


def test_sampler_names_resolve_by_device():
    """``auto`` is the fused kernel sampler on CUDA and torch elsewhere; an unknown name is a ValueError naming it,
    also through ``make_sampler``."""
    from prime_spmd.inference.sampling import make_sampler, resolve_sampler, sample_flat

    assert resolve_sampler("auto", torch.device("cuda")) == "triton_lm_head"
    assert resolve_sampler("auto", torch.device("cpu")) == "torch"
    assert resolve_sampler("triton", torch.device("cpu")) == "triton"
    assert make_sampler("auto", compile_torch=False) is sample_flat
    for bad in (lambda: resolve_sampler("gumbel", torch.device("cpu")), lambda: make_sampler("gumbel", False)):
        with pytest.raises(ValueError, match="'gumbel'"):
            bad()
