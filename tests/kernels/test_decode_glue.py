"""The decode step's glue kernels (kernels/decode_glue) vs their PyTorch reference on random inputs: the step's
inputs (embedding rows, RoPE rows, attended lengths) and the state advance, bit for bit (they only move and add);
input errors; on CUDA, capture in a CUDA graph and replay. CPU runs Triton under TRITON_INTERPRET=1 (64-wide
hidden chunks there, so a hidden size of 200 covers several and a ragged tail)."""

from __future__ import annotations

import pytest
import torch
from prime_spmd.kernels.decode_glue.kernel import advance, step_inputs
from prime_spmd.kernels.decode_glue.reference import advance_reference, step_inputs_reference

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _inputs(b, v, d, t, dh, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, v, (b,), generator=gen)
    pos = torch.randint(0, t, (b,), generator=gen)
    embed = torch.randn(v, d, generator=gen).to(dtype)
    cos = torch.randn(t, dh, generator=gen).to(dtype)
    sin = torch.randn(t, dh, generator=gen).to(dtype)
    return [x.to(device) for x in (ids, pos, embed, cos, sin)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,d,dh", [(1, 64, 16), (3, 200, 24), (17, 128, 128)])
def test_step_inputs_match_reference(device, dtype, b, d, dh) -> None:
    ids, pos, embed, cos, sin = _inputs(b, 50, d, 40, dh, dtype, device, seed=b)
    pos[0] = 39  # the last position: its length clamps to kv_len below
    for kv_len in (40, 24):
        got = step_inputs(ids, pos, embed, cos, sin, kv_len)
        want = step_inputs_reference(ids, pos, embed, cos, sin, kv_len)
        for name, g, w in zip(("x", "cos", "sin", "lens"), got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.equal(g, w), f"{name} differs at kv_len {kv_len}"
    # the embedding table's rows may be strided (a view of a wider table)
    wide = torch.randn(50, d + 8, device=device).to(dtype)[:, :d]
    assert torch.equal(step_inputs(ids, pos, wide, cos, sin, 40)[0], wide[ids])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b", [1, 5, 130])
def test_advance_matches_reference(device, b) -> None:
    gen = torch.Generator().manual_seed(b)
    slots = b + 3  # the engine advances slots 0..b-1 of wider state tensors
    state = [torch.randint(0, 30, (slots,), generator=gen).to(device) for _ in range(3)]
    out = torch.zeros(2, slots, dtype=torch.float64, device=device)
    tokens = torch.randint(0, 1000, (b,), generator=gen).to(device)
    logprobs = (-torch.rand(b, generator=gen) * 5).to(device)
    got = [t.clone() for t in state] + [out.clone()]
    want = [t.clone() for t in state] + [out.clone()]
    advance(*[t[:b] for t in got[:3]], got[3][:, :b], tokens, logprobs, 20)
    advance_reference(*[t[:b] for t in want[:3]], want[3][:, :b], tokens, logprobs, 20)
    for name, g, w in zip(("ids", "pos", "steps", "out"), got, want, strict=True):
        assert torch.equal(g, w), name
    assert (got[1][:b] <= 20).all() and torch.equal(got[1][b:], state[1][b:])  # clamped; other slots untouched


def test_errors_name_the_bad_input() -> None:
    ids, pos, embed, cos, sin = _inputs(2, 10, 8, 6, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="pos must be a contiguous \\[2\\]"):
        step_inputs(ids, pos[:1], embed, cos, sin, 6)
    with pytest.raises(ValueError, match="cos \\[6, 4\\] and sin \\[6, 3\\] differ"):
        step_inputs(ids, pos, embed, cos, sin[:, :3].contiguous(), 6)
    with pytest.raises(ValueError, match="embed must be 2-D"):
        step_inputs(ids, pos, embed.t(), cos, sin, 6)
    out = torch.zeros(2, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="out must be float64"):
        advance(ids, pos, pos.clone(), out, ids, torch.zeros(2), 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_graph_replay_follows_the_inputs() -> None:
    ids, pos, embed, cos, sin = _inputs(4, 50, 96, 40, 32, torch.bfloat16, "cuda")
    steps = torch.zeros_like(ids)
    out = torch.zeros(2, 4, dtype=torch.float64, device="cuda")
    lp = torch.randn(4, device="cuda")
    step_inputs(ids, pos, embed, cos, sin, 40)  # compile outside the capture
    advance(ids.clone(), pos.clone(), steps.clone(), out.clone(), ids, lp, 39)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = step_inputs(ids, pos, embed, cos, sin, 40)
        advance(ids, pos, steps, out, (ids + 1) % 50, lp, 39)
    for _ in range(3):
        ids0, pos0 = ids.clone(), pos.clone()
        graph.replay()
        want = step_inputs_reference(ids0, pos0, embed, cos, sin, 40)
        for g, w in zip(res, want, strict=True):
            assert torch.equal(g, w)
        assert torch.equal(ids, (ids0 + 1) % 50) and torch.equal(pos, (pos0 + 1).clamp(max=39))
    assert torch.equal(steps, torch.full_like(steps, 3))
