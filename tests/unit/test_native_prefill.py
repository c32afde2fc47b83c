"""The native engine's prefill layer function (``prefill_layer_fn``: one pure layer function over packed QKV / gate-up weights,
compiled on CUDA) against the model's own modules, on tiny random fp32 models: an HF Qwen3 (q/k norms) and an HF
Llama with attention_bias (QKV and O biases). CPU runs it uncompiled; with a GPU the same tests run compiled.
"""

from __future__ import annotations

import pytest
import torch

from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from tests.unit.test_native_decode_linear import _model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# max |fused - module| logprob, fp32: the fused QKV / gate-up GEMMs sum in another order than the separate ones
LOGPROB_ATOL = 1e-4


def _requests(n: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(0, 97, (3 + 7 * i,), generator=g).tolist()
        sp = SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, max_tokens=3 + 2 * i, ignore_eos=True, seed=i)
        out.append(Request(prompt_ids=ids, sampling=sp, request_id=i))
    return out


@pytest.mark.parametrize("kind", ["qwen3", "llama_bias"])
def test_prefill_layer_fn_matches_the_module_prefill(kind):
    """``prefill_layer_fn``: the pure prefill layer (packed QKV / gate-up weights; compiled on CUDA) gives the module
    path's tokens and logprobs (bmm attention, torch linears: nothing else differs)."""
    model = _model(kind)
    outs = []
    for fused in (False, True):
        eng = NativeEngine(model, None, max_batch_size=3, max_model_len=64, device=DEVICE, prefill_layer_fn=fused)
        assert (eng.runner.prefill_layer is not None) == fused
        outs.append(sorted(eng.generate(_requests(4)), key=lambda o: o.request_id))
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids, a.request_id
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGPROB_ATOL


def test_prefill_layer_fn_needs_a_dense_llama_style_model():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    with pytest.raises(ValueError, match="prefill layer_fn need.* Llama-style decoder"):
        NativeEngine(AutoModelForCausalLM.from_config(cfg), None, max_batch_size=1, max_model_len=16, device="cpu",
                     prefill_layer_fn=True)  # fmt: skip
    # the default (auto, None) takes the model's modules where the fused layer cannot run, without an error
    eng = NativeEngine(AutoModelForCausalLM.from_config(cfg), None, max_batch_size=1, max_model_len=16, device=DEVICE)
    assert getattr(eng.runner, "prefill_layer", None) is None


def test_prefill_auto_is_the_layer_fn_on_cuda_only():
    """The default (``--inference.native.prefill auto``): the layer function on CUDA, the model's modules elsewhere."""
    eng = NativeEngine(_model("qwen3"), None, max_batch_size=1, max_model_len=16, device=DEVICE)
    assert (eng.runner.prefill_layer is not None) == (DEVICE.type == "cuda")


def test_prefill_choice_maps_the_flag():
    """``--inference.native.prefill`` auto / layer_fn / modules -> None / True / False; anything else is named in the error."""
    from prime_spmd.inference.runner import prefill_choice

    assert [prefill_choice(c) for c in ("auto", "layer_fn", "modules")] == [None, True, False]
    with pytest.raises(ValueError, match="prefill 'yes': choose one of"):
        prefill_choice("yes")
