"""LM head at real shapes in bf16 on CUDA: the Triton logprob kernel (`lm_head_logprobs`, impl triton) and
the loss-fused head (`fused_lm_head_loss`, impls triton and torch) against the fp32 reference
(`reference_logprobs` upcasts the bf16 inputs, so its products are exact), forward and both grads.

Qwen3 vocabulary (151,936), hidden 1024 and 4096, a few thousand tokens. Inputs are drawn on the GPU
with the scale of a trained head (logits std ~2), not the tiny tests' N(0, 0.25) weights, whose logits
at H = 4096 would have std 32. Each case records its measured errors as junit properties (`rel_err_*`).
Tiny shapes, fp32 and the interpreter: tests/kernels/test_lm_logprob*.py.
"""

from __future__ import annotations

import pytest
import torch
from prime_spmd.kernels.lm_logprob.fused_loss import fused_lm_head_loss
from prime_spmd.kernels.lm_logprob.op import lm_head_logprobs
from prime_spmd.kernels.lm_logprob.reference import reference_logprobs, temperature_per_token

from tests.kernels._helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 151_936
# Errors are max |got - want| / max |want| vs the fp32 reference, measured on the H200 (scripts/test_gpu.sh
# run 1, seed 0, all cases of this file): logprob <= 3.5e-6, entropy <= 1.3e-5, fused loss <= 9.3e-8
# (forward: fp32 accumulation of exact bf16 products); d hidden <= 4.7e-3, d weight <= 6.5e-3 (d logits
# and the grads are rounded to bf16). About 4x the largest of each group:
FWD_TOL = 5e-5
BWD_TOL = 2.5e-2
SHAPES = [(4096, 1024), (2048, 4096)]  # (tokens N, hidden H)


def _inputs(num_tokens: int, hidden_size: int, seed: int = 0):
    """bf16 hidden [N, H] ~ N(0, 1) (a normed hidden state) and weight [V, H] with logits std ~2,
    targets [N] (both vocabulary edges included), per-token temperature in [0.5, 1.5), and upstream
    grads for logprob and entropy; all on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"device": "cuda", "generator": gen}
    hidden = torch.randn(num_tokens, hidden_size, **kw).bfloat16().requires_grad_()
    weight = (torch.randn(VOCAB, hidden_size, **kw) * (2.0 / hidden_size**0.5)).bfloat16().requires_grad_()
    targets = torch.randint(0, VOCAB, (num_tokens,), **kw)
    targets[0], targets[-1] = 0, VOCAB - 1
    temperature = torch.rand(num_tokens, **kw) + 0.5
    return hidden, weight, targets, temperature, torch.randn(num_tokens, **kw), torch.randn(num_tokens, **kw)


def _check(names, got, want, tols, record_property, prefix: str) -> None:
    for name, g, w, tol in zip(names, got, want, tols):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.isfinite(g).all(), f"{prefix} {name} has NaN/inf"
        err = rel_err(g, w)
        record_property(f"rel_err_{prefix}_{name}", f"{err:.3e}")
        print(f"{prefix} {name}: rel err {err:.3e} (tol {tol})")
        assert err < tol, f"{prefix} {name}: rel err {err:.2e} >= {tol}"


@pytest.mark.parametrize("num_tokens,hidden_size", SHAPES)
def test_triton_logprobs_real_shapes(num_tokens, hidden_size, record_property):
    hidden, weight, targets, temperature, grad_lp, grad_ent = _inputs(num_tokens, hidden_size)
    results = {}
    for impl in ("reference", "triton"):
        lp, ent = lm_head_logprobs(hidden, weight, targets, temperature, impl=impl)
        loss = (lp * grad_lp).sum() + (ent * grad_ent).sum()
        results[impl] = (lp.detach(), ent.detach(), *torch.autograd.grad(loss, (hidden, weight)))
        del lp, ent, loss
        torch.cuda.empty_cache()
    names = ("logprob", "entropy", "d_hidden", "d_weight")
    tols = (FWD_TOL, FWD_TOL, BWD_TOL, BWD_TOL)
    _check(
        names, results["triton"], results["reference"], tols, record_property, f"triton_N{num_tokens}_H{hidden_size}"
    )


def _dppo_loss(lp, ent, fields):
    """The DPPO-style token loss of tests/kernels/test_lm_logprob_fused.py (entropy bonus included)."""
    log_r = torch.clamp(lp - fields["inf_lp"], -10.0, 10.0)
    delta = torch.exp(lp.detach()) - torch.exp(fields["inf_lp"])
    keep = ~(((fields["adv"] > 0) & (delta > 0.2)) | ((fields["adv"] < 0) & (delta < -0.2)))
    return (-fields["adv"] * torch.exp(log_r) * keep + 0.05 * log_r.pow(2) - 0.01 * ent) * fields["mask"]


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_fused_loss_real_shape(impl, record_property):
    num_tokens, hidden_size = 4096, 2048
    hidden, weight, targets, temperature, adv, noise = _inputs(num_tokens, hidden_size, seed=1)
    temperature_N = temperature_per_token(temperature, num_tokens, hidden.device)
    lp, ent = reference_logprobs(hidden, weight, targets, temperature_N)
    fields = {"mask": (noise > -1.0).float(), "adv": adv, "inf_lp": (lp + 0.3 * noise).detach()}
    token_loss = _dppo_loss(lp, ent, fields)
    loss = token_loss.sum()
    # the loss sum cancels (both advantage signs): its error is taken relative to sum |token loss|
    loss_scale = token_loss.detach().abs().sum()
    want = (lp.detach(), ent.detach(), *torch.autograd.grad(loss, (hidden, weight)))
    want_loss = loss.detach()
    del lp, ent, token_loss, loss
    torch.cuda.empty_cache()
    got_loss, got_lp, got_ent = fused_lm_head_loss(hidden, weight, targets, temperature, _dppo_loss, fields, impl=impl)
    got = (got_lp, got_ent, *torch.autograd.grad(got_loss, (hidden, weight)))
    loss_err = ((got_loss - want_loss).abs() / loss_scale).item()
    record_property(f"rel_err_fused_{impl}_loss", f"{loss_err:.3e}")
    print(f"fused {impl} loss: err / sum|token loss| {loss_err:.3e} (tol {FWD_TOL})")
    assert loss_err < FWD_TOL, loss_err
    names = ("logprob", "entropy", "d_hidden", "d_weight")
    _check(names, got, want, (FWD_TOL, FWD_TOL, BWD_TOL, BWD_TOL), record_property, f"fused_{impl}")
