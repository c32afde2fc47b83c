"""kernels/batch_invariant against its PyTorch reference (forward to rounding, backward to rounding), and the property
the kernels exist for: a row's output is bit-identical whether it is computed alone, inside a larger batch, at another
position of the batch, or (attention) as a decode query against a cache instead of inside a prefill.

Device-aware (``device`` fixture): CUDA compiles the kernels, CPU runs them under TRITON_INTERPRET=1. Inputs are drawn
on the CPU from a seeded generator.
"""

from __future__ import annotations

import pytest
import torch
from prime_spmd.kernels.batch_invariant import op
from prime_spmd.kernels.batch_invariant import reference as ref

DTYPES = [torch.float32, torch.bfloat16]
# max |kernel - reference| / max |reference| measured over these cases (CPU interpreter, 2026-12-06): fp32 3.3e-7
# (matmul), 1.1e-7 (norm), 3e-8 (SiLU-gate), 1.9e-7 (attention); bf16 6.5e-3, 1.5e-2, 8.1e-3, 5.8e-3: the bf16 output
# roundings (ulp 2^-8 = 3.9e-3 relative), where the kernel's fp32 value lands on the other side of a rounding boundary
# than the reference's (the norm rounds twice: its 1/sqrt is not torch's rsqrt)
RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _rand(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (70, 96, 130), (129, 200, 257)])
def test_linear(device, dtype, m, k, n):
    gen = torch.Generator().manual_seed(m * k + n)
    x, w, b = _rand(gen, m, k, dtype=dtype, device=device), _rand(gen, n, k, dtype=dtype, device=device), None
    if n == 130:
        b = _rand(gen, n, dtype=dtype, device=device)
    y = op.linear(x, w, b)
    assert y.dtype == dtype and _rel(y, ref.linear_reference(x, w, b)) < RTOL[dtype]
    y32 = op.linear(x, w, b, torch.float32)
    assert y32.dtype == torch.float32 and _rel(y32, ref.linear_reference(x, w, b, torch.float32)) < RTOL[torch.float32]
    # batch invariance: each of a few rows alone, and the batch reversed, give the same bits
    for i in {0, m // 2, m - 1}:
        assert torch.equal(op.linear(x[i : i + 1], w, b), y[i : i + 1])
    assert torch.equal(op.linear(x.flip(0), w, b), y.flip(0))
    r = _rand(gen, m, n, dtype=dtype, device=device)
    fused = op.linear(x, w, b, residual=r)
    if dtype == torch.float32 or device.type == "cuda":
        assert torch.equal(fused, r + y)  # the fused residual rounds as torch's add
    else:  # the interpreter rounds fp32 -> bf16 toward zero (triton 3.9 interpreter.py _convert_float), torch to even
        assert _rel(fused, r + y) < RTOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_backward(device, dtype):
    gen = torch.Generator().manual_seed(1)
    x = _rand(gen, 9, 48, dtype=dtype, device=device).requires_grad_()
    w = _rand(gen, 40, 48, dtype=dtype, device=device).requires_grad_()
    b = _rand(gen, 40, dtype=dtype, device=device).requires_grad_()
    r = _rand(gen, 9, 40, dtype=dtype, device=device).requires_grad_()
    g = _rand(gen, 9, 40, dtype=dtype, device=device)
    got = torch.autograd.grad(op.linear(x, w, b, residual=r), (x, w, b, r), g)
    want = torch.autograd.grad(r + ref.linear_reference(x, w, b), (x, w, b, r), g)
    for a, e in zip(got, want):
        assert _rel(a, e) < RTOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,ns", [(1, (96, 40, 40)), (70, (130, 64)), (129, (257, 65, 1))])
def test_linear_segments_equal_separate_linears(device, dtype, m, ns):
    """One launch for q/k/v or gate/up: each output is ``linear``'s, bit for bit, at any row count; gradients as
    torch's."""
    gen = torch.Generator().manual_seed(m + sum(ns))
    x = _rand(gen, m, 96, dtype=dtype, device=device)
    ws = [_rand(gen, n, 96, dtype=dtype, device=device) for n in ns]
    got = op.linear_segments(x, *ws)
    for y, w in zip(got, ws, strict=True):
        assert y.shape == (m, w.shape[0]) and torch.equal(y, op.linear(x, w))
    assert all(torch.equal(a[-1:], b) for a, b in zip(got, op.linear_segments(x[-1:], *ws)))  # a row alone
    xg = x.detach().requires_grad_()
    wg = [w.detach().requires_grad_() for w in ws]
    gs = [_rand(gen, m, w.shape[0], dtype=dtype, device=device) for w in ws]
    got = torch.autograd.grad(op.linear_segments(xg, *wg), (xg, *wg), gs)
    want = torch.autograd.grad([ref.linear_reference(xg, w) for w in wg], (xg, *wg), gs)
    for a, e in zip(got, want, strict=True):
        assert _rel(a, e) < RTOL[dtype]
    with pytest.raises(ValueError, match="linear_segments: 2 or 3 weights"):
        op.linear_segments(x, ws[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 16), (37, 24), (300, 64), (5, 1024)])
def test_rms_norm(device, dtype, rows, d):
    gen = torch.Generator().manual_seed(rows + d)
    x, w = _rand(gen, rows, d, dtype=dtype, device=device, scale=3.0), _rand(gen, d, dtype=dtype, device=device)
    y = op.rms_norm(x, w, 1e-6)
    assert _rel(y, ref.rms_norm_reference(x, w, 1e-6)) < RTOL[dtype]
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(op.rms_norm(x[i : i + 1], w, 1e-6), y[i : i + 1])
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    g = _rand(gen, rows, d, dtype=dtype, device=device)
    got = torch.autograd.grad(op.rms_norm(xg, wg, 1e-6), (xg, wg), g)
    want = torch.autograd.grad(ref.rms_norm_reference(xg, wg, 1e-6), (xg, wg), g)
    for a, e in zip(got, want):
        assert _rel(a, e) < 1e-5 if dtype == torch.float32 else _rel(a, e) < 5e-2  # bf16 grads: the same ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(device, dtype):
    gen = torch.Generator().manual_seed(2)
    g, u = _rand(gen, 33, 300, dtype=dtype, device=device, scale=4.0), _rand(gen, 33, 300, dtype=dtype, device=device)
    y = op.silu_mul(g, u)
    assert _rel(y, ref.silu_mul_reference(g, u)) < RTOL[dtype]
    assert torch.equal(op.silu_mul(g[7:8], u[7:8]), y[7:8])
    gg, ug = g.detach().requires_grad_(), u.detach().requires_grad_()
    d = _rand(gen, 33, 300, dtype=dtype, device=device)
    got = torch.autograd.grad(op.silu_mul(gg, ug), (gg, ug), d)
    want = torch.autograd.grad(ref.silu_mul_reference(gg, ug), (gg, ug), d)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and _rel(a, e) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,nkv,dh", [(4, 2, 16), (4, 1, 24), (8, 8, 32)])
def test_attention_prefill_and_decode(device, dtype, n, nkv, dh):
    """Rows of different lengths as right-padded [B, T] (the trainer's and the prefill's case), then every query again
    as a decode step (one token at its position against the row's K/V, as the engine's cache holds them), alone or with
    the other rows: the same bits."""
    gen = torch.Generator().manual_seed(n * dh)
    B, T = 3, 80  # T spans two KV blocks
    q = _rand(gen, B, T, n, dh, dtype=dtype, device=device)
    k, v = (_rand(gen, B, T, nkv, dh, dtype=dtype, device=device) for _ in range(2))
    start = torch.zeros(B, dtype=torch.long, device=device)
    scale = dh**-0.5
    out = op.attention(q, k.transpose(1, 2), v.transpose(1, 2), start, scale)
    want = ref.attention_reference(q, k.transpose(1, 2), v.transpose(1, 2), start, scale)
    assert _rel(out, want) < RTOL[dtype]
    cache_k = k.transpose(1, 2).contiguous()  # [B, Nkv, T, Dh]: a slot cache's layout
    cache_v = v.transpose(1, 2).contiguous()
    for pos in (0, 15, 16, 63, 64, T - 1):
        pos_B = torch.full((B,), pos, dtype=torch.long, device=device)
        pos_B[1] = max(0, pos - 5)  # rows at different positions in one step
        dec = op.attention(q[torch.arange(B), pos_B][:, None], cache_k, cache_v, pos_B, scale)  # [B, 1, N, Dh]
        for b in range(B):
            assert torch.equal(dec[b, 0], out[b, pos_B[b]]), (pos, b)
        alone = op.attention(q[1:2, pos_B[1] : pos_B[1] + 1], cache_k[1:2], cache_v[1:2], pos_B[1:2], scale)
        assert torch.equal(alone[0, 0], out[1, pos_B[1]])
    # backward (training rows: start 0) recomputes torch's SDPA
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k.transpose(1, 2), v.transpose(1, 2)))
    g = _rand(gen, B, T, n, dh, dtype=dtype, device=device)
    got = torch.autograd.grad(op.attention(qg, kg, vg, start, scale), (qg, kg, vg), g)
    want = torch.autograd.grad(ref.attention_reference(qg, kg, vg, start, scale), (qg, kg, vg), g)
    for a, e in zip(got, want):
        assert _rel(a, e) < (1e-4 if dtype == torch.float32 else 5e-2)


class _NoHostRead(torch.Tensor):
    """A tensor whose value the host must not read (a read waits for the GPU): any() / item() / bool() raise."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.any, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist):
            raise AssertionError(f"the host read start_B: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("from_zero", [True, False])
def test_attention_backward_reads_no_start_on_the_host(device, from_zero):
    """The backward picks SDPA's causal path from the caller's ``from_zero``, the mask path otherwise, never from
    start_B's values (a host read is a GPU sync a layer); both paths give the reference gradient, rows from position 0
    or past it (the mask path)."""
    gen = torch.Generator().manual_seed(11)
    B, T, n, nkv, dh = 2, 40, 4, 2, 16
    q = _rand(gen, B, T, n, dh, dtype=torch.float32, device=device)
    k, v = (_rand(gen, B, nkv, T, dh, dtype=torch.float32, device=device) for _ in range(2))
    g = _rand(gen, B, T, n, dh, dtype=torch.float32, device=device)
    starts = [torch.zeros(B, dtype=torch.long, device=device)]
    if not from_zero:  # suffix rows: queries at positions start + t against T keys
        starts.append(torch.tensor([0, 7], device=device))
    for start in starts:
        tq = T if not start.any() else T - 7
        qg, kg, vg = (t.detach().requires_grad_() for t in (q[:, :tq], k, v))
        out = op.attention(qg, kg, vg, start.as_subclass(_NoHostRead), 0.25, from_zero=from_zero)
        got = [t.as_subclass(torch.Tensor) for t in torch.autograd.grad(out, (qg, kg, vg), g[:, :tq])]
        want = torch.autograd.grad(ref.attention_reference(qg, kg, vg, start, 0.25), (qg, kg, vg), g[:, :tq])
        for a, e in zip(got, want):
            assert _rel(a, e) < 1e-4


def test_logprobs(device):
    gen = torch.Generator().manual_seed(3)
    R, V = 7, 5000  # V spans several vocab chunks and ends inside one
    logits = _rand(gen, R, V, dtype=torch.float32, device=device, scale=4.0)
    targets = torch.randint(0, V, (R,), generator=gen).to(device)
    temp = (torch.rand(R, generator=gen) + 0.5).to(device)
    lp, ent = op.logprobs(logits, targets, temp)
    rlp, rent = ref.logprob_reference(logits, targets, temp)
    assert (lp - rlp).abs().max() < 1e-5 and (ent - rent).abs().max() < 1e-5  # measured 1.9e-6 / 2.1e-6
    for i in (0, R - 1):
        one = op.logprobs(logits[i : i + 1], targets[i : i + 1], temp[i : i + 1])
        assert torch.equal(one[0], lp[i : i + 1]) and torch.equal(one[1], ent[i : i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_logprobs_grad(device, dtype, monkeypatch):
    """Chunked over tokens (chunk 4 here): values equal the unchunked ones bit for bit, grads match the reference."""
    gen = torch.Generator().manual_seed(4)
    h = _rand(gen, 10, 32, dtype=dtype, device=device).requires_grad_()
    w = _rand(gen, 300, 32, dtype=dtype, device=device, scale=0.5).requires_grad_()
    targets = torch.randint(0, 300, (10,), generator=gen).to(device)
    lp, ent = op.lm_head_logprobs(h, w, targets, 0.8)
    monkeypatch.setattr(op, "LM_HEAD_CHUNK_TOKENS", 4)
    lp4, ent4 = op.lm_head_logprobs(h, w, targets, 0.8)
    assert torch.equal(lp, lp4) and torch.equal(ent, ent4)
    logits = ref.linear_reference(h, w, None, torch.float32)
    t = torch.full((10,), 0.8, device=device)
    rlp, rent = ref.logprob_reference(logits, targets, t)
    assert (lp - rlp).abs().max() < 1e-4
    g1, g2 = _rand(gen, 10, dtype=torch.float32, device=device), _rand(gen, 10, dtype=torch.float32, device=device)
    got = torch.autograd.grad((lp4, ent4), (h, w), (g1, g2))
    want = torch.autograd.grad((rlp, rent), (h, w), (g1, g2))
    for a, e in zip(got, want):
        assert _rel(a, e) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rope(device, dtype):
    """q/k norm + RoPE in one launch against ``rotate(rms_norm(x), cos, sin)`` (torch's roundings), per-token positions;
    a token alone gives the same bits."""
    from prime_spmd.models.common.rope import rotate
    from prime_spmd.models.exact import rope_tables

    gen = torch.Generator().manual_seed(5)
    B, T, H, Dh = 2, 9, 3, 24
    x = _rand(gen, B, T, H, Dh, dtype=dtype, device=device, scale=2.0)
    w = _rand(gen, Dh, dtype=dtype, device=device)
    cos, sin = rope_tables(Dh, 10000.0, 64, device, dtype)
    pos = torch.randint(0, 64, (B, T), generator=gen).to(device)
    out = op.rms_norm_rope(x, w, 1e-6, cos, sin, pos)
    want = rotate(ref.rms_norm_reference(x, w, 1e-6), cos[pos][:, :, None], sin[pos][:, :, None])
    assert _rel(out, want) < RTOL[dtype]
    assert torch.equal(op.rms_norm_rope(x[1:2, 4:5], w, 1e-6, cos, sin, pos[1:2, 4:5]), out[1:2, 4:5])
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    g = _rand(gen, B, T, H, Dh, dtype=dtype, device=device)
    got = torch.autograd.grad(op.rms_norm_rope(xg, wg, 1e-6, cos, sin, pos), (xg, wg), g)
    ref_out = rotate(ref.rms_norm_reference(xg, wg, 1e-6), cos[pos][:, :, None], sin[pos][:, :, None])
    for a, e in zip(got, torch.autograd.grad(ref_out, (xg, wg), g)):
        assert _rel(a, e) < (1e-5 if dtype == torch.float32 else 5e-2)


def test_backward_math_compiles_whole_with_dynamic_shapes():
    """The norms' and the SiLU-gate's backward (``_backward_fn`` compiles them on CUDA) trace into one graph each
    (``fullgraph``), take another row count without a recompile, and give the eager function's values."""
    from torch._dynamo.testing import CompileCounter

    from prime_spmd.models.exact import rope_tables

    gen = torch.Generator().manual_seed(7)
    cos_t, sin_t = rope_tables(16, 10000.0, 64, "cpu", torch.bfloat16)
    for fn in (op.rms_norm_backward, op.rms_norm_rope_backward, op.silu_mul_backward):
        counter = CompileCounter()
        compiled = torch.compile(fn, dynamic=True, fullgraph=True, backend=counter)
        for rows in (5, 11):
            if fn is op.silu_mul_backward:
                args = tuple(_rand(gen, rows, 48, dtype=torch.bfloat16, device="cpu") for _ in range(3))
            else:
                x = _rand(gen, rows, 3, 16, dtype=torch.bfloat16, device="cpu")
                args = (x, _rand(gen, 16, dtype=torch.bfloat16, device="cpu"), torch.randn_like(x), 1e-6)
                if fn is op.rms_norm_rope_backward:
                    pos = torch.randint(0, 64, (rows,), generator=gen)
                    args += (cos_t[pos][:, None], sin_t[pos][:, None])
            for a, e in zip(compiled(*args), fn(*args)):
                assert torch.equal(a, e)
        assert counter.frame_count == 1, (fn.__name__, counter.frame_count)
