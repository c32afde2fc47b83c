"""Decode chain (kernels/decode_chain): all layers of a one-row decode step in one launch vs the PyTorch reference,
vs the per-kernel path it replaces, its counters, and its input checks.

CPU runs Triton under TRITON_INTERPRET=1 (tests/conftest.py), which runs a launch's programs one after another in
grid order; the chain hands out work by ticket, so this runs every phase in order and each wait is already met
(the waits themselves, the barriers and the atomics' memory order are exercised only on a GPU, where this file
runs compiled). Shapes: 2 layers, hidden 64, GQA (4 heads, 2 kv heads, Dh 16), 16-position tiles; positions that
give one split, several splits (the last-arriving split combines them), and the preloaded-tile form. ~20 s on CPU.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from prime_spmd.kernels.counters import wait_count
from prime_spmd.kernels.decode_attention import kernel as attention
from prime_spmd.kernels.decode_chain import kernel as chain
from prime_spmd.kernels.decode_chain.reference import decode_chain_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
L, D, INTER, N, NKV, DH, SLOTS, TC = 2, 64, 96, 4, 2, 16, 2, 96
SCALE, EPS = DH**-0.5, 1e-6
# fp32: the chain sums K in its own order (one reduction over the slab); measured ~1e-6 of max |x| here
FP32_RTOL = 1e-5
# bf16: each layer's linears and attention round to bf16 as the reference does, in another summation order; over two
# layers that moves the output as far as bf16 itself does (the bf16 reference vs the fp32 one on the same weights:
# 0.6e-2 to 4.2e-2 of max |x| over this file's cases, interpreter): the chain must stay within 1.5x of that
BF16_VS_FP32 = 1.5
# (pos, kv_len): one split; several splits (interpreter: a split is 4 tiles of 16); one tile (preloaded-tile form)
STEPS = [(21, 32), (70, 96), (9, 16)]


def _layers(dtype, qk_norm=True, qkv_bias=False, o_bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.2, one=False):
        t = torch.randn(*shape, generator=g) * scale + (1.0 if one else 0.0)
        return t.to(DEVICE, dtype)

    p = (N + 2 * NKV) * DH
    return [
        (w(D, one=True), w(p, D), w(p) if qkv_bias else None, w(DH, one=True) if qk_norm else None,
         w(DH, one=True) if qk_norm else None, w(D, N * DH), w(D) if o_bias else None, w(D, one=True),
         w(2 * INTER, D), w(D, INTER))
        for _ in range(L)
    ]  # fmt: skip


def _inputs(dtype, pos, seed=1):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, SLOTS, NKV, TC, DH, generator=g).to(DEVICE, dtype)
    v = torch.randn(L, SLOTS, NKV, TC, DH, generator=g).to(DEVICE, dtype)
    x = (torch.randn(1, D, generator=g) * 0.5).to(DEVICE, dtype)
    ang = torch.rand(1, DH // 2, generator=g) * 6.28
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(DEVICE, dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(DEVICE, dtype)
    return x, k, v, cos, sin, torch.tensor([pos], device=DEVICE)


def _run_chain(layers, x, k, v, cos, sin, pos, kv_len, **kw):
    c = chain.DecodeChain(layers, k, v, N, SCALE, EPS, **kw)
    c.input().copy_(x)
    out = c(cos, sin, pos, (pos + 1).clamp(max=kv_len), kv_len).clone()
    c.check()  # interpreter: every wait was met when reached (the ticket order is the phases' order)
    return c, out


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(autouse=True)
def _tiles_of_16(monkeypatch):
    """16-position K/V tiles on a GPU too (its default is 128 at Dh 16): the steps then have one, two and six splits
    there (the interpreter's one split per 4 tiles: one, one and two)."""
    monkeypatch.setattr(attention, "default_block_tc", lambda head_dim: 16)
    monkeypatch.setattr(attention, "PRELOAD_TILE", False)  # plain attention items (preload_tile below: the other form)


@pytest.fixture
def preload_tile(monkeypatch):
    monkeypatch.setattr(attention, "PRELOAD_TILE", True)


CASES = [(dtype, step, form) for step in STEPS for form in ("qwen3", "qkv_bias", "biases") for dtype in
         (torch.float32, torch.bfloat16) if dtype == torch.float32 or form != "qkv_bias"]  # fmt: skip


@pytest.mark.parametrize("dtype,step,form", CASES)
def test_matches_reference(dtype, step, form):
    pos, kv_len = step
    layers = _layers(dtype, qk_norm=form == "qwen3", qkv_bias=form != "qwen3", o_bias=form == "biases")
    x, k, v, cos, sin, pos_1 = _inputs(dtype, pos)
    k_ref, v_ref = k.clone(), v.clone()
    c, out = _run_chain(layers, x, k, v, cos, sin, pos_1, kv_len)
    ref = decode_chain_reference(x, layers, k_ref, v_ref, N, cos, sin, pos_1, kv_len, SCALE, EPS)
    rtol = FP32_RTOL
    if dtype == torch.bfloat16:
        up = [tuple(None if w is None else w.float() for w in layer) for layer in layers]
        k32, v32 = _inputs(dtype, pos)[1:3]
        ref32 = decode_chain_reference(x.float(), up, k32.float(), v32.float(), N, cos.float(), sin.float(), pos_1,
                                       kv_len, SCALE, EPS)  # fmt: skip
        rtol = BF16_VS_FP32 * max(_rel(ref, ref32), 1e-2)
    assert _rel(out, ref) < rtol, (_rel(out, ref), rtol)
    # each layer wrote its new k / v at pos of slot 0, nothing else
    for cache, want in ((k, k_ref), (v, v_ref)):
        assert _rel(cache[:, 0, :, pos], want[:, 0, :, pos]) < rtol
        mask = torch.ones(TC, dtype=torch.bool, device=DEVICE)
        mask[pos] = False
        assert torch.equal(cache[:, :, :, mask], want[:, :, :, mask])


@pytest.mark.parametrize("step", STEPS)
def test_preloaded_tile_form_matches_reference(preload_tile, step):
    """The attention's preloaded-tile form inside the chain (one tile a split: the last step; the others take the
    loop form)."""
    pos, kv_len = step
    layers = _layers(torch.float32)
    x, k, v, cos, sin, pos_1 = _inputs(torch.float32, pos)
    k_ref, v_ref = k.clone(), v.clone()
    _, out = _run_chain(layers, x, k, v, cos, sin, pos_1, kv_len)
    ref = decode_chain_reference(x, layers, k_ref, v_ref, N, cos, sin, pos_1, kv_len, SCALE, EPS)
    assert _rel(out, ref) < FP32_RTOL
    assert torch.equal(k[:, 0, :, pos] != 0, k_ref[:, 0, :, pos] != 0)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="bit equality holds for the interpreter's sums; a GPU's sum "
                    "order depends on the launch's layout")  # fmt: skip
@pytest.mark.parametrize("step", STEPS[:2])
def test_equals_the_per_kernel_path_bitwise(step):
    """The chain runs the per-kernel path's own code (the GEMV's preloaded form, the fused attention): with the
    same item sizes its output is that path's, bit for bit (bf16)."""
    from prime_spmd.kernels.decode_linear import kernel as linear

    pos, kv_len = step
    dtype = torch.bfloat16
    layers = _layers(dtype)
    x, k, v, cos, sin, pos_1 = _inputs(dtype, pos)
    k2, v2 = k.clone(), v.clone()
    c, out = _run_chain(layers, x, k, v, cos, sin, pos_1, kv_len)
    bq, bo, bg, bd = c.bn

    def lin(x, w, b, nw, res, silu, bn):
        return linear.decode_linear(x, w, b, nw, EPS, res, silu, ("gemv", bn, 64, 4, True))

    lens = (pos_1 + 1).clamp(max=kv_len)
    h = x
    for li, (ln1, qkv_w, qkv_b, qn, kn, o_w, o_b, ln2, gu_w, dn_w) in enumerate(layers):
        qkv = lin(h, qkv_w, qkv_b, ln1, None, False, bq)
        o = attention.fused_decode_attention(qkv, N, qn, kn, cos, sin, pos_1, k2[li], v2[li], None, lens, kv_len,
                                             SCALE, EPS).reshape(1, -1)  # fmt: skip
        xm = lin(o, o_w, o_b, None, h, False, bo)
        g = lin(xm, gu_w, None, ln2, None, True, bg)
        h = lin(g, dn_w, None, None, xm, False, bd)
    assert torch.equal(out, h)
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_counters_count_every_item():
    """After a step: one ticket per program, each phase of each layer counted all its items, the split-combination
    counters left zeroed (the next step zeroes them all again anyway)."""
    pos, kv_len = STEPS[1]
    layers = _layers(torch.float32)
    x, k, v, cos, sin, pos_1 = _inputs(torch.float32, pos)
    c, _ = _run_chain(layers, x, k, v, cos, sin, pos_1, kv_len)
    splits, _ = c._splits(kv_len)
    assert splits > 1
    p = (N + 2 * NKV) * DH
    bq, bo, bg, bd = c.bn
    per_phase = [-(-p // bq), NKV * splits, -(-D // bo), -(-INTER // bg), -(-D // bd)]
    cnt = c.counters.cpu().tolist()
    assert cnt[0] == L * sum(per_phase) == L * c.items_per_layer(kv_len)
    assert cnt[1 : 1 + chain.N_PHASES * L] == per_phase * L
    assert cnt[1 + chain.N_PHASES * L :] == [0] * (L * NKV)


def test_bad_inputs_raise():
    layers = _layers(torch.float32)
    x, k, v, cos, sin, pos_1 = _inputs(torch.float32, 5)
    bad = [list(t) for t in layers]
    bad[1][3] = None  # layer 1 lost its q norm
    with pytest.raises(ValueError, match="layer 1 has no q_norm"):
        chain.DecodeChain([tuple(t) for t in bad], k, v, N, SCALE, EPS)
    bad = [list(t) for t in layers]
    bad[0][5] = bad[0][5].t().contiguous().t()  # o_w transposed in memory
    with pytest.raises(ValueError, match="layer 0 o_w"):
        chain.DecodeChain([tuple(t) for t in bad], k, v, N, SCALE, EPS)
    bad = [list(t) for t in layers]
    bad[1][7] = torch.empty(D + 1, device=DEVICE)[1:].copy_(bad[1][7])  # ln2 at a 4-byte offset
    with pytest.raises(ValueError, match=r"alignment: addresses of \['layer 1 ln2'\]"):
        chain.DecodeChain([tuple(t) for t in bad], k, v, N, SCALE, EPS)
    with pytest.raises(ValueError, match="dtype"):
        chain.DecodeChain(layers, k.double(), v.double(), N, SCALE, EPS)
    with pytest.raises(ValueError, match="3 heads"):
        chain.DecodeChain(layers, k, v, 3, SCALE, EPS)
    c = chain.DecodeChain(layers, k, v, N, SCALE, EPS)
    with pytest.raises(ValueError, match="kv_len 97"):
        c(cos, sin, pos_1, pos_1 + 1, TC + 1)


@triton.jit
def _waiter(cnt_ptr, err_ptr, out_ptr, target):
    wait_count(cnt_ptr, target, err_ptr)
    tl.store(out_ptr, tl.load(cnt_ptr) + 1)


def test_a_wait_that_is_never_met_is_counted_not_hung():
    """kernels/counters.wait_count gives up after SPIN_LIMIT polls (1 under the interpreter) and counts it; a met wait
    counts nothing. DecodeChain.check turns the count into an error."""
    cnt = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    err = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    _waiter[(1,)](cnt, err, out, 3)
    assert err.item() == 0 and out.item() == 4
    _waiter[(2,)](cnt, err, out, 4)  # never met: each program gives up and goes on
    assert err.item() == 2 and out.item() == 4
    layers = _layers(torch.float32)
    x, k, v, cos, sin, pos_1 = _inputs(torch.float32, 5)
    c = chain.DecodeChain(layers, k, v, N, SCALE, EPS)
    c.check()
    c.timeouts.fill_(1)
    with pytest.raises(RuntimeError, match="1 wait"):
        c.check()


def test_set_config():
    try:
        chain.set_config(32768, 8)
        assert (chain.SLAB_BYTES, chain.NUM_WARPS) == (32768, 8)
        chain.set_config(0, 0)
        assert (chain.SLAB_BYTES, chain.NUM_WARPS) == (chain.DEFAULT_SLAB_BYTES, chain.DEFAULT_NUM_WARPS)
        with pytest.raises(ValueError, match="warps 6"):
            chain.set_config(0, 6)
    finally:
        chain.set_config(0, 0)


def test_slab_columns():
    assert chain.slab_columns(1024, 1, 16384, 2) == 8  # Qwen3-0.6B qkv
    assert chain.slab_columns(3072, 1, 16384, 2) == 2  # down: K padded to 4,096
    assert chain.slab_columns(1024, 2, 16384, 2) == 4  # gate / up: two slabs
    assert chain.slab_columns(8192, 1, 1024, 4) == 1  # at least one column
