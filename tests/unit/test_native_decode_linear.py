"""The native engine with the fused decode linears (``decode_linear="triton"``) vs F.linear (``"torch"``).

Tiny random fp32 models through the fused decode layer: an HF Qwen3 (q/k norms, no biases), an HF
Qwen2 (QKV biases) and an HF Llama with attention_bias (QKV and O biases), prompts of different lengths
and more requests than slots, greedy and seeded rows in one batch; then steps above the row bounds,
which must take the torch linears.
CPU: Triton under the interpreter; with a GPU the same tests run compiled, with CUDA graphs.
"""

from __future__ import annotations

import prime_spmd.kernels.decode_linear.op  # noqa: F401  registers torch.ops.prime_spmd.decode_linear
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from prime_spmd.inference import runner as runner_mod
from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.models.tiny import tiny_qwen3_config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# max |triton - torch| logprob, fp32: the kernel sums K in another order (IEEE fp32 dots, no TF32)
LOGPROB_ATOL = 1e-4
PROMPT_LENS = [3, 17, 9, 30, 1]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every engine here compiles the same decode-layer code object (CUDA): with the row bounds' guards,
    a file of engines passes Dynamo's per-code-object recompile limit (8), which one engine stays under."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _big_interpreter_tiles(monkeypatch):
    """CPU: 64 x 64 tiles (one or two programs per launch; ~6x faster under the interpreter than the
    16 x 16 x 32 tiles the kernel tests use to cover tile edges, tests/kernels/test_decode_linear.py)."""
    if DEVICE.type == "cpu":
        from prime_spmd.kernels.decode_linear import kernel

        monkeypatch.setattr(kernel, "default_config", lambda m, no, k, silu_mul, elsize=2: (16, 64, 64, 4, 1))


def _requests() -> list[Request]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(PROMPT_LENS):
        ids = torch.randint(0, 97, (n,), generator=g).tolist()
        sp = SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, max_tokens=4 + 2 * i, ignore_eos=True, seed=i)
        out.append(Request(prompt_ids=ids, sampling=sp, request_id=i))
    return out


def _model(kind: str):
    if kind == "qwen3":
        cfg = tiny_qwen3_config("qwen3-nano", vocab_size=97, initializer_range=0.3)
    elif kind == "llama_bias":  # attention_bias: q/k/v and o_proj biases (o's reaches the fused O+residual)
        cfg = LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3, attention_bias=True,
        )  # fmt: skip
    else:
        cfg = Qwen2Config(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3, tie_word_embeddings=False,
        )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if kind != "qwen3":  # HF initializes biases to zero: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                    if proj.bias is not None:
                        proj.bias.normal_(0, 0.5)
    return model


def _generate(model, linear: str, attention: str = "auto", calls: list | None = None):
    eng = NativeEngine(
        model, None, max_batch_size=3, max_model_len=64, device=DEVICE, decode_linear=linear, decode_attention=attention
    )
    assert eng.runner.linear == linear and eng.runner.layer_args is not None  # the fused decode layer
    if calls is not None:  # count the glue kernels' launches (kernels/decode_glue)
        step_inputs, advance = eng.runner.step_inputs, eng._advance
        eng.runner.step_inputs = lambda *a: calls.append("inputs") or step_inputs(*a)
        eng._advance = lambda *a: calls.append("advance") or advance(*a)
    return sorted(eng.generate(_requests()), key=lambda o: o.request_id)


def _max_diff(model, attention: str = "auto", calls: list | None = None) -> float:
    ref = _generate(model, "torch", attention)
    got = _generate(model, "triton", attention, calls)
    worst = 0.0
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids, a.request_id
        worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)))
    return worst


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama_bias"])
def test_fused_linears_match_torch(kind, record_property):
    worst = _max_diff(_model(kind))
    assert worst < LOGPROB_ATOL, worst
    record_property("max_logprob_diff", worst)


def test_triton_path_takes_the_glue_kernels(record_property):
    """With the Triton attention and linears the step's inputs and the state advance are kernels/decode_glue's
    launches (one each a step); same tokens and logprobs as the torch linears' path, which keeps the eager glue."""
    model = _model("qwen3")
    torch_path = NativeEngine(model, None, max_batch_size=3, max_model_len=64, device=DEVICE, decode_linear="torch",
                              decode_attention="triton_qkv")  # fmt: skip
    assert not torch_path.runner.glue
    calls: list[str] = []
    worst = _max_diff(model, "triton_qkv", calls)
    assert worst < LOGPROB_ATOL, worst
    assert calls and calls.count("inputs") == calls.count("advance"), calls[:6]
    record_property("max_logprob_diff", worst)


@pytest.mark.parametrize("bounds", [(2, 3), (2, 2)])
def test_steps_above_the_bounds_take_torch_linears(monkeypatch, bounds):
    """Steps here have 2 or 3 rows (3 slots). Bounds (norm linears, residual linears) (2, 3): 3-row steps run
    the residual kernels and F.linear for qkv / gate_up; (2, 2): 3-row steps run F.linear only. Still the
    same samples; on CPU (eager: the layer looks the op up at each call) the kernel sees only the rows its
    bounds allow."""
    calls = []
    real = torch.ops.prime_spmd.decode_linear

    def counting(x, w, bias, norm_w, eps, residual, silu_mul):
        calls.append((x.shape[0], norm_w is not None))
        return real(x, w, bias, norm_w, eps, residual, silu_mul)

    monkeypatch.setattr(runner_mod, "DECODE_LINEAR_MAX_ROWS", bounds[0])
    monkeypatch.setattr(runner_mod, "DECODE_LINEAR_MAX_ROWS_RESIDUAL", bounds[1])
    if DEVICE.type == "cpu":
        monkeypatch.setattr(torch.ops.prime_spmd, "decode_linear", counting)
    worst = _max_diff(_model("qwen3"))
    assert worst < LOGPROB_ATOL, worst
    if DEVICE.type == "cpu":
        assert {rows for rows, _ in calls} == set(range(2, bounds[1] + 1)), sorted(set(calls))
        assert all(rows <= bounds[0] for rows, normed in calls if normed), sorted(set(calls))


def test_bad_name_and_auto():
    with pytest.raises(ValueError, match="decode linear 'cublas'"):
        NativeEngine(_model("qwen3"), None, max_batch_size=1, max_model_len=16, device="cpu", decode_linear="cublas")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert runner_mod.resolve_decode_linear("auto", cpu, 64) == "torch"
    assert runner_mod.resolve_decode_linear("auto", cuda, 1024) == "triton"
    assert runner_mod.resolve_decode_linear("auto", cuda, 4096) == "torch"
    assert runner_mod.resolve_decode_linear("triton", cpu, 4096) == "triton"
    assert runner_mod.resolve_decode_linear("torch", cuda, 1024) == "torch"
    eng = NativeEngine(_model("qwen3"), None, max_batch_size=1, max_model_len=16, device="cpu")  # default: auto
    assert eng.runner.linear == "torch"
