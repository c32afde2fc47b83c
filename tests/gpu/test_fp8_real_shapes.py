"""``--inference.quantization fp8`` on CUDA (compute capability >= 8.9): the quantize kernel, the FP8 decode linears
and the prefill GEMM at the Qwen3-0.6B / 8B layer shapes in bf16, and the engine with CUDA graphs: a weight sync
re-quantizes into the buffers the captured graphs read. Tiny shapes and the interpreter: tests/kernels/test_fp8.py,
tests/unit/test_fp8_engine.py.
"""

from __future__ import annotations

import pytest
import torch
from prime_spmd.kernels.decode_linear.reference import finish_output, norm_input
from prime_spmd.kernels.fp8 import op
from prime_spmd.kernels.fp8.op import fp8_decode_linear, fp8_fused_linear, fp8_linear, quantize_fp8_
from prime_spmd.kernels.fp8.reference import (
    FP8_DTYPE,
    fp8_decode_linear_reference,
    fp8_scaled_mm_reference,
    quantize_fp8_reference,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs a GPU of sm >= 8.9"
    ),
]

# (K, N) of the decoder linears: qkv (N + 2 Nkv) Dh, o, gate/up 2I, down
SHAPES = {
    "qwen3-0.6b": [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)],
    "qwen3-8b": [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)],
}
CASES = [(name, k, n) for name, shapes in SHAPES.items() for k, n in shapes]


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()


@pytest.mark.parametrize("name,k,n", CASES)
def test_quantize_kernel_equals_the_reference(name, k, n):
    """Both round to nearest even on the GPU: bit-equal q and scales."""
    w = _weight(n, k)
    q = torch.empty(n, k, dtype=FP8_DTYPE, device="cuda")
    s = torch.empty(n, device="cuda")
    quantize_fp8_(w, q, s, impl="triton")
    q_ref, s_ref = quantize_fp8_reference(w)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("name,k,n", CASES)
@pytest.mark.parametrize("m", [1, 64])  # the GEMV and the tile kernel
def test_fp8_decode_linear_bf16_real_shapes(name, k, n, m, record_property):
    """bf16 outputs (norm prologue for the K = hidden linears, residual otherwise): the kernel's fp32 sum against the
    reference's fp32 matmul, one bf16 rounding each; max error recorded."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    q, s = quantize_fp8_reference(_weight(n, k))
    norm = torch.randn(k, device="cuda", generator=gen).bfloat16() if k == SHAPES[name][0][0] else None
    res = torch.randn(m, n, device="cuda", generator=gen).bfloat16() if norm is None else None
    got = fp8_decode_linear(x, q, s, None, norm, 1e-6, res, impl="triton").float()
    ref = fp8_decode_linear_reference(x, q, s, None, norm, 1e-6, res).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    record_property("rel_err", err)
    assert err < 2**-7, err  # one bf16 rounding flipped, at most (2^-8 relative), carried by the residual add


def _fused_case(name, k, n, m, seed=1):
    """x, q, s, norm (the K = hidden linears) or residual (the others) of one real-shape decode linear."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    q, s = quantize_fp8_reference(_weight(n, k))
    norm = torch.randn(k, device="cuda", generator=gen).bfloat16() if k == SHAPES[name][0][0] else None
    res = torch.randn(m, n, device="cuda", generator=gen).bfloat16() if norm is None else None
    return x, q, s, norm, res


@pytest.mark.parametrize("name,k,n", CASES)
@pytest.mark.parametrize("m", [16, 64])
def test_scaled_mm_tile_rows_real_shapes(name, k, n, m, record_property):
    """``fp8_fused_linear`` on its _scaled_mm path (TILE_ROWS_IMPL "scaled_mm") against the same norm / epilogue
    around ``fp8_scaled_mm_reference`` (x rounded to e4m3 per row, fp32 sums): one bf16 rounding each."""
    x, q, s, norm, res = _fused_case(name, k, n, m)
    got = fp8_fused_linear(x, q, s, None, norm, 1e-6, res, False, tile_rows="scaled_mm").float()
    ref = finish_output(fp8_scaled_mm_reference(norm_input(x, norm, 1e-6), q, s), "none", res).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    record_property("rel_err", err)
    assert err < 2**-7, err


@pytest.mark.parametrize("tile_rows", ["triton", "scaled_mm"])
def test_tile_rows_compiled_and_captured(tile_rows, monkeypatch):
    """The engine's dispatch (``quant.fused_linear``) with TILE_ROWS_IMPL set, inside torch.compile(fullgraph) and a
    CUDA graph: replaying on new inputs lands as near the fp32 result (no activation rounding) as the eager call on
    them (Qwen3-8B gate/up with SiLU-gate, 16 rows).

    Not equality with the eager call: on the scaled_mm path inductor fuses the RMSNorm into the activation quantize
    without the eager call's bf16 rounding between them, so some activations round to the neighbouring e4m3 value.
    At 4b65079 (H100) that put 251 of 196,608 outputs up to 0.22 from the eager call (max |out| ~10); the same
    shape on CPU: 258 up to 0.27, and 0 with inductor's ``emulate_precision_casts``, while compiled and eager
    stayed 0.45 / 0.44 from the fp32 result."""
    from prime_spmd.inference import quant

    monkeypatch.setattr(op, "TILE_ROWS_IMPL", tile_rows)
    x, q, s, norm, _ = _fused_case("qwen3-8b", 4096, 24576, 16)

    def step(x):
        return quant.fused_linear(x, (q, s), None, norm, 1e-6, None, True)

    fn = torch.compile(step, fullgraph=True, dynamic=False)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(static_x)  # compile and warm up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static_x)
    static_x.copy_(torch.randn_like(x))
    graph.replay()
    xf = static_x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.float()
    gate, up = torch.nn.functional.linear(normed, q.float() * s[:, None]).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    replay_err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    eager_err = ((step(static_x).float() - ref).abs().max() / ref.abs().max()).item()
    # a replay on the capture's stale input would be O(1) off; the eager call measured 0.44 / 13.4 on CPU
    assert replay_err <= 1.25 * eager_err + 2**-8, (replay_err, eager_err)


@pytest.mark.parametrize("impl", ["scaled_mm", "dequant"])
def test_prefill_gemm_near_the_reference(impl, record_property):
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(4, 256, 4096, device="cuda", generator=gen).bfloat16()
    q, s = quantize_fp8_reference(_weight(6144, 4096))
    ref = fp8_linear(x, q, s, impl="reference").float()
    got = fp8_linear(x, q, s, impl=impl).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    record_property("rel_err", err)
    assert err < (2**-3 if impl == "scaled_mm" else 2**-6), err  # scaled_mm also rounds x to e4m3 per row


@pytest.mark.parametrize("tile_rows", ["triton", "scaled_mm"])
def test_engine_with_cuda_graphs_follows_a_weight_sync(tile_rows, monkeypatch):
    """Greedy tokens of an FP8 engine (compiled, CUDA graphs) after loading another model's weights equal those of a
    fresh FP8 engine on that model: the re-quantize writes the buffers the captured graphs read. Both settings of
    TILE_ROWS_IMPL (steps of 2-4 rows run the tile kernel or _scaled_mm)."""
    monkeypatch.setattr(op, "TILE_ROWS_IMPL", tile_rows)
    from transformers import AutoModelForCausalLM

    from prime_spmd.inference.engine import Request, SamplingParams
    from prime_spmd.inference.native import NativeEngine
    from prime_spmd.models.tiny import tiny_qwen3_config

    def model(seed):
        torch.manual_seed(seed)
        cfg = tiny_qwen3_config("qwen3-1m", vocab_size=512, initializer_range=0.1)
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()

    def gen(eng):
        reqs = [Request(prompt_ids=list(range(5 + i, 20 + 3 * i)), request_id=i,
                        sampling=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) for i in range(4)]  # fmt: skip
        return [o.token_ids for o in sorted(eng.generate(reqs), key=lambda o: o.request_id)]

    torch._dynamo.reset()
    eng = NativeEngine(model(0), None, max_batch_size=4, max_model_len=128, quantization="fp8")
    assert eng.use_graphs and eng.runner.fp8 is not None and eng.runner.linear == "triton"
    before = gen(eng)
    other = model(1)
    eng.load_weights((n, p.detach()) for n, p in other.named_parameters())
    after = gen(eng)
    fresh = gen(NativeEngine(model(1), None, max_batch_size=4, max_model_len=128, quantization="fp8"))
    assert after == fresh and after != before


# ---- FP8 KV cache (--inference.kv_cache_dtype fp8) --------------------------------------------------------------
# Qwen3-8B's attention: 32 query heads, 8 kv heads, Dh 128; bf16 q, e4m3 K/V with a scale per (position, kv head).
# Not yet run on a GPU; the CPU interpreter measured 5.1e-3 / 6.4e-3 of max |ref| (tests/kernels/test_decode_attention_fp8.py)
KV_BF16_RTOL = 2e-2


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_kv_decode_attention_8b_shape(batch, paged, record_property):
    from prime_spmd.kernels.decode_attention.op import decode_attention, paged_decode_attention
    from prime_spmd.kernels.decode_attention.reference import quantize_kv

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, nkv, dh, tc, sb = 32, 8, 128, 2048, 16
    q = torch.randn(batch, n, dh, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(batch, nkv, tc, dh, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(batch, nkv, tc, dh, device="cuda", generator=gen).to(torch.bfloat16)
    (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    lens = torch.randint(1, tc + 1, (batch,), device="cuda", generator=gen)
    lens[0] = tc
    if paged:  # slot b's block m at a scrambled pool index
        mb = tc // sb
        perm = torch.randperm(batch * mb, device="cuda", generator=gen)
        table = perm.view(batch, mb).to(torch.int32)

        def pool(x):
            blocks = x.unflatten(2, (mb, sb)).transpose(1, 2).flatten(0, 1)
            out = torch.empty_like(blocks)
            out[perm] = blocks
            return out

        args = (q, pool(k8), pool(v8), table, lens, tc, dh**-0.5)
        ref = paged_decode_attention(*args, "reference", k_scale=pool(ks), v_scale=pool(vs))
        got = paged_decode_attention(*args, "triton", k_scale=pool(ks), v_scale=pool(vs))
    else:
        ref = decode_attention(q, k8, v8, lens, tc, dh**-0.5, "reference", k_scale=ks, v_scale=vs)
        got = decode_attention(q, k8, v8, lens, tc, dh**-0.5, "triton", k_scale=ks, v_scale=vs)
    rel = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    record_property("max_rel_err", rel)
    assert rel < KV_BF16_RTOL, rel


@pytest.mark.parametrize("kv_cache", ["slot", "paged"])
def test_engine_with_an_fp8_kv_cache_and_cuda_graphs(kv_cache, record_property):
    """bf16 engine (compiled, CUDA graphs) decoding from an FP8 cache: the triton attention (triton_qkv takes no
    float8 cache), sampled logprobs near the trainer's teacher-forced ones; with FP8 weights too."""
    from transformers import AutoModelForCausalLM

    from prime_spmd.inference.engine import Request, SamplingParams
    from prime_spmd.inference.logprobs import mismatch_stats, teacher_forced_logprobs
    from prime_spmd.inference.native import NativeEngine
    from prime_spmd.models.tiny import tiny_qwen3_config

    torch.manual_seed(0)
    cfg = tiny_qwen3_config("qwen3-1m", vocab_size=512, initializer_range=0.1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    reqs = [Request(prompt_ids=list(range(5 + i, 40 + 3 * i)), request_id=i,
                    sampling=SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=i)) for i in range(4)]  # fmt: skip
    seen = {}  # every run's (mean |diff|, KL), in the failure message
    # The FP8 cache alone is held to the CPU test's bounds. With FP8 weights too, the mismatch is mostly the weights'
    # and, on CUDA, the prefill's: `_scaled_mm` rounds the activations to e4m3 per row, which the CPU's reference GEMM
    # does not. H200, 090adcf: FP8 cache 2.6e-3 KL (CPU: 2.6e-3), FP8 weights + cache 0.174 / 2.4e-2, which the
    # old absolute bound (0.1 / 1e-2) failed. The same model on CPU (2026-12-06): weights alone 0.109 / 1.0e-2,
    # with the cache 0.117 / 1.1e-2; with the prefill forced to `_scaled_mm` 0.144 / 1.7e-2 and 0.154 / 1.9e-2. So
    # the run with both is held to the FP8-weights run (bf16 cache) plus the cache's own share.
    runs = (("auto", "none", True), ("fp8", "none", False), ("fp8", "none", True), ("auto", "fp8", True),
            ("fp8", "fp8", True))  # fmt: skip
    for kv_dtype, quantization, graphs in runs:
        torch._dynamo.reset()
        eng = NativeEngine(model, None, max_batch_size=4, max_model_len=128, kv_cache=kv_cache,
                           kv_cache_dtype=kv_dtype, quantization=quantization, cuda_graphs=graphs)  # fmt: skip
        outs = sorted(eng.generate(reqs), key=lambda o: o.request_id)
        trainer = torch.cat([teacher_forced_logprobs(model, r.prompt_ids, o.token_ids) for r, o in zip(reqs, outs)])
        stats = mismatch_stats(trainer.float().cpu(), torch.cat([torch.tensor(o.logprobs) for o in outs]))
        record_property(f"mismatch_kv_{kv_dtype}_weights_{quantization}_graphs_{graphs}", stats)
        seen[f"kv {kv_dtype}, weights {quantization}, graphs {graphs}"] = (stats["mean_abs_diff"], stats["mismatch_kl"])
        if kv_dtype == "auto" or not graphs:
            continue
        assert eng.use_graphs and eng.runner.attention == "triton" and eng.runner.cache.k.dtype == FP8_DTYPE
        # the CPU test's bounds (fp32 tiny model, initializer 0.3: 0.0715 / 5.2e-3 measured), over the bf16-cache run
        # of the same weights for FP8 weights
        base = (0.0, 0.0) if quantization == "none" else seen["kv auto, weights fp8, graphs True"]
        msg = "\n".join(f"{k}: {v[0]:.4f} / {v[1]:.2e}" for k, v in seen.items())
        assert stats["mean_abs_diff"] < base[0] + 0.1 and stats["mismatch_kl"] < base[1] + 1e-2, msg
