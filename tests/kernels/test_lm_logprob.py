"""Fused LM-head logprob + entropy: Triton (interpreter on CPU, compiled on CUDA: the `device` fixture)
vs the reference.

Shapes stay tiny (N <= 37, H <= 64, V <= 300) so the interpreter keeps the file well under a minute;
real shapes in bf16 are in tests/gpu/test_lm_head_real_shapes.py.
Every Triton output and scratch buffer is NaN-poisoned through `kernel._empty`, so an element the
kernels forget to write fails the comparison.
"""

import pytest
import torch
from prime_spmd.kernels.lm_logprob import kernel
from prime_spmd.kernels.lm_logprob.op import lm_head_logprobs, lm_logprob_bwd, lm_logprob_fwd

from tests.kernels._helpers import (
    lm_head_config_fits,
    lm_head_shared_memory,
    make_lm_head_inputs,
    max_shared_memory,
    nan_empty,
    pin_one_config,
    rel_err,
)

# Errors are max |got - want| / max |want|, measured over seeds 0-2 of these cases.
# fp32: measured <= 4.4e-6 (logprob, entropy, d hidden, d weight).
FP32_TOL = 1e-4
# bf16 forward: logits accumulate in fp32 from exact bf16 products, measured <= 1.5e-6.
BF16_FWD_TOL = 1e-4
# bf16 backward: d logits is stored in bf16 and the grads are bf16 (as are the reference's); measured <= 8.2e-3.
BF16_BWD_TOL = 1.5e-2


@pytest.fixture(autouse=True)
def poison_buffers_and_pin_config(monkeypatch, request):
    # On CUDA only configs whose fp32 tiles fit in shared memory: a pinned config must launch (_helpers.py).
    pin_one_config(monkeypatch, (kernel._fwd_tuned, kernel._grad_tuned), request.node.nodeid, lm_head_config_fits)
    monkeypatch.setattr(kernel, "_empty", nan_empty)


def make_inputs(num_tokens, hidden_size, vocab, dtype, temperature, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden, weight, targets, temperature = make_lm_head_inputs(
        num_tokens, hidden_size, vocab, dtype, temperature, gen, device
    )
    grad_lp = torch.randn(num_tokens, generator=gen).to(device)
    grad_ent = torch.randn(num_tokens, generator=gen).to(device)
    return hidden, weight, targets, temperature, grad_lp, grad_ent


def run_impl(impl, hidden, weight, targets, temperature, grad_lp, grad_ent, with_entropy=True):
    logprob, entropy = lm_head_logprobs(hidden, weight, targets, temperature, impl=impl, return_entropy=with_entropy)
    loss = (logprob * grad_lp).sum() + ((entropy * grad_ent).sum() if with_entropy else 0.0)
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    return logprob, entropy, grad_hidden, grad_weight


def assert_close(got, want, fwd_tol, bwd_tol):
    for name, g, w, tol in zip(
        ("logprob", "entropy", "d hidden", "d weight"), got, want, (fwd_tol,) * 2 + (bwd_tol,) * 2
    ):
        if w is None:
            assert g is None
            continue
        assert torch.isfinite(g).all(), f"{name} has NaN/inf (unwritten element?)"
        assert g.dtype == w.dtype, name
        assert rel_err(g, w) < tol, f"{name}: rel err {rel_err(g, w):.2e} >= {tol}"


CASES = [
    # (N, H, V, dtype, temperature): ragged N, H and V not multiples of the blocks (16, 32, 32 on CPU).
    (37, 40, 300, torch.float32, 1.0),
    (16, 64, 257, torch.float32, 0.7),
    (33, 32, 300, torch.float32, "per_token"),
    (1, 48, 65, torch.float32, 1.3),
    (37, 64, 300, torch.bfloat16, "per_token"),
]


@pytest.mark.parametrize("num_tokens,hidden_size,vocab,dtype,temperature", CASES)
def test_triton_matches_reference(num_tokens, hidden_size, vocab, dtype, temperature, device):
    inputs = make_inputs(num_tokens, hidden_size, vocab, dtype, temperature, device)
    want = run_impl("reference", *inputs)
    got = run_impl("triton", *inputs)
    if dtype == torch.float32:
        assert_close(got, want, FP32_TOL, FP32_TOL)
    else:
        assert_close(got, want, BF16_FWD_TOL, BF16_BWD_TOL)


def test_triton_logprob_only_and_chunked_backward(monkeypatch, device):
    """No entropy grad (HAS_GENT off) and a backward split in 3 token chunks with a ragged last one."""
    num_tokens, vocab = 37, 300
    monkeypatch.setattr(kernel, "GRAD_BUFFER_ELEMENTS", 16 * vocab)
    inputs = make_inputs(num_tokens, 64, vocab, torch.float32, "per_token", device, seed=1)
    want = run_impl("reference", *inputs, with_entropy=False)
    got = run_impl("triton", *inputs, with_entropy=False)
    assert_close(got, want, FP32_TOL, FP32_TOL)


def test_triton_tied_embedding(device):
    """The LM head is the embedding table: gradients from both uses add up in one tensor."""
    gen = torch.Generator().manual_seed(2)
    vocab, hidden_size, num_tokens = 97, 32, 21
    table = (torch.randn(vocab, hidden_size, generator=gen) * 0.5).to(device).requires_grad_()
    ids = torch.randint(0, vocab, (num_tokens,), generator=gen).to(device)
    targets = torch.roll(ids, -1)
    grads = {}
    for impl in ("reference", "triton"):
        hidden = torch.tanh(table[ids] * 1.5)
        logprob, entropy = lm_head_logprobs(hidden, table, targets, 0.9, impl=impl)
        grads[impl] = torch.autograd.grad(logprob.sum() - 0.1 * entropy.sum(), table)[0]
    assert rel_err(grads["triton"], grads["reference"]) < FP32_TOL


def test_opcheck(device):
    hidden, weight, targets, _, grad_lp, grad_ent = make_inputs(17, 32, 70, torch.float32, 1.0, device, seed=4)
    temperature_N = torch.full((17,), 0.8, device=device)
    torch.library.opcheck(lm_logprob_fwd, (hidden, weight, targets, temperature_N))
    _, entropy, lse = lm_logprob_fwd(hidden.detach(), weight.detach(), targets, temperature_N)
    bwd_args = (grad_lp, grad_ent, hidden.detach(), weight.detach(), targets, temperature_N, lse, entropy)
    torch.library.opcheck(lm_logprob_bwd, bwd_args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter runs one fixed config")
def test_unfit_configs_are_out_of_resources(monkeypatch, record_property):
    """The configs that pin_one_config leaves out on this GPU (fp32 tiles over the shared memory limit by
    lm_head_shared_memory's estimate) fail to launch with OutOfResources, on an fp32 case whose K loop
    is pipelined (D = 64, a multiple of every BLOCK_D): they are left out because they cannot run, not
    because they compute wrong values. Each config that does launch must match the reference."""
    from triton.runtime.errors import OutOfResources

    limit = max_shared_memory()
    unfit = [c for c in kernel._cuda_configs() if not lm_head_config_fits(c)]
    record_property("lm_head_unfit_configs", f"{len(unfit)} over {limit} B: {[str(c) for c in unfit]}")
    if not unfit:
        pytest.skip(f"every config fits in {limit} B of shared memory")
    inputs = make_inputs(16, 64, 257, torch.float32, 0.7, "cuda")
    want = run_impl("reference", *inputs)
    for config in unfit:
        monkeypatch.setattr(kernel._fwd_tuned, "configs", [config])
        monkeypatch.setattr(kernel._grad_tuned, "configs", [config])
        try:
            got = run_impl("triton", *inputs)
        except OutOfResources as e:
            record_property(f"unfit {config}", f"OutOfResources: {e}")
            continue
        assert_close(got, want, FP32_TOL, FP32_TOL)
        raise AssertionError(
            f"{config} launches and matches with {lm_head_shared_memory(config)} B estimated > {limit} B: "
            "the estimate in tests/kernels/_helpers.py is too conservative"
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter runs one fixed config, no tuner")
def test_token_counts_of_one_bucket_tune_once():
    """RL micro-batches change the token count every step: counts in one power-of-two bucket share the tuner's
    choice (the key holds T_BUCKET, not T); keyed on T the tuner re-ran every step (exact mode: 10x a step)."""
    for tuner in (kernel._fwd_tuned, kernel._grad_tuned):
        tuner.cache.clear()
    for num_tokens in (70, 100, 128):
        run_impl("triton", *make_inputs(num_tokens, 64, 257, torch.bfloat16, 1.0, "cuda"))
    assert len(kernel._fwd_tuned.cache) == 1 and len(kernel._grad_tuned.cache) == 1
    run_impl("triton", *make_inputs(129, 64, 257, torch.bfloat16, 1.0, "cuda"))
    assert len(kernel._fwd_tuned.cache) == 2 and len(kernel._grad_tuned.cache) == 2
    for num_tokens in (kernel.TUNE_BUCKET_CAP + 1, 3 * kernel.TUNE_BUCKET_CAP):  # past the cap: one key
        run_impl("triton", *make_inputs(num_tokens, 64, 257, torch.bfloat16, 1.0, "cuda"))
    assert len(kernel._fwd_tuned.cache) == 3 and len(kernel._grad_tuned.cache) == 3


def test_every_backward_chunk_tunes_under_the_calls_token_count(monkeypatch, device):
    """A backward split into chunks passes one T_BUCKET, the whole call's, to every chunk's launch: keyed on each
    chunk's own rows, a short last chunk met a new tuner key whenever a step's length moved it to another bucket
    (8dd7cf1, H100: exact mode's LM-head backward retuned inside timed steps)."""
    vocab, seen = 300, []
    monkeypatch.setattr(kernel, "GRAD_BUFFER_ELEMENTS", 16 * vocab)  # 16-row chunks: 37 tokens = 16 + 16 + 5

    class Recorder:  # stands in for the launcher (the interpreter's fixed config or CUDA's tuner)
        def __init__(self, real):
            self.real = real

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((args[9], args[12]))  # (rows, T_BUCKET)
                return self.real[grid](*args, **kwargs)

            return launch

    for name in ("_grad_logits_kernel", "_grad_tuned"):
        monkeypatch.setattr(kernel, name, Recorder(getattr(kernel, name)))
    inputs = make_inputs(37, 64, vocab, torch.float32, 1.0, device, seed=3)
    got = run_impl("triton", *inputs)
    assert seen == [(16, 64), (16, 64), (5, 64)]
    assert_close(got, run_impl("reference", *inputs), FP32_TOL, FP32_TOL)


def test_tuner_bucket():
    assert [kernel.t_bucket(n) for n in (1, 70, 128, 129, 1024, 1025, 5000)] == [1, 128, 128, 256, 1024, 1024, 1024]


def test_bad_inputs_raise(device):
    hidden, weight, targets, *_ = make_inputs(4, 32, 50, torch.float32, 1.0, device)
    with pytest.raises(ValueError, match="share a dtype"):
        lm_head_logprobs(hidden, weight.bfloat16(), targets, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        lm_head_logprobs(hidden, weight, targets, impl="fast")
    with pytest.raises(ValueError, match="temperature"):
        lm_head_logprobs(hidden, weight, targets, torch.ones(3, device=device))
