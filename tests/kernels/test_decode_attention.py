"""Decode attention, slot and paged forms: the Triton kernels vs the PyTorch reference, opcheck, and CUDA-graph capture.

CPU runs Triton under TRITON_INTERPRET=1 (tests/conftest.py) with 16-position tiles, so the small
shapes still cover several tiles per split, ragged tails, splits that are empty for short rows,
non-power-of-two head dims and group sizes, MHA (G = 1) and GQA; the paged form adds blocks of 8, 16, 24 and
32 positions (several blocks per tile, one, tiles straddling blocks, several tiles per block) under random
block tables. With CUDA the same tests run on the GPU (the interpreter is then off). ~10 s on CPU (2 cores).
"""

from __future__ import annotations

import pytest
import torch
from prime_spmd.kernels.decode_attention.op import decode_attention, fused_decode_attention, paged_decode_attention

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(autouse=True)
def _plain_fused_form(monkeypatch):
    """The fused form without its preloaded tile (the engine's default where it applies): these tests keep covering
    the plain form; test_fused_preloaded_tile_matches_reference covers the preloaded one."""
    from prime_spmd.kernels.decode_attention import kernel

    monkeypatch.setattr(kernel, "PRELOAD_TILE", False)


# fp32: measured max error 1.3e-7 of max |ref| over the slot grid, 2.0e-7 over the paged grid (interpreter); on GPU
# the dots are IEEE fp32 (no TF32)
FP32_RTOL = 2e-6
# bf16: q/k/v in bf16, output rounded to bf16, reference in fp32 on the same bf16 inputs:
# measured 3.6e-3 of max |ref| (slot), 3.2e-3 (paged; interpreter), about one bf16 ulp; the GPU casts p to bf16
# for p @ v too
BF16_RTOL = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _case(b, h, j, d, s, length, max_len, dtype, device, seed=0):
    """q [b, h, d], K/V as one layer of a 2-layer cache [2, s, j, length, d] (a strided view, like the
    engine's), lens in [1, max_len + 5] with the edges 1 and > max_len (clamped) present."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=gen).to(dtype)
    k = torch.randn(2, s, j, length, d, generator=gen).to(dtype)[1]
    v = torch.randn(2, s, j, length, d, generator=gen).to(dtype)[1]
    lens = torch.randint(1, max_len + 6, (b,), generator=gen)
    lens[0] = 1
    if b > 1:
        lens[1] = max_len + 3
    return q.to(device), k.to(device), v.to(device), lens.to(device)


SHAPES = [
    # b, h, j, d, s, length, max_len
    (3, 4, 2, 16, 4, 64, 50),  # GQA G=2, ragged tail, a row beyond max_len
    (2, 5, 5, 24, 2, 40, 40),  # MHA, D not a power of two, max_len = cache length
    (4, 10, 2, 32, 5, 96, 77),  # G=5 (not a power of two), several tiles per split
    (1, 16, 1, 16, 1, 130, 130),  # one row, G=16 (a full BLOCK_G), splits over 9 tiles
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_matches_reference_fp32(device, shape, num_splits):
    q, k, v, lens = _case(*shape, torch.float32, device)
    scale = shape[3] ** -0.5
    ref = decode_attention(q, k, v, lens, shape[-1], scale, impl="reference")
    got = decode_attention(q, k, v, lens, shape[-1], scale, impl="triton", num_splits=num_splits)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert _rel(got, ref) < FP32_RTOL, _rel(got, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_matches_reference_bf16(device, num_splits):
    shape = (4, 8, 2, 32, 4, 80, 70)
    q, k, v, lens = _case(*shape, torch.bfloat16, device, seed=1)
    ref = decode_attention(q, k, v, lens, 70, 0.2, impl="reference")
    got = decode_attention(q, k, v, lens, 70, 0.2, impl="triton", num_splits=num_splits)
    assert got.dtype == torch.bfloat16
    assert _rel(got, ref) < BF16_RTOL, _rel(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_reads_only_each_rows_positions(device):
    """NaN in every cache position at or past a row's length (and in slots past B) must not reach o."""
    b, max_len = 3, 60
    q, k, v, lens = _case(b, 4, 2, 16, 5, 64, max_len, torch.float32, device, seed=2)
    clean = decode_attention(q, k, v, lens, max_len, 0.25, impl="reference")
    pos = torch.arange(k.shape[2], device=device)
    dead = pos[None, :] >= lens.clamp(max=max_len)[:, None]  # [b, length]
    kp, vp = k.clone(), v.clone()
    kp[:b].masked_fill_(dead[:, None, :, None], float("nan"))
    vp[:b].masked_fill_(dead[:, None, :, None], float("nan"))
    kp[b:], vp[b:] = float("nan"), float("nan")
    for ns in (1, 4):
        got = decode_attention(q, kp, vp, lens, max_len, 0.25, impl="triton", num_splits=ns)
        assert torch.isfinite(got).all()
        assert _rel(got, clean) < FP32_RTOL


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise(device):
    q, k, v, lens = _case(2, 4, 2, 16, 2, 32, 32, torch.float32, device)
    with pytest.raises(ValueError, match="max_len=33"):
        decode_attention(q, k, v, lens, 33, 1.0, impl="triton")
    with pytest.raises(ValueError, match="N a multiple of Nkv"):
        decode_attention(q[:, :3], k, v, lens, 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match="lens_B"):
        decode_attention(q, k, v, lens.float(), 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match="head dim must be contiguous"):
        decode_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, lens, 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        decode_attention(q, k, v, lens, 32, 1.0, impl="bmm")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    q, k, v, lens = _case(2, 4, 2, 16, 3, 48, 40, torch.float32, device)
    for ns in (1, 3):
        torch.library.opcheck(torch.ops.prime_spmd.decode_attention, (q, k, v, lens, 40, 0.25, ns))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_replay_reads_new_lengths_and_cache():
    """Captured once; lengths and cache updated in place between replays, as the engine does."""
    q, k, v, lens = _case(4, 16, 8, 128, 4, 512, 384, torch.bfloat16, "cuda", seed=3)
    for ns in (0, 1, 4):
        decode_attention(q, k, v, lens, 384, 0.1, impl="triton", num_splits=ns)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_attention(q, k, v, lens, 384, 0.1, impl="triton", num_splits=ns)
        for step in range(3):
            lens.copy_(torch.tensor([1 + step, 100, 383, 384 + step], device="cuda"))
            k.add_(0.1)
            graph.replay()
            ref = decode_attention(q, k, v, lens, 384, 0.1, impl="reference")
            assert _rel(out, ref) < BF16_RTOL


# --- paged form: K/V in a pool of blocks [Nb, Nkv, Sb, Dh], row b's blocks listed in block_table[b] ---


def _paged_case(b, h, j, d, sb, max_len, dtype, device, seed=0):
    """q [b, h, d], K/V pools as strided views (K one layer of a 2-layer pool [2, nb, j, sb, d], like the engine's),
    a table int32 [b + 1, mb] of random block ids (mb one entry more than max_len needs): with fewer blocks than
    entries, rows share blocks, a row's blocks come in scrambled order and a block may recur. lens as ``_case``."""
    gen = torch.Generator().manual_seed(seed)
    mb = -(-max_len // sb) + 1
    nb = max(2, b * mb // 2)
    q = torch.randn(b, h, d, generator=gen).to(dtype)
    k = torch.randn(2, nb, j, sb, d, generator=gen).to(dtype)[1]
    v = torch.randn(nb, 2, j, sb, d, generator=gen).to(dtype)[:, 1]  # a block stride unlike k's
    table = torch.randint(0, nb, (b + 1, mb), generator=gen, dtype=torch.int32)
    lens = torch.randint(1, max_len + 6, (b,), generator=gen)
    lens[0] = 1
    if b > 1:
        lens[1] = max_len + 3
    return q.to(device), k.to(device), v.to(device), table.to(device), lens.to(device)


def _to_paged(k, v, sb, gen, share=2):
    """The slot cache k/v [Bc, Nkv, Tc, Dh] as pools [Nb, Nkv, Sb, Dh] (one layer of a 2-layer pool, blocks in a
    random order) and a table int32 [Bc, Mb] that maps the same data. Row 2 takes row 0's first ``share`` blocks,
    as GRPO samples share a prompt: its K/V there are overwritten with row 0's in k/v (in place) and its own blocks
    are NaN, so reading them instead of row 0's shows."""
    bc, j, tc, d = k.shape
    mb = -(-tc // sb)
    k[2, :, : share * sb], v[2, :, : share * sb] = k[0, :, : share * sb], v[0, :, : share * sb]
    perm = torch.randperm(bc * mb, generator=gen).to(k.device)
    table = perm.view(bc, mb).to(torch.int32)

    def pool(x):
        x_BcMbNkvSbDh = torch.nn.functional.pad(x, (0, 0, 0, mb * sb - tc)).view(bc, j, mb, sb, d).transpose(1, 2)
        out = torch.full((2, bc * mb, j, sb, d), float("nan"), dtype=x.dtype, device=x.device)
        out[1, perm] = x_BcMbNkvSbDh.reshape(bc * mb, j, sb, d)
        out[1, table[2, :share].long()] = float("nan")
        return out[1]

    k_pool, v_pool = pool(k), pool(v)
    table[2, :share] = table[0, :share]
    return k_pool, v_pool, table


PAGED_SHAPES = [
    # b, h, j, d, sb, max_len (interpreter tile: 16 positions)
    (3, 4, 2, 16, 16, 50),  # GQA G=2, one block per tile, ragged tail, a row beyond max_len
    (2, 5, 5, 24, 8, 40),  # MHA, D not a power of two, two blocks per tile
    (4, 10, 2, 32, 24, 77),  # G=5, blocks of 24: tiles straddle block boundaries
    (1, 16, 1, 16, 32, 130),  # one row, G=16, two tiles per block, splits over 9 tiles
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", PAGED_SHAPES)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_paged_matches_reference_fp32(device, shape, num_splits):
    q, k, v, table, lens = _paged_case(*shape, torch.float32, device)
    scale = shape[3] ** -0.5
    ref = paged_decode_attention(q, k, v, table, lens, shape[-1], scale, impl="reference")
    got = paged_decode_attention(q, k, v, table, lens, shape[-1], scale, impl="triton", num_splits=num_splits)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert _rel(got, ref) < FP32_RTOL, _rel(got, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("sb", "num_splits"), [(16, 1), (24, 4)])
def test_paged_matches_reference_bf16(device, sb, num_splits):
    q, k, v, table, lens = _paged_case(4, 8, 2, 32, sb, 70, torch.bfloat16, device, seed=1)
    ref = paged_decode_attention(q, k, v, table, lens, 70, 0.2, impl="reference")
    got = paged_decode_attention(q, k, v, table, lens, 70, 0.2, impl="triton", num_splits=num_splits)
    assert got.dtype == torch.bfloat16
    assert _rel(got, ref) < BF16_RTOL, _rel(got, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_equals_slot_on_the_same_data(device, dtype):
    """A table mapping the slot cache's data (scrambled blocks, a shared prefix) gives the slot kernel's o bit for
    bit (same tiles, same arithmetic), and the paged spec gives the slot spec's."""
    q, k, v, lens = _case(4, 6, 2, 24, 5, 72, 70, dtype, device, seed=4)
    gen = torch.Generator().manual_seed(4)
    for sb in (16, 24):
        k_pool, v_pool, table = _to_paged(k, v, sb, gen)
        ref_slot = decode_attention(q, k, v, lens, 70, 0.3, impl="reference")
        ref_paged = paged_decode_attention(q, k_pool, v_pool, table, lens, 70, 0.3, impl="reference")
        assert torch.equal(ref_paged, ref_slot)
        for ns in (1, 3):
            slot = decode_attention(q, k, v, lens, 70, 0.3, impl="triton", num_splits=ns)
            paged = paged_decode_attention(q, k_pool, v_pool, table, lens, 70, 0.3, impl="triton", num_splits=ns)
            assert torch.equal(paged, slot), (sb, ns, _rel(paged, slot))


@pytest.mark.parametrize("device", DEVICES)
def test_paged_reads_only_each_rows_positions(device):
    """NaN in every pool position no row reads, and past each row's length in the table (entries pointing at a
    NaN block), must not reach o."""
    b, max_len, sb = 3, 60, 8
    q, k, v, lens = _case(b, 4, 2, 16, b + 1, 64, max_len, torch.float32, device, seed=2)
    k_pool, v_pool, table = _to_paged(k, v, sb, torch.Generator().manual_seed(2), share=0)
    clean = decode_attention(q, k, v, lens, max_len, 0.25, impl="reference")
    live = lens.clamp(max=max_len)
    pos = torch.arange(table.shape[1] * sb, device=device)
    kp, vp = k_pool.clone(), v_pool.clone()
    for row in range(b):  # positions past the row's length inside its last block
        dead = pos[(pos >= live[row]) & (pos < -(-live[row] // sb) * sb)]
        blk = table[row, dead // sb].long()
        kp[blk, :, dead % sb], vp[blk, :, dead % sb] = float("nan"), float("nan")
    kp[table[b].long()], vp[table[b].long()] = float("nan"), float("nan")  # row b (not a decode row) is all NaN
    tp = table.clone()
    past_B = torch.arange(table.shape[1], device=device)[None, :] >= -(-live[:, None] // sb)
    tp[:b][past_B] = table[b, 0]  # entries past a row's last block point at a NaN block
    for ns in (1, 4):
        got = paged_decode_attention(q, kp, vp, tp, lens, max_len, 0.25, impl="triton", num_splits=ns)
        assert torch.isfinite(got).all()
        assert _rel(got, clean) < FP32_RTOL


@pytest.mark.parametrize("device", DEVICES)
def test_paged_bad_inputs_raise(device):
    q, k, v, table, lens = _paged_case(2, 4, 2, 16, 16, 32, torch.float32, device)  # table [3, 3]: max_len <= 48
    with pytest.raises(ValueError, match="max_len=49"):
        paged_decode_attention(q, k, v, table, lens, 49, 1.0, impl="triton")
    with pytest.raises(ValueError, match="N a multiple of Nkv"):
        paged_decode_attention(q[:, :3], k, v, table, lens, 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match="Nb, Nkv, Sb, Dh"):
        paged_decode_attention(q, k, v[:, :, :8], table, lens, 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match="block_table must be int32"):
        paged_decode_attention(q, k, v, table.long(), lens, 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match=r"Bc >= B = 2, got torch.int32 \(1, 3\)"):
        paged_decode_attention(q, k, v, table[:1], lens, 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match="lens_B"):
        paged_decode_attention(q, k, v, table, lens[:1], 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_decode_attention(q, k, v.double(), table, lens, 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match="must be contiguous"):
        paged_decode_attention(q, k, v, table.t().contiguous().t(), lens, 32, 1.0, impl="triton")
    with pytest.raises(ValueError, match="impl"):
        paged_decode_attention(q, k, v, table, lens, 32, 1.0, impl="bmm")


@pytest.mark.parametrize("device", DEVICES)
def test_paged_opcheck(device):
    q, k, v, table, lens = _paged_case(2, 4, 2, 16, 8, 40, torch.float32, device)
    for ns in (1, 3):
        torch.library.opcheck(torch.ops.prime_spmd.paged_decode_attention, (q, k, v, table, lens, 40, 0.25, ns))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_paged_cuda_graph_replay_reads_new_table_lengths_and_pool():
    """Captured once; table, lengths and pool updated in place between replays, as the engine does."""
    q, k, v, table, lens = _paged_case(4, 16, 8, 128, 16, 384, torch.bfloat16, "cuda", seed=3)
    gen = torch.Generator().manual_seed(5)
    for ns in (0, 1, 4):
        paged_decode_attention(q, k, v, table, lens, 384, 0.1, impl="triton", num_splits=ns)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = paged_decode_attention(q, k, v, table, lens, 384, 0.1, impl="triton", num_splits=ns)
        for step in range(3):
            lens.copy_(torch.tensor([1 + step, 100, 383, 384 + step], device="cuda"))
            table.copy_(torch.randint(0, k.shape[0], table.shape, generator=gen, dtype=torch.int32))
            k.add_(0.1)
            graph.replay()
            ref = paged_decode_attention(q, k, v, table, lens, 384, 0.1, impl="reference")
            assert _rel(out, ref) < BF16_RTOL


# ---- the fused form: q/k norm, RoPE and the new token's cache write inside the kernel ----------------------------


def _fused_case(b, h, j, d, max_len, sb, qk_norm, dtype, device, seed=0):
    """(qkv [b, (h + 2j) d], q/k norm weights or None, cos/sin [b, d], pos, lens = pos + 1, k/v caches, table):
    a slot cache [b, j, max_len + 8, d] (``sb`` 0) or pools of ``sb``-position blocks with a scrambled table of
    distinct blocks (rows write their own blocks), both strided views as the engine's. Row 0 writes position 0; row
    1 (when b > 1) is past ``max_len`` (a free row beyond the bucket): nothing is written for it."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, (h + 2 * j) * d, generator=gen).to(dtype)
    qn, kn = (
        (torch.randn(d, generator=gen).to(dtype), torch.randn(d, generator=gen).to(dtype)) if qk_norm else (None, None)
    )
    cos, sin = torch.randn(b, d, generator=gen).to(dtype), torch.randn(b, d, generator=gen).to(dtype)
    tc = max_len + 8
    pos = torch.randint(0, max_len, (b,), generator=gen)
    pos[0] = 0
    if b > 1:
        pos[1] = max_len + 2
    if sb == 0:
        k = torch.randn(2, b, j, tc, d, generator=gen).to(dtype)[1]
        v = torch.randn(b, 2, j, tc, d, generator=gen).to(dtype)[:, 1]
        table = None
    else:
        mb = -(-tc // sb)
        k = torch.randn(2, b * mb + 1, j, sb, d, generator=gen).to(dtype)[1]
        v = torch.randn(b * mb + 1, 2, j, sb, d, generator=gen).to(dtype)[:, 1]
        table = (torch.randperm(b * mb, generator=gen) + 1).view(b, mb).to(torch.int32).to(device)
    put = [x.to(device) if x is not None else None for x in (qkv, qn, kn, cos, sin, pos, pos + 1, k, v)]
    return (*put, table)


def _run_fused(case, h, max_len, impl, num_splits=0):
    qkv, qn, kn, cos, sin, pos, lens, k, v, table = case
    k, v = k.clone(), v.clone()
    d = k.shape[-1]
    o = fused_decode_attention(
        qkv, h, qn, kn, cos, sin, pos, k, v, table, lens, max_len, d**-0.5, 1e-6, impl, num_splits
    )
    return o, k, v


FUSED_SHAPES = [
    # b, h, j, d, max_len
    (3, 4, 2, 16, 50),  # GQA G=2, ragged tail
    (2, 5, 5, 24, 40),  # MHA, D not a power of two
    (4, 10, 2, 32, 77),  # G=5, several tiles per split
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", FUSED_SHAPES)
@pytest.mark.parametrize("sb", [0, 8, 24])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_matches_reference_fp32(device, shape, sb, qk_norm):
    case = _fused_case(*shape, sb, qk_norm, torch.float32, device)
    o_ref, k_ref, v_ref = _run_fused(case, shape[1], shape[-1], "reference")
    written = (k_ref != case[7]).any()
    assert written  # the reference wrote new tokens: the cache checks below are not vacuous
    for num_splits in (0, 1, 3):
        o, k, v = _run_fused(case, shape[1], shape[-1], "triton", num_splits)
        assert _rel(o, o_ref) < FP32_RTOL, (num_splits, _rel(o, o_ref))
        # the new k went through the norm and RoPE in another order of fp32 operations: measured 4.8e-7 abs
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_ref, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sb", [0, 16])
def test_fused_matches_reference_bf16(device, sb):
    shape = (3, 8, 2, 32, 60)
    case = _fused_case(*shape, sb, True, torch.bfloat16, device)
    o_ref, k_ref, v_ref = _run_fused(case, shape[1], shape[-1], "reference")
    o, k, v = _run_fused(case, shape[1], shape[-1], "triton", 3)
    assert _rel(o, o_ref) < BF16_RTOL, _rel(o, o_ref)
    # k: the kernel rounds once after norm + RoPE in fp32, the reference after each op (one bf16 ulp apart)
    torch.testing.assert_close(k.float(), k_ref.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(v, v_ref, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_opcheck_and_bad_inputs(device):
    qkv, qn, kn, cos, sin, pos, lens, k, v, table = _fused_case(2, 4, 2, 16, 40, 8, True, torch.float32, device)
    args = (qkv, 4, qn, kn, cos, sin, pos, k, v, table, lens, 40, 0.25, 1e-6)
    for ns in (1, 3):
        torch.library.opcheck(torch.ops.prime_spmd.fused_decode_attention, (*args, ns))
    from prime_spmd.kernels.counters import zeroed_counters

    assert int(zeroed_counters(qkv.device, 1, "decode_attention").abs().sum()) == 0  # left zeroed for the next call
    with pytest.raises(ValueError, match="not \\[B, \\(N \\+ 2 Nkv\\) Dh\\]"):
        fused_decode_attention(qkv[:, :-16], *args[1:], impl="triton")
    with pytest.raises(ValueError, match="both"):
        fused_decode_attention(qkv, 4, qn, None, *args[4:], impl="triton")
    wide_sin = torch.randn(sin.shape[0], 2 * sin.shape[1], device=device)[:, : sin.shape[1]]  # another row stride
    with pytest.raises(ValueError, match="cos/sin"):
        fused_decode_attention(qkv, 4, qn, kn, cos, wide_sin, *args[6:], impl="triton")


@pytest.mark.parametrize("device", DEVICES)
def test_fused_rows_outside_their_length_write_nothing(device):
    """Positions outside [0, min(lens, max_len)): negative, and far past the table (Mb * Sb), write nothing and read
    no table entry out of bounds (the kernel clamps the lookup; the store is masked); row 2 writes as usual."""
    qkv, qn, kn, cos, sin, pos, lens, k, v, table = _fused_case(3, 4, 2, 16, 40, 8, True, torch.float32, device)
    pos = torch.tensor([-1, 10**8, 5], device=device)
    lens = torch.tensor([4, 5, 6], device=device)
    caches = {impl: (k.clone(), v.clone()) for impl in ("reference", "triton")}
    outs = {
        impl: fused_decode_attention(qkv, 4, qn, kn, cos, sin, pos, kc, vc, table, lens, 40, 0.25, 1e-6, impl)
        for impl, (kc, vc) in caches.items()
    }
    assert _rel(outs["triton"], outs["reference"]) < FP32_RTOL
    written = (caches["reference"][0] != k).any(dim=(1, 2, 3)).nonzero().flatten().tolist()
    assert written == [int(table[2, 5 // 8])]  # only row 2's block, in the reference
    torch.testing.assert_close(caches["triton"][0], caches["reference"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches["triton"][1], caches["reference"][1], atol=0, rtol=0)


def test_split_count_follows_split_tiles(monkeypatch):
    """GPU split rule (host arithmetic, checked with a stated SM count): ~2 programs per SM, each split at least
    ``SPLIT_TILES`` tiles."""
    from prime_spmd.kernels.decode_attention import kernel

    monkeypatch.setattr(kernel, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kernel, "SPLIT_TILES", 1)
    gpu = torch.device("cuda", 0)
    assert kernel.pick_num_splits(1, 8, 512, gpu, 64) == 8  # 8 tiles, 33 wanted: one tile a split
    assert kernel.pick_num_splits(64, 8, 512, gpu, 64) == 1  # 512 programs already
    monkeypatch.setattr(kernel, "SPLIT_TILES", 4)
    assert kernel.pick_num_splits(1, 8, 512, gpu, 64) == 2
    assert kernel.pick_num_splits(1, 8, 128, gpu, 64) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_preloaded_tile_matches_reference(device, dtype, monkeypatch):
    """The fused form's preloaded-tile variant (kernel.PRELOAD_TILE: slot cache, one tile a split): the tile is
    loaded before the new token's k / v are written, so the stale cache entry at pos (random here) must be replaced
    by this launch's k / v in registers; output and caches as the reference's."""
    from prime_spmd.kernels.decode_attention import kernel

    monkeypatch.setattr(kernel, "PRELOAD_TILE", True)
    shapes = FUSED_SHAPES if dtype == torch.float32 else [(3, 8, 2, 32, 60)]
    for shape in shapes:
        case = _fused_case(*shape, 0, True, dtype, device, seed=3)
        o_ref, k_ref, v_ref = _run_fused(case, shape[1], shape[-1], "reference")
        tiles = -(-shape[-1] // kernel.default_block_tc(shape[3]))
        o, k, v = _run_fused(case, shape[1], shape[-1], "triton", tiles)  # one tile a split: the preloaded form
        if dtype == torch.float32:
            assert _rel(o, o_ref) < FP32_RTOL, (shape, _rel(o, o_ref))
            torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        else:
            assert _rel(o, o_ref) < BF16_RTOL, (shape, _rel(o, o_ref))
            torch.testing.assert_close(k.float(), k_ref.float(), atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(v, v_ref, atol=0, rtol=0)
