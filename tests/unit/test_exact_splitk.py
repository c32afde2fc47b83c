"""kernels/batch_invariant's matmul K order (fixed chunks of MM_CHUNK_K, chunk sums added in order) run both ways:
split (programs over (tile, chunk), fp32 partials, the reduce kernel: the engine's decode) and fused (one program a
tile looping over the chunks: the trainer). The two give the same bits for every row at any row count, with bias,
residual, fp32 logits out, and for the q/k/v and gate/up segment launches; and the order is the chunked reference's
to fp32 rounding.

Runs on the CPU under TRITON_INTERPRET=1 (tests/conftest.py), or compiled on CUDA (``device`` fixture). Inputs are
drawn on the CPU from a seeded generator.
"""

from __future__ import annotations

import pytest
import torch
from prime_spmd.kernels.batch_invariant import kernel as K
from prime_spmd.kernels.batch_invariant import op
from prime_spmd.kernels.batch_invariant import reference as ref

# K: one partial chunk (and not a multiple of BLOCK_K), a full chunk plus a one-step chunk, three chunks ending in a
# partial BLOCK_K step (two chunks add the same in either order: only three catch a wrong reduce order)
K_SIZES = (200, K.MM_CHUNK_K + K.MM_BLOCK_K, 2 * K.MM_CHUNK_K + 88)
M_SIZES = (1, 64, 65, 200)
# max |kernel - chunked reference| / max |reference|, fp32 sums of exact products (fp32 inputs, or bf16 upcast):
# measured <= 4.0e-7 over this grid (CPU interpreter, 2026-12-06)
RTOL = 2e-6


def _rand(gen, *shape, dtype, device):
    return torch.randn(*shape, generator=gen).to(device, dtype)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_split_equals_fused(device, dtype):
    """For every (M, K): split == fused bit for bit (bias + residual in x's dtype; bias into fp32 logits), each row
    of the 200-row fused launch == that row alone (M 1: split, the engine's decode), and the fp32 logits match
    ``linear_chunked_reference``."""
    gen = torch.Generator().manual_seed(0)
    n = 130  # two N tiles at BLOCK_N 64 or 128, the last partial
    for k in K_SIZES:
        w, b = _rand(gen, n, k, dtype=dtype, device=device), _rand(gen, n, dtype=dtype, device=device)
        x_all = _rand(gen, max(M_SIZES), k, dtype=dtype, device=device)
        r_all = _rand(gen, max(M_SIZES), n, dtype=dtype, device=device)
        fused_all = op._launch_linear(x_all, w, b, dtype, r_all, split=False)
        for m in M_SIZES:
            x, r = x_all[:m], r_all[:m]
            split = op._launch_linear(x, w, b, dtype, r, split=True)
            assert torch.equal(split, fused_all[:m]), (m, k)  # a fused launch of the same m rows: the same rows
            assert torch.equal(op.linear(x, w, b, residual=r), split)  # whichever op.py picks for m
            logits = op._launch_linear(x, w, b, torch.float32, split=True)
            assert torch.equal(logits, op._launch_linear(x, w, b, torch.float32, split=False)), (m, k)
            want = ref.linear_chunked_reference(x, w, b, chunk_k=K.MM_CHUNK_K, out_dtype=torch.float32)
            assert _rel(logits, want) < RTOL, (m, k)
        i = 131  # a row in the fused launch's third M tile, alone in a split launch
        alone = op._launch_linear(x_all[i : i + 1], w, b, dtype, r_all[i : i + 1], split=True)
        assert torch.equal(alone, fused_all[i : i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ns", [(96, 40, 33), (130, 64)])
def test_segments_split_equals_fused(device, dtype, ns):
    """q/k/v (3 weights) and gate/up (2) in one launch: split == fused == each weight's ``linear`` bit for bit, at a
    decode row count and a training one, for K of one and of three chunks."""
    gen = torch.Generator().manual_seed(sum(ns))
    for k in (K_SIZES[0], K_SIZES[-1]):
        ws = tuple(_rand(gen, n, k, dtype=dtype, device=device) for n in ns)
        for m in (1, 65):
            x = _rand(gen, m, k, dtype=dtype, device=device)
            split = op._launch_segments(x, ws, split=True)
            fused = op._launch_segments(x, ws, split=False)
            for s, f, w in zip(split, fused, ws, strict=True):
                assert s.shape == (m, w.shape[0]) and torch.equal(s, f), (m, k)
                assert torch.equal(s, op._launch_linear(x, w, None, dtype, split=False)), (m, k)


def test_split_is_chosen_by_shape():
    """One M tile (decode) of a layer linear splits; more rows, or an LM head's many N tiles, run fused; ``split``
    forces either."""
    assert op._use_split(1, 1024, None) and op._use_split(K.MM_SPLIT_MAX_M, 3072, None)
    assert not op._use_split(K.MM_SPLIT_MAX_M + 1, 1024, None)
    assert not op._use_split(1, 151_936, None)  # the LM head: 2,374 N tiles of 64
    assert op._use_split(1000, 1024, True) and not op._use_split(1, 1024, False)
