"""The native engine with the Triton decode attention (``decode_attention="triton"``) vs the bmm path.

A tiny random Qwen3 (fp32), prompts of different lengths and more requests than slots, so rows in a
step have different lengths and slots are reused; both the fused decode layer (HF model, our dense
Qwen3) and the submodule path (what MoE models take; here our Qwen3 with the fused path switched off) are covered,
each over the slot and the paged KV cache. CPU: Triton under the interpreter (~15 s); with a GPU
the same test runs on CUDA (compiled decode layer, CUDA graphs, IEEE fp32 dots in the kernel).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from prime_spmd.inference import runner as runner_mod
from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.models.tiny import build_tiny_model, tiny_qwen3_config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# max |triton - bmm| logprob, fp32: measured 2.6e-6 (fused) and 3.6e-6 (submodules) on CPU: sums in another order
LOGPROB_ATOL = 1e-4
PROMPT_LENS = [3, 17, 9, 30, 1]


def _requests(vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(PROMPT_LENS):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        temp = 0.0 if i % 2 == 0 else 1.0  # greedy and seeded samples in the same batch
        sp = SamplingParams(temperature=temp, max_tokens=6 + 3 * i, ignore_eos=True, seed=i)
        out.append(Request(prompt_ids=ids, sampling=sp, request_id=i))
    return out


def _hf_model():
    cfg = tiny_qwen3_config("qwen3-nano", vocab_size=97, initializer_range=0.3)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _generate(model, attention: str, kv_cache: str = "slot", **kw):
    eng = NativeEngine(
        model, None, max_batch_size=3, max_model_len=64, device=DEVICE, decode_attention=attention, kv_cache=kv_cache,
        kv_block_size=5,  # paged: blocks straddle the kernel's position tiles (16 under the interpreter)
        **kw,
    )  # fmt: skip
    assert isinstance(eng.runner, runner_mod.LlamaStyleRunner)
    # "triton_qkv" needs the decode layer function; the submodule path runs "triton" for it
    assert eng.runner.attention == (
        attention if eng.runner.layer_args is not None else attention.replace("triton_qkv", "triton")
    )
    outs = sorted(eng.generate(_requests(eng.vocab_size)), key=lambda o: o.request_id)
    return eng, outs


def _compare(model, kv_cache: str, attention: str = "triton") -> tuple[NativeEngine, float]:
    """(the ``attention`` engine over ``kv_cache``, max |logprob diff| vs the bmm engine over the slot cache) after
    asserting equal tokens."""
    _, ref = _generate(model, "bmm")
    eng, got = _generate(model, attention, kv_cache)
    worst = 0.0
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids, a.request_id
        worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)))
    assert worst < LOGPROB_ATOL, worst
    return eng, worst


@pytest.mark.parametrize(("attention", "kv_cache"), [("triton", "slot"), ("triton", "paged"), ("triton_qkv", "slot"),
                                                      ("triton_qkv", "paged")])  # fmt: skip
def test_fused_decode_layer_triton_matches_bmm(record_property, attention, kv_cache):
    eng, worst = _compare(_hf_model(), kv_cache, attention)
    assert eng.runner.layer_args is not None  # the fused path
    record_property("max_logprob_diff", worst)


@pytest.mark.parametrize("kv_cache", ["slot", "paged"])
def test_submodule_decode_triton_matches_bmm(tmp_path, monkeypatch, record_property, kv_cache):
    from prime_spmd.config.sections import ModelConfig
    from prime_spmd.models.loading import load_model
    from prime_spmd.models.qwen3.adapter import Qwen3Adapter

    path = build_tiny_model(tmp_path / "m", "qwen3-nano", seed=0, initializer_range=0.3)
    custom = load_model(ModelConfig(path=str(path), impl="custom"), DEVICE, dtype=torch.float32)
    monkeypatch.setattr(Qwen3Adapter, "supports_fused_decode", lambda self: False)  # the MoE models' path
    eng, worst = _compare(custom, kv_cache)
    assert eng.runner.layer_args is None  # the submodule path
    record_property("max_logprob_diff", worst)


def test_unknown_attention_raises():
    with pytest.raises(ValueError, match="decode attention 'sdpa'"):
        NativeEngine(_hf_model(), None, max_batch_size=1, max_model_len=16, device="cpu", decode_attention="sdpa")


def test_auto_is_fused_on_cuda_bmm_elsewhere():
    assert runner_mod.resolve_decode_attention("auto", torch.device("cuda")) == "triton_qkv"
    assert runner_mod.resolve_decode_attention("auto", torch.device("cpu")) == "bmm"
    assert runner_mod.resolve_decode_attention("bmm", torch.device("cuda")) == "bmm"
    eng = NativeEngine(_hf_model(), None, max_batch_size=1, max_model_len=16, device="cpu")  # default: auto
    assert eng.runner.attention == "bmm"


def test_pdl_samples_the_same_tokens():
    """Programmatic dependent launch (kernels/pdl) changes when kernels start, not what they compute: the fused
    chain (decode linears, fused attention) samples the same tokens with it. CPU: it stays off (the interpreter
    cannot run it), which is all this checks there."""
    from prime_spmd.kernels.pdl import launch as pdl

    model = _hf_model()
    if DEVICE.type != "cuda":
        eng = NativeEngine(model, None, max_batch_size=3, max_model_len=64, device=DEVICE, pdl=True)
        assert not eng.pdl and not pdl.enabled()
        return
    _, ref = _generate(model, "triton_qkv", decode_linear="triton")
    try:
        eng, got = _generate(model, "triton_qkv", decode_linear="triton", pdl=True)
        assert eng.pdl and pdl.enabled() and pdl.prefetch_enabled()  # the weight rows prefetched before the wait
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    finally:
        pdl.set_enabled(False)  # process-wide: later tests launch without it


def test_bulk_prefetch_alignment_rules():
    """The decode linears prefetch weight rows with cp.async.bulk.prefetch.L2 only where its 16-byte rules hold."""
    from prime_spmd.kernels.pdl.launch import bulk_prefetchable

    w = torch.zeros(64, 1032, dtype=torch.bfloat16)
    assert bulk_prefetchable(w, w.stride(0), 1024, 256)  # 2064-byte rows, 512-byte splits
    assert not bulk_prefetchable(w, w.stride(0), 1020)  # 2040-byte rows
    assert not bulk_prefetchable(w, 1028)  # a row stride of 2056 bytes
    assert not bulk_prefetchable(w[:, 1:], w.stride(0), 1024)  # starts 2 bytes into the allocation
    assert bulk_prefetchable(torch.zeros(8, 12), 12, 12)  # fp32: 48-byte rows


def test_fused_attention_on_a_model_without_qk_norm():
    """Llama has no q/k norm: the fused attention's QK_NORM=False path (RoPE only) gives the bmm path's tokens."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _, ref = _generate(model, "bmm")
    eng, got = _generate(model, "triton_qkv")
    assert eng.runner.layer_args is not None and not eng.runner.qk_norm
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    worst = max(abs(x - y) for a, b in zip(got, ref) for x, y in zip(a.logprobs, b.logprobs))
    assert worst < LOGPROB_ATOL, worst
