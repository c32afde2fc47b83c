"""``--inference.quantization fp8`` in the native engine (prime_spmd/inference/quant.py, kernels/fp8).

The reference path: the same engine unquantized on a model whose layer linears hold the dequantized FP8 values
(q * scale, exact in fp32). In fp32 the two differ only in where the scale multiplies (after the fp32 sum, or into each
weight), so tokens must match and logprobs agree to fp32 rounding. Both FP8 decode paths run: F.linear's place taken by
the upcast reference GEMM ("torch") and the FP8 Triton kernels ("triton", under the interpreter on CPU). Then: a
weight sync re-quantizes what it wrote, and the refusals name the flag.
"""

from __future__ import annotations

import pytest
import torch
from prime_spmd.kernels.fp8.reference import dequantize_fp8_reference, quantize_fp8_reference

from prime_spmd.inference import quant
from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.models.tiny import tiny_qwen3_config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# max |fp8 engine - reference engine| logprob, fp32 on CPU: one fp32 rounding order against another
LOGPROB_ATOL = 1e-4
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _big_interpreter_tiles(monkeypatch):
    """CPU: one or two programs per launch (the kernel tests cover tile edges: tests/kernels/test_fp8.py)."""
    if DEVICE.type == "cpu":
        from prime_spmd.kernels.decode_linear import kernel

        monkeypatch.setattr(kernel, "default_config", lambda m, no, k, silu_mul, elsize=2: (16, 64, 64, 4, 1))


def _model(seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_qwen3_config("qwen3-nano", vocab_size=97, initializer_range=0.3)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _dequantized(model):
    """``model`` with every layer linear's weight replaced by its FP8 round trip (per output channel)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
                p.copy_(dequantize_fp8_reference(*quantize_fp8_reference(p), p.dtype))
    return model


def _requests(max_tokens: int = 6) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate([3, 17, 9, 1]):
        ids = torch.randint(0, 97, (n,), generator=g).tolist()
        sp = SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, max_tokens=max_tokens + i, ignore_eos=True, seed=i)
        out.append(Request(prompt_ids=ids, sampling=sp, request_id=i))
    return out


def _generate(model, quantization: str, linear: str = "torch"):
    eng = NativeEngine(model, None, max_batch_size=3, max_model_len=48, device=DEVICE, decode_linear=linear,
                       quantization=quantization)  # fmt: skip
    return eng, sorted(eng.generate(_requests()), key=lambda o: o.request_id)


def _max_diff(got, ref) -> float:
    worst = 0.0
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids, a.request_id
        worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)))
    return worst


@pytest.mark.parametrize("linear", ["torch", "triton"])
def test_fp8_engine_matches_the_dequantized_reference(linear, record_property):
    eng, got = _generate(_model(), "fp8", linear)
    assert eng.runner.fp8 is not None and eng.runner.prefill_layer is not None
    qkv = eng.runner.layer_args[0][quant.WEIGHT_ARGS[0]]
    assert isinstance(qkv, tuple) and qkv[0].dtype == torch.float8_e4m3fn and qkv[1].dtype == torch.float32
    _, ref = _generate(_dequantized(_model()), "none", "torch")
    worst = _max_diff(got, ref)
    assert worst < LOGPROB_ATOL, worst
    record_property("max_logprob_diff", worst)
    # and FP8 is not a no-op: the unquantized model's logprobs differ
    _, plain = _generate(_model(), "none", "torch")
    assert max(abs(x - y) for a, b in zip(got, plain) for x, y in zip(a.logprobs, b.logprobs)) > 1e-4


def test_a_weight_sync_requantizes_what_it_wrote():
    """The engine loads another model's weights by HF name: its FP8 copies follow (tokens of a fresh FP8 engine on
    that model), and a sync of one tensor re-quantizes only the weight whose storage it shares."""
    eng, before = _generate(_model(0), "fp8")
    other = _model(1)
    calls = []
    real = eng.runner.fp8.requantize
    eng.runner.fp8.requantize = lambda params=None: calls.append(real(params)) or calls[-1]
    eng.load_weights((n, p.detach().clone()) for n, p in other.named_parameters())
    assert calls == [4 * 2]  # every quantized weight of both layers
    after = sorted(eng.generate(_requests()), key=lambda o: o.request_id)
    _, fresh = _generate(_model(1), "fp8")
    assert _max_diff(after, fresh) < LOGPROB_ATOL
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    q_before = eng.runner.fp8.copies[4][0].clone()  # layer 1's qkv
    s_before = eng.runner.fp8.copies[4][1].clone()
    w = dict(other.named_parameters())["model.layers.1.self_attn.k_proj.weight"]
    eng.load_weights([("model.layers.1.self_attn.k_proj.weight", 2 * w.detach())])
    assert calls[-1] == 1  # the fused qkv of layer 1 only
    q, s = eng.runner.fp8.copies[4]
    nq = 4 * 16  # qwen3-nano: 4 heads x 16; k's rows follow q's
    assert torch.equal(q[:nq], q_before[:nq]) and torch.equal(s[:nq], s_before[:nq])
    torch.testing.assert_close(s[nq : nq + 32], 2 * s_before[nq : nq + 32])


def test_refusals_name_the_flag():
    dims = {"qkv_proj out": 192, "qkv_proj in": 64}
    with pytest.raises(
        ValueError, match=r"--inference.quantization fp8 needs a GPU of compute capability >= 8.9.*8\.0"
    ):
        quant.check_fp8_supported(torch.device("cuda"), dims, capability=(8, 0))
    quant.check_fp8_supported(torch.device("cuda"), dims, capability=(9, 0))
    with pytest.raises(ValueError, match=r"--inference.quantization fp8.*multiple of 16.*'qkv_proj in': 72"):
        quant.check_fp8_supported(torch.device("cpu"), {"qkv_proj in": 72})
    with pytest.raises(ValueError, match="multiple of 16"):  # hidden 72: every linear's K
        cfg = tiny_qwen3_config("qwen3-nano", vocab_size=97, hidden_size=72)
        from transformers import AutoModelForCausalLM

        NativeEngine(AutoModelForCausalLM.from_config(cfg), None, max_batch_size=1, max_model_len=16, device="cpu",
                     quantization="fp8")  # fmt: skip
    with pytest.raises(ValueError, match="--inference.quantization fp8 prefills through the layer function"):
        NativeEngine(_model(), None, max_batch_size=1, max_model_len=16, device="cpu", quantization="fp8",
                     prefill_layer_fn=False)  # fmt: skip
    with pytest.raises(ValueError, match="--inference.quantization 'int4'"):
        NativeEngine(_model(), None, max_batch_size=1, max_model_len=16, device="cpu", quantization="int4")


def test_models_without_the_fused_layer_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2, n_positions=32)).eval()
    with pytest.raises(
        ValueError, match="--inference.quantization fp8 needs a dense Llama-style decoder.*GPT2LMHeadModel"
    ):
        NativeEngine(model, None, max_batch_size=1, max_model_len=16, device="cpu", quantization="fp8")


def test_factory_builds_the_fp8_engine(tmp_path):
    from prime_spmd.config.sections import InferenceConfig, ModelConfig
    from prime_spmd.inference.factory import build_engine
    from prime_spmd.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "m")
    eng = build_engine(InferenceConfig(quantization="fp8", max_batch_size=2), ModelConfig(path=str(path)),
                       torch.device("cpu"), 32)  # fmt: skip
    assert eng.runner.fp8 is not None and eng.runner.fp8.nbytes > 0


def test_memory_plan_counts_the_fp8_copies(tmp_path):
    """``memory.fp8_weight_bytes`` from the model's config equals what the engine allocates, and the colocated plan
    adds it (the trainer cannot share FP8 copies)."""
    from prime_spmd import memory
    from prime_spmd.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "m", "qwen3-micro")
    shape = memory.model_shape(str(path))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    eng = NativeEngine(model, None, max_batch_size=1, max_model_len=16, device="cpu", quantization="fp8")
    assert memory.fp8_weight_bytes(shape) == eng.runner.fp8.nbytes
    kw = dict(num_trainable=shape.num_params, lora=False, offload="none", share_weights=True, kv_cache_tokens=64,
              micro_batch_tokens=64, activation_checkpointing=False)  # fmt: skip
    plain, fp8 = memory.estimate(shape, **kw), memory.estimate(shape, quantization="fp8", **kw)
    assert fp8.total - plain.total == eng.runner.fp8.nbytes and "engine FP8 weights" in fp8.describe()
