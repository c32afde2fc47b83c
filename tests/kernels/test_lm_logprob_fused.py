"""Loss-fused LM head (`fused_lm_head_loss`): torch and Triton (interpreter on CPU, compiled on CUDA: the
`device` fixture) vs autograd through the reference, for SFT- and DPPO-style per-token losses (with an
entropy term), fp32 and bf16.

Shapes stay tiny (N <= 37, H <= 64, V <= 300) so the interpreter keeps the file well under a minute;
real shapes in bf16 are in tests/gpu/test_lm_head_real_shapes.py.
Every output and scratch buffer of the fused path is NaN-poisoned through `fused_kernel.empty_buffer`, so
an element a chunk or a kernel forgets to write fails the comparison.
"""

import pytest
import torch
from prime_spmd.kernels.lm_logprob import fused_kernel, fused_loss
from prime_spmd.kernels.lm_logprob.fused_loss import fused_lm_head_loss, num_chunk_tokens
from prime_spmd.kernels.lm_logprob.reference import reference_logprobs, temperature_per_token

from tests.kernels._helpers import make_lm_head_inputs, nan_empty, pin_one_config, rel_err

# Errors are max |got - want| / max |want| (loss, lp, ent, d hidden, d weight), measured over seeds 0-2
# of CASES, both impls.
# fp32: measured <= 1.9e-5 (torch impl, grads), <= 5.9e-6 (triton); entropy is lse - E_p[z], not -sum p log p.
FP32_TOL = 1e-4
# bf16 loss, lp, ent: logits come from exact bf16 products accumulated in fp32; measured <= 7.4e-6.
BF16_FWD_TOL = 1e-4
# bf16 grads: d logits is rounded to bf16 before the gradient GEMMs, d weight is accumulated in bf16
# across chunks, and both grads are bf16 (as are the reference's); measured <= 6.7e-3 (d hidden) and
# <= 1.1e-2 (d weight, triton; 5.8e-3 torch).
BF16_BWD_TOL = 2e-2


@pytest.fixture(autouse=True)
def poison_buffers_and_pin_config(monkeypatch, request):
    pin_one_config(monkeypatch, (fused_kernel._stats_tuned, fused_kernel._grad_tuned), request.node.nodeid)
    monkeypatch.setattr(fused_kernel, "empty_buffer", nan_empty)


def sft_loss(lp, ent, fields):
    return -lp * fields["mask"]


def dppo_loss(lp, ent, fields):
    """DPPO-style: -A r keep + c (log r)^2 with keep from the detached ratio, plus an entropy bonus."""
    log_r = torch.clamp(lp - fields["inf_lp"], -10.0, 10.0)
    delta = torch.exp(lp.detach()) - torch.exp(fields["inf_lp"])
    keep = ~(((fields["adv"] > 0) & (delta > 0.2)) | ((fields["adv"] < 0) & (delta < -0.2)))
    return (-fields["adv"] * torch.exp(log_r) * keep + 0.05 * log_r.pow(2) - 0.01 * ent) * fields["mask"]


def entropy_loss(lp, ent, fields):
    return -ent  # no logprob term: the Triton grad kernel runs with HAS_GLP off


LOSSES = {"sft": sft_loss, "dppo": dppo_loss, "entropy": entropy_loss}


def make_inputs(num_tokens, hidden_size, vocab, dtype, temperature, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden, weight, targets, temperature = make_lm_head_inputs(
        num_tokens, hidden_size, vocab, dtype, temperature, gen, device
    )
    fields = {
        "mask": (torch.rand(num_tokens, generator=gen) > 0.2).float().to(device),
        "adv": torch.randn(num_tokens, generator=gen).to(device),
    }
    with torch.no_grad():  # near the trainer's logprobs, so some tokens are kept and some masked by DPPO
        temperature_N = temperature_per_token(temperature, num_tokens, hidden.device)
        lp, _ = reference_logprobs(hidden, weight, targets, temperature_N)
        fields["inf_lp"] = lp + 0.3 * torch.randn(num_tokens, generator=gen).to(device)
    return hidden, weight, targets, temperature, fields


def run_reference(loss_name, hidden, weight, targets, temperature, fields, grad_scale):
    temperature_N = temperature_per_token(temperature, hidden.shape[0], hidden.device)
    lp, ent = reference_logprobs(hidden, weight, targets, temperature_N)
    loss = LOSSES[loss_name](lp, ent, fields).sum()
    return (loss, lp, ent, *torch.autograd.grad(loss * grad_scale, (hidden, weight)))


def run_fused(impl, loss_name, hidden, weight, targets, temperature, fields, grad_scale, chunk_tokens):
    loss, lp, ent = fused_lm_head_loss(
        hidden, weight, targets, temperature, LOSSES[loss_name], fields, chunk_tokens=chunk_tokens, impl=impl
    )
    assert not lp.requires_grad and not ent.requires_grad
    return (loss, lp, ent, *torch.autograd.grad(loss * grad_scale, (hidden, weight)))


def assert_close(got, want, fwd_tol, bwd_tol):
    names = ("loss", "logprob", "entropy", "d hidden", "d weight")
    for name, g, w, tol in zip(names, got, want, (fwd_tol,) * 3 + (bwd_tol,) * 2):
        assert torch.isfinite(g).all(), f"{name} has NaN/inf (unwritten element?)"
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert rel_err(g, w) < tol, f"{name}: rel err {rel_err(g, w):.2e} >= {tol}"


CASES = [
    # (loss, N, H, V, dtype, temperature, chunk_tokens): ragged N and V (CPU tiles 4 x 64, slices of 128),
    # several chunks with a ragged last one, scalar and per-token temperature.
    ("sft", 37, 40, 300, torch.float32, 1.0, 16),
    ("dppo", 33, 32, 257, torch.float32, "per_token", 8),
    ("entropy", 21, 48, 130, torch.float32, 0.7, 4096),
    ("dppo", 1, 32, 65, torch.float32, 1.3, 4096),
    ("sft", 37, 64, 300, torch.bfloat16, 0.8, 16),
    ("dppo", 37, 64, 300, torch.bfloat16, "per_token", 12),
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("loss_name,num_tokens,hidden_size,vocab,dtype,temperature,chunk_tokens", CASES)
def test_fused_matches_reference(
    impl, loss_name, num_tokens, hidden_size, vocab, dtype, temperature, chunk_tokens, device
):
    inputs = make_inputs(num_tokens, hidden_size, vocab, dtype, temperature, device)
    want = run_reference(loss_name, *inputs, grad_scale=0.5)
    got = run_fused(impl, loss_name, *inputs, grad_scale=0.5, chunk_tokens=chunk_tokens)
    if dtype == torch.float32:
        assert_close(got, want, FP32_TOL, FP32_TOL)
    else:
        assert_close(got, want, BF16_FWD_TOL, BF16_BWD_TOL)


def test_chunk_budget_and_balance(monkeypatch, device):
    """The C * V budget caps the chunk; chunks are balanced and 128-aligned when large."""
    assert num_chunk_tokens(16384, 151936, 4096) == 3328  # 5 chunks under the 2**29 cap (3456)
    assert num_chunk_tokens(16384, 151936, 4096, budget=fused_loss.TRITON_LOGITS_BUFFER_ELEMENTS) == 4096
    assert num_chunk_tokens(4096, 1000, 4096) == 4096
    assert num_chunk_tokens(5000, 1000, 4096) == 2560
    assert num_chunk_tokens(37, 300, 4096, budget=3000) == 10  # 4 chunks: 10, 10, 10, 7
    assert num_chunk_tokens(3, 10**9, 4096) == 1  # V above the budget still runs, one token at a time
    monkeypatch.setattr(fused_loss, "LOGITS_BUFFER_ELEMENTS", 5 * 300)
    inputs = make_inputs(37, 32, 300, torch.float32, 1.0, device, seed=1)
    want = run_reference("dppo", *inputs, grad_scale=1.0)
    got = run_fused("torch", "dppo", *inputs, grad_scale=1.0, chunk_tokens=4096)
    assert_close(got, want, FP32_TOL, FP32_TOL)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_no_grad_and_frozen_weight(impl, device):
    """Under no_grad only the forward GEMM runs; a frozen weight gets no gradient, hidden still does."""
    hidden, weight, targets, temperature, fields = make_inputs(19, 32, 130, torch.float32, 0.9, device, seed=2)
    want = run_reference("dppo", hidden, weight, targets, temperature, fields, grad_scale=1.0)
    with torch.no_grad():
        loss, lp, ent = fused_lm_head_loss(hidden, weight, targets, temperature, dppo_loss, fields, impl=impl)
    assert not loss.requires_grad
    assert_close((loss, lp, ent), want[:3], FP32_TOL, FP32_TOL)
    weight.requires_grad_(False)
    loss, _, _ = fused_lm_head_loss(hidden, weight, targets, temperature, dppo_loss, fields, impl=impl)
    loss.backward()
    assert weight.grad is None
    assert rel_err(hidden.grad, want[3]) < FP32_TOL


def test_tied_embedding_and_second_backward(device):
    """Gradients from the embedding lookup and the fused head add up; a second backward raises."""
    gen = torch.Generator().manual_seed(3)
    vocab, hidden_size, num_tokens = 97, 32, 21
    table = (torch.randn(vocab, hidden_size, generator=gen) * 0.5).to(device).requires_grad_()
    ids = torch.randint(0, vocab, (num_tokens,), generator=gen).to(device)
    fields = {"mask": torch.ones(num_tokens, device=device)}
    hidden = torch.tanh(table[ids] * 1.5)
    lp, ent = reference_logprobs(hidden, table, torch.roll(ids, -1), torch.full((num_tokens,), 0.9, device=device))
    want = torch.autograd.grad(sft_loss(lp, ent, fields).sum(), table)[0]
    hidden = torch.tanh(table[ids] * 1.5)
    loss, _, _ = fused_lm_head_loss(hidden, table, torch.roll(ids, -1), 0.9, sft_loss, fields, chunk_tokens=8)
    got = torch.autograd.grad(loss, table, retain_graph=True)[0]
    assert rel_err(got, want) < FP32_TOL
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_bad_inputs_raise(device):
    hidden, weight, targets, _, fields = make_inputs(4, 32, 50, torch.float32, 1.0, device)
    with pytest.raises(ValueError, match="share a dtype"):
        fused_lm_head_loss(hidden, weight.bfloat16(), targets, 1.0, sft_loss, fields)
    with pytest.raises(ValueError, match="impl"):
        fused_lm_head_loss(hidden, weight, targets, 1.0, sft_loss, fields, impl="fast")
    with pytest.raises(ValueError, match="field 'mask'"):
        fused_lm_head_loss(hidden, weight, targets, 1.0, sft_loss, {"mask": torch.ones(3, device=device)})
    with pytest.raises(ValueError, match="token_loss must return"):
        fused_lm_head_loss(hidden, weight, targets, 1.0, lambda lp, ent, f: lp.sum(), fields)
