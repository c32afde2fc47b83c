"""The native engine with ``decode_chain=True`` (kernels/decode_chain: one-row decode steps in one launch) vs the
per-kernel fused decode layer it replaces, on tiny random fp32 models: an HF Qwen3 (q/k norms) and an HF Llama with
attention_bias (QKV and O biases). One slot (every decode step has one row, so every step is the chain's) and three
slots (steps of 2-3 rows take the per-kernel path, steps of one row the chain), greedy and seeded rows.
CPU: Triton under the interpreter; with a GPU the same tests run compiled, with CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from tests.unit.test_native_decode_linear import _model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# max |chain - per-kernel| logprob, fp32: the chain's GEMV sums each column's K in one reduction, the per-kernel
# GEMV in chunks (another order)
LOGPROB_ATOL = 1e-4


@pytest.fixture(autouse=True)
def _big_interpreter_items(monkeypatch):
    """CPU: larger chain items and GEMV programs than the kernel tests use (those cover item edges): the interpreter
    pays per program, and both paths here are ~10x faster so."""
    if DEVICE.type == "cpu":
        from prime_spmd.kernels.decode_chain import kernel as chain
        from prime_spmd.kernels.decode_linear import kernel as linear

        monkeypatch.setattr(chain, "INTERPRET_SLAB_BYTES", 16384)
        monkeypatch.setattr(linear, "gemv_config", lambda no, k, silu_mul: ("gemv", 64, 64, 4))


def _requests(n: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(0, 97, (3 + 7 * i,), generator=g).tolist()
        sp = SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, max_tokens=3 + 2 * i, ignore_eos=True, seed=i)
        out.append(Request(prompt_ids=ids, sampling=sp, request_id=i))
    return out


def _generate(model, chain: bool, slots: int, n: int):
    eng = NativeEngine(model, None, max_batch_size=slots, max_model_len=64, device=DEVICE, decode_attention="fused",
                       decode_linear="triton", decode_chain=chain)  # fmt: skip
    assert (eng.runner.chain is not None) == chain
    return sorted(eng.generate(_requests(n)), key=lambda o: o.request_id)


@pytest.fixture
def chain_calls(monkeypatch):
    """Rows of each decode-chain call (CPU runs the decode step eagerly; CUDA replays its graphs)."""
    from prime_spmd.kernels.decode_chain.kernel import DecodeChain

    calls, real = [], DecodeChain.__call__

    def counting(self, cos, sin, pos, lens, kv_len):
        calls.append(pos.shape[0])
        return real(self, cos, sin, pos, lens, kv_len)

    monkeypatch.setattr(DecodeChain, "__call__", counting)
    return calls


@pytest.mark.parametrize("kind,slots,n", [("qwen3", 1, 2), ("llama_bias", 1, 2), ("llama_bias", 3, 4)])
def test_chain_matches_the_per_kernel_path(kind, slots, n, chain_calls):
    model = _model(kind)
    ref = _generate(model, False, slots, n)
    got = _generate(model, True, slots, n)
    assert set(chain_calls) == ({1} if DEVICE.type == "cpu" else set(chain_calls)), chain_calls
    worst = 0.0
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids, a.request_id
        worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)))
    assert worst < LOGPROB_ATOL, worst


def test_chain_needs_the_fused_triton_path():
    with pytest.raises(ValueError, match=r"decode attention 'bmm' \(want 'fused'\).*decode linear 'torch'"):
        NativeEngine(_model("qwen3"), None, max_batch_size=1, max_model_len=16, device="cpu", decode_chain=True)
    with pytest.raises(ValueError, match=r"KV cache 'paged'"):
        NativeEngine(_model("qwen3"), None, max_batch_size=1, max_model_len=16, device="cpu", decode_chain=True,
                     decode_attention="fused", decode_linear="triton", kv_cache="paged")  # fmt: skip


@pytest.mark.parametrize("kind", ["qwen3", "llama_bias"])
def test_fused_prefill_matches_the_module_prefill(kind):
    """``fused_prefill``: the pure prefill layer (fused QKV / gate-up weights; compiled on CUDA) gives the module
    path's tokens and logprobs (bmm attention, torch linears: nothing else differs)."""
    model = _model(kind)
    outs = []
    for fused in (False, True):
        eng = NativeEngine(model, None, max_batch_size=3, max_model_len=64, device=DEVICE, fused_prefill=fused)
        assert (eng.runner.prefill_layer is not None) == fused
        outs.append(sorted(eng.generate(_requests(4)), key=lambda o: o.request_id))
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids, a.request_id
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGPROB_ATOL


def test_fused_prefill_needs_a_dense_llama_style_model():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    with pytest.raises(ValueError, match="fused_prefill need.* Llama-style decoder"):
        NativeEngine(AutoModelForCausalLM.from_config(cfg), None, max_batch_size=1, max_model_len=16, device="cpu",
                     fused_prefill=True)  # fmt: skip
    # the default (auto, None) takes the model's modules where the fused layer cannot run, without an error
    eng = NativeEngine(AutoModelForCausalLM.from_config(cfg), None, max_batch_size=1, max_model_len=16, device=DEVICE)
    assert getattr(eng.runner, "prefill_layer", None) is None


def test_fused_prefill_auto_is_on_for_cuda_only():
    """The default (``--inference.fused_prefill auto``): the fused prefill on CUDA, the model's modules elsewhere."""
    eng = NativeEngine(_model("qwen3"), None, max_batch_size=1, max_model_len=16, device=DEVICE)
    assert (eng.runner.prefill_layer is not None) == (DEVICE.type == "cuda")


def test_fused_prefill_choice_maps_the_flag():
    """``--inference.fused_prefill`` auto / on / off -> None / True / False; anything else is named in the error."""
    from prime_spmd.inference.runner import fused_prefill_choice

    assert [fused_prefill_choice(c) for c in ("auto", "on", "off")] == [None, True, False]
    with pytest.raises(ValueError, match="fused prefill 'yes': choose one of"):
        fused_prefill_choice("yes")
