"""Gumbel-max sampling: the Triton kernels vs the PyTorch reference (tokens and logprobs), ties, opcheck, and on
CUDA compile + CUDA-graph capture. CPU runs Triton under TRITON_INTERPRET=1 (tests/conftest.py) with 64-wide tiles
in up to 3 vocab chunks per row, so the small vocabularies below still cover several tiles, chunks and ragged tails.
"""

from __future__ import annotations

import pytest
import torch
from prime_spmd.kernels.gumbel_sample.op import gumbel_sample, gumbel_sample_lm_head

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
# max |kernel - reference| logprob: interpreter 6.0e-7 (2026-12-04), one summation order against another over
# <= 1000 terms; the kernel's exp/log on the GPU are a few ulps off libm's
LOGPROB_ATOL = 5e-6


def _inputs(b: int, v: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=gen) * 3
    temp = torch.tensor([[1.0, 0.0, 0.7, 1.3][i % 4] for i in range(b)], dtype=torch.float32)
    seeds = torch.randint(0, 2**62, (b,), generator=gen)
    steps = torch.randint(0, 1000, (b,), generator=gen)
    return [t.to(device) for t in (logits, temp, seeds, steps)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,v", [(1, 200), (9, 1000), (33, 130)])
def test_kernel_matches_reference(device, b, v) -> None:
    args = _inputs(b, v, device, seed=b + v)
    ref_tok, ref_lp = gumbel_sample(*args, impl="reference")
    tok, lp = gumbel_sample(*args, impl="triton")
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert tok.tolist() == ref_tok.tolist()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_go_to_the_lowest_index_and_many_samples_agree(device) -> None:
    # greedy rows whose maximum appears twice: in one tile, across tiles and across vocab chunks
    logits = torch.zeros(3, 400)
    logits[0, [5, 9]] = 4.0
    logits[1, [70, 150]] = 4.0
    logits[2, [390, 130]] = 4.0
    zero = torch.zeros(3, dtype=torch.int64, device=device)
    tok, _ = gumbel_sample(logits.to(device), torch.zeros(3, device=device), zero, zero, impl="triton")
    assert tok.tolist() == [5, 70, 130]  # same tile; tiles 1 and 2 of chunk 0; chunks 0 and 2
    # 256 sampled rows of one distribution (different seeds): every token as the reference draws it
    logits, temp, seeds, steps = _inputs(256, 300, device, seed=7)
    logits, temp = logits[:1].expand(256, -1).contiguous(), torch.ones_like(temp)
    ref_tok, _ = gumbel_sample(logits, temp, seeds, steps, impl="reference")
    tok, _ = gumbel_sample(logits, temp, seeds, steps, impl="triton")
    assert tok.tolist() == ref_tok.tolist() and len(set(tok.tolist())) > 20


@pytest.mark.parametrize("device", DEVICES)
def test_strided_row_parameters(device) -> None:
    # the engine passes columns of [B, 3] tables (temperature, top-p, min-p; top-k, seed, step)
    logits, temp, seeds, steps = _inputs(6, 300, device, seed=11)
    floats = torch.stack([temp, torch.ones_like(temp), torch.zeros_like(temp)], dim=1)
    ints = torch.stack([torch.zeros_like(seeds), seeds, steps], dim=1)
    strided = (logits, floats[:, 0], ints[:, 1], ints[:, 2])
    assert strided[1].stride(0) == 3
    ref_tok, ref_lp = gumbel_sample(logits, temp, seeds, steps, impl="reference")
    tok, lp = gumbel_sample(*strided, impl="triton")
    assert tok.tolist() == ref_tok.tolist()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,v,d,dtype", [(1, 300, 32, torch.float32), (5, 1000, 80, torch.float32),
                                         (20, 257, 48, torch.bfloat16), (64, 130, 16, torch.float32)])  # fmt: skip
def test_lm_head_kernel_matches_reference(device, b, v, d, dtype) -> None:
    # the logits computed inside the kernel, tile by tile (CPU: 16 x 32 tiles, so D and V are ragged)
    _, temp, seeds, steps = _inputs(b, v, device, seed=b + d)
    gen = torch.Generator().manual_seed(d)
    hidden = torch.randn(b, d, generator=gen).to(device, dtype)
    weight = (torch.randn(v, d, generator=gen) * 0.5).to(device, dtype)
    ref_tok, ref_lp = gumbel_sample_lm_head(hidden, weight, temp, seeds, steps, impl="reference")
    tok, lp = gumbel_sample_lm_head(hidden, weight, temp, seeds, steps, impl="triton")
    assert tok.tolist() == ref_tok.tolist()
    # fp32 logits summed over D in another order: interpreter 3.8e-6 at D = 80 (logits of size ~5), 2026-12-04
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device) -> None:
    args = _inputs(4, 150, device)
    torch.library.opcheck(torch.ops.prime_spmd.gumbel_sample.default, tuple(args))
    hidden, weight = torch.randn(4, 32, device=device), torch.randn(150, 32, device=device)
    torch.library.opcheck(torch.ops.prime_spmd.gumbel_sample_lm_head.default, (hidden, weight, *args[1:]))


def test_bad_inputs_are_named() -> None:
    logits, temp, seeds, steps = _inputs(2, 10, "cpu")
    with pytest.raises(ValueError, match="seeds must be torch.int64"):
        gumbel_sample(logits, temp, seeds.int(), steps, impl="triton")
    with pytest.raises(ValueError, match="unknown gumbel sample impl"):
        gumbel_sample(logits, temp, seeds, steps, impl="cuda")
    with pytest.raises(ValueError, match="weight"):
        gumbel_sample_lm_head(torch.randn(2, 8), torch.randn(10, 9), temp, seeds, steps, impl="triton")
    with pytest.raises(ValueError, match="at most 64 rows"):
        rows = _inputs(65, 10, "cpu")[1:]
        gumbel_sample_lm_head(torch.randn(65, 8), torch.randn(10, 8), *rows, impl="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture")
def test_compiled_and_captured_on_cuda() -> None:
    args = _inputs(64, 151_936, "cuda", seed=3)
    ref_tok, ref_lp = gumbel_sample(*args, impl="reference")
    fn = torch.compile(lambda *a: gumbel_sample(*a, impl="triton"), fullgraph=True)
    fn(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tok, lp = fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    # a real-size vocab: the GPU's exp/log differ from libm's in the last bits, which can flip a near-tie
    assert (tok == ref_tok).float().mean().item() >= 63 / 64
    torch.testing.assert_close(lp[tok == ref_tok], ref_lp[tok == ref_tok], rtol=0, atol=LOGPROB_ATOL)
    # the LM head inside the kernel, Qwen3-0.6B's head in bf16
    hidden = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(151_936, 1024, device="cuda", dtype=torch.bfloat16) * 0.05
    ref_tok, ref_lp = gumbel_sample_lm_head(hidden, weight, *args[1:], impl="reference")
    fn = torch.compile(lambda *a: gumbel_sample_lm_head(*a, impl="triton"), fullgraph=True)
    fn(hidden, weight, *args[1:])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tok, lp = fn(hidden, weight, *args[1:])
    graph.replay()
    torch.cuda.synchronize()
    same = tok == ref_tok  # bf16 products summed in fp32 in another order than cuBLAS's
    assert same.float().mean().item() >= 62 / 64
    torch.testing.assert_close(lp[same], ref_lp[same], rtol=0, atol=1e-4)


def test_lm_head_programs_per_sm(monkeypatch) -> None:
    """The fused LM-head sampler's programs per SM (``LM_HEAD_PROGRAMS_PER_SM``): on a GPU the same samples at 1 and 2
    (chunking changes only how exact maxima are merged; the interpreter takes <= 3 chunks either way)."""
    from prime_spmd.kernels.gumbel_sample import kernel

    gen = torch.Generator().manual_seed(4)
    h = torch.randn(2, 48, generator=gen).to(DEVICES[0])
    w = (torch.randn(300, 48, generator=gen) * 0.3).to(DEVICES[0])
    temp, seeds, steps = torch.ones(2), torch.tensor([3, 9]), torch.tensor([0, 5])
    temp, seeds, steps = (t.to(DEVICES[0]) for t in (temp, seeds, steps))
    outs = []
    for n in (1, 2):
        monkeypatch.setattr(kernel, "LM_HEAD_PROGRAMS_PER_SM", n)
        outs.append(gumbel_sample_lm_head(h, w, temp, seeds, steps)[0])
    assert torch.equal(outs[0], outs[1])
