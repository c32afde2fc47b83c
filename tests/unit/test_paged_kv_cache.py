"""The paged KV cache (``--inference.native.kv_cache paged``): the native engine samples the slot cache's tokens and
logprobs through it, GRPO groups share their prompt's blocks (memory counted), a small pool makes admission wait
and frees every block at the end, the allocator's bookkeeping, and the fused layer over the pool through
torch.compile. Tiny fp32 Qwen3 on CPU (bmm attention, the fused decode layer uncompiled; the submodule path by
monkeypatch); with a GPU the engine tests run there. About 20 s on 2 cores with a cold compile cache."""

from __future__ import annotations

import pytest
import torch

from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.kv_cache import PagedKVCache
from prime_spmd.inference.native import NativeEngine
from prime_spmd.models.hf_adapter import HFAdapter
from tests.unit.test_native_engine import TEXTS, _engine, _load, _reqs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from prime_spmd.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("nano"), "qwen3-nano", seed=0, initializer_range=0.3)


def _outputs(eng: NativeEngine, tok, sp: SamplingParams, texts: list[str]) -> tuple[list, list]:
    reqs = _reqs(tok, sp, texts, seed0=40)
    reqs[3].sampling.max_tokens = 3  # ends early: its slot and blocks are refilled mid-flight
    outs = eng.generate(reqs)
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


GROUPS = [TEXTS[0]] * 4 + [TEXTS[2]] * 3 + [TEXTS[4]] + TEXTS


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """On CUDA every engine compiles the same decode-layer code object; several engines (slot, paged at three block
    sizes) pass Dynamo's per-code-object recompile limit (8) together (test_native_decode_linear.py does the same)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("path", ["fused", "submodules"])
def test_paged_engine_samples_the_slot_engines_tokens(model_dir, device, monkeypatch, path):
    if path == "submodules":  # the MoE models' path: the model's own modules around our attention
        monkeypatch.setattr(HFAdapter, "supports_fused_decode", lambda self: False)
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    slot, _, tok = _engine(model_dir, device, max_batch_size=4)
    want = _outputs(slot, tok, sp, GROUPS)
    # block sizes: 4 (several blocks a prompt, partial last blocks), 5 (not a power of two), 64 (one block a slot)
    for block_size in (4, 5, 64):
        torch._dynamo.reset()
        paged, _, _ = _engine(model_dir, device, max_batch_size=4, kv_cache="paged", kv_block_size=block_size)
        assert (paged.runner.layer_args is not None) == (path == "fused")
        got = _outputs(paged, tok, sp, GROUPS)
        assert got[0] == want[0], block_size
        # CPU: the same gathered K/V in the same order, so equal logprobs (measured 0.0)
        atol = 0.0 if device.type == "cpu" else 1e-5
        assert torch.allclose(torch.tensor(sum(got[1], [])), torch.tensor(sum(want[1], [])), atol=atol), block_size
        assert paged.kv_cache_stats()["kv_blocks_in_use"] == 0  # every block back in the pool


def test_groups_share_their_prompt_blocks(model_dir, device):
    # 2 groups of 4 samples, prompts of 20 and 13 tokens, block size 4, 6 new tokens each
    tok = _load(model_dir)[1]
    prompts = [list(range(3, 23)), list(range(30, 43))]
    sp = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    reqs = [Request(prompt_ids=p, sampling=sp, request_id=f"{i}-{k}") for i, p in enumerate(prompts) for k in range(4)]

    def peak_blocks(share: bool) -> int:
        eng, _, _ = _engine(model_dir, device, max_batch_size=8, kv_cache="paged", kv_block_size=4, share_prefill=share)
        eng.generate([Request(prompt_ids=r.prompt_ids, sampling=sp, request_id=r.request_id) for r in reqs])
        return eng.kv_cache_stats()["kv_peak_blocks_in_use"]

    # a sample holds ceil((prompt + 6) / 4) blocks: 7 (26 positions) and 5 (19); shared, the 3 others of a group
    # skip the prompt's whole blocks: 20 // 4 = 5 and 13 // 4 = 3
    assert peak_blocks(False) == 4 * 7 + 4 * 5
    assert peak_blocks(True) == (7 + 3 * (7 - 5)) + (5 + 3 * (5 - 3))
    assert tok is not None


def test_a_small_pool_makes_admission_wait(model_dir, device):
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    slot, _, tok = _engine(model_dir, device, max_batch_size=8)
    want = _outputs(slot, tok, sp, GROUPS)
    # 12 blocks of 4 positions: fewer than 8 slots' worth of sequences (a sample of TEXTS[2] + 12 tokens holds 5-6)
    paged, _, _ = _engine(model_dir, device, max_batch_size=8, kv_cache="paged", kv_block_size=4, kv_cache_tokens=48)
    got = _outputs(paged, tok, sp, GROUPS)
    assert got[0] == want[0]
    stats = paged.kv_cache_stats()
    assert stats["kv_blocks"] == 12 and stats["kv_peak_blocks_in_use"] <= 12 and stats["kv_blocks_in_use"] == 0
    big = Request(prompt_ids=tok.encode(TEXTS[2]), sampling=SamplingParams(max_tokens=60), request_id="big")
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        paged.add_request(big)


def test_allocator_bookkeeping():
    cache = PagedKVCache(
        num_layers=2, num_slots=3, max_len=20, num_kv_heads=1, head_dim=2, dtype=torch.float32,
        device=torch.device("cpu"), block_size=4, num_tokens=36,  # 9 blocks
    )  # fmt: skip
    assert cache.blocks_per_slot == 5 and cache.k.shape == (2, 10, 1, 4, 2) and cache.num_free_blocks == 9
    cache.reserve(0, 11)  # 3 blocks
    cache.reserve(1, 14, share_slot=0, num_shared=10)  # shares 2 whole blocks, 2 of its own
    assert cache.blocks_for(14, 10) == 2 and cache.num_blocks_in_use == 5
    cache.sync()
    t = cache.block_table
    assert t[1, :2].tolist() == t[0, :2].tolist() and t[1, 2] not in t[0].tolist() and t[2].tolist() == [0] * 5
    # positions 8-9 of the prompt sit in slot 0's third block: copy_prefix copies them into slot 1's
    cache.k[:, t[0, 2]] = 7.0
    cache.copy_prefix([0], [1], 10)
    assert (cache.k[:, t[1, 2], :, :2] == 7.0).all() and (cache.k[:, t[1, 2], :, 2:] == 0.0).all()
    # a prefill of 8 positions into slot 2 (no blocks): everything lands in the scratch block 0
    cache.write_prefill(0, torch.tensor([2]), torch.ones(1, 1, 8, 2), torch.ones(1, 1, 8, 2))
    assert cache.k[0, 1:].eq(1.0).sum() == 0 and cache.k[0, 0].eq(1.0).all()
    cache.release(0)  # the shared blocks stay with slot 1
    assert cache.num_blocks_in_use == 4
    cache.release(1)
    cache.sync()
    assert cache.num_free_blocks == 9 and cache.block_table.eq(0).all() and cache.peak_blocks_in_use == 5


def test_kv_cache_options_are_checked():
    from prime_spmd.config.sections import InferenceConfig, NativeEngineConfig

    with pytest.raises(ValueError, match="inference.native.kv_cache_tokens"):
        NativeEngineConfig(kv_cache_tokens=64)  # a pool size for the slot cache
    with pytest.raises(ValueError, match="inference.native.kv_block_size"):
        NativeEngineConfig(kv_cache="paged", kv_block_size=0)
    # the native engine's settings live in their own section, which the vLLM engine never reads
    assert InferenceConfig(engine="vllm").native == NativeEngineConfig()


@pytest.mark.parametrize("attention", ["bmm", "triton_qkv"])
def test_compiled_fused_layer_reads_and_writes_the_paged_cache(attention, device):
    """The fused decode layer over a paged pool, through torch.compile (inductor; on CPU in CI, so that a tracing
    problem of the paged writes and gathers shows before a GPU run; on the GPU there) equals the eager layer: output
    and the pool. About 6 s on 2 cores."""
    from prime_spmd.inference.runner import make_decode_layer

    g = torch.Generator().manual_seed(0)
    N, Nkv, Dh, D, inter, B, Sb, Nb, Mb = 4, 2, 16, 64, 96, 3, 4, 32, 8

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    weights = (rand(D), rand((N + 2 * Nkv) * Dh, D, scale=0.1), None, rand(Dh), rand(Dh), rand(D, N * Dh, scale=0.1),
               None, rand(D), rand(2 * inter, D, scale=0.1), rand(D, inter, scale=0.1))  # fmt: skip
    table = (torch.randperm(Nb - 1, generator=g)[: B * Mb].view(B, Mb) + 1).int().to(device)  # scrambled, no block 0
    pos = torch.tensor([3, 9, 30], device=device)
    mask = torch.zeros(B, 32, device=device).masked_fill(
        torch.arange(32, device=device)[None, :] > pos[:, None], float("-inf")
    )
    cos, sin = rand(B, Dh), rand(B, Dh)
    pools = [(rand(Nb, Nkv, Sb, Dh), rand(Nb, Nkv, Sb, Dh))] * 2
    pools[1] = (pools[0][0].clone(), pools[0][1].clone())
    before = pools[0][0].clone()
    layer = make_decode_layer(N, Nkv, Dh, 1e-6, Dh**-0.5, attention, "torch")
    if attention == "triton_qkv":  # the Triton kernel (interpreter) as an opaque, cache-mutating op inside the graph
        import prime_spmd.kernels.decode_attention.op  # noqa: F401

        mask, lens, kv_len = None, pos + 1, 32
    else:
        lens, kv_len = None, 0
    x = rand(B, D)
    outs = [
        fn(x, *weights, k, v, table, cos, sin, pos, mask, lens, kv_len)
        for fn, (k, v) in zip((layer, torch.compile(layer, fullgraph=True)), pools)
    ]
    # measured: outputs 3.6e-7 apart, pools 1.8e-7 (inductor's fused norm / RoPE round differently)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pools[1][0], pools[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pools[1][1], pools[0][1], atol=1e-5, rtol=1e-5)
    assert not torch.equal(pools[0][0], before)  # the layer wrote the pool (else the pool checks prove nothing)


def test_warmup_writes_only_the_scratch_block(model_dir, device):
    """Warm-up decodes every bucket with every slot free: with the paged cache all of it lands in block 0, the pool's
    blocks stay untouched and free, and the warmed engine samples the cold slot engine's tokens."""
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    slot, _, tok = _engine(model_dir, device, max_batch_size=4)
    want = _outputs(slot, tok, sp, GROUPS)
    paged, _, _ = _engine(model_dir, device, max_batch_size=4, kv_cache="paged", kv_block_size=4)
    cache = paged.runner.cache
    before = cache.k[:, 1:].clone(), cache.v[:, 1:].clone()
    assert paged.warmup() > 0
    assert torch.equal(cache.k[:, 1:], before[0]) and torch.equal(cache.v[:, 1:], before[1])
    assert not torch.equal(cache.k[:, 0], torch.zeros_like(cache.k[:, 0]))  # the warm-up did write (to scratch)
    assert paged.kv_cache_stats()["kv_blocks_in_use"] == 0
    assert _outputs(paged, tok, sp, GROUPS)[0] == want[0]
