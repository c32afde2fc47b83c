"""Colocated RL loads --model's tokenizer once: the trainer takes the engine's (full fine-tuning: the engine is built
first) or the engine the trainer's (LoRA: the engine is built after the trainer, reading its frozen base). A Qwen3
tokenizer takes ~0.5-1 s to load, paid twice at every start before (H100 start-up profile, aa55e61)."""

from __future__ import annotations

import pytest

from prime_spmd.config.sections import LoraConfig, ModelConfig
from prime_spmd.inference import factory
from prime_spmd.models.tiny import build_tiny_model
from prime_spmd.rl.loop import run_rl
from prime_spmd.trainer import build
from tests.jobs import tiny_rl_cfg


@pytest.mark.parametrize("lora", [0, 4])
def test_colocated_rl_loads_the_tokenizer_once(tmp_path, monkeypatch, lora: int) -> None:
    loaded = []

    def counting(load):
        def fn(cfg):
            tok = load(cfg)
            loaded.append(tok)
            return tok

        return fn

    monkeypatch.setattr(build, "load_tokenizer", counting(build.load_tokenizer))
    monkeypatch.setattr(factory, "load_tokenizer", counting(factory.load_tokenizer))
    model = build_tiny_model(tmp_path / "m", preset="qwen3-nano")
    mcfg = ModelConfig(path=str(model), impl="custom", lora=LoraConfig(rank=lora, alpha=2.0 * max(lora, 1)))
    cfg = tiny_rl_cfg(tmp_path / "out", mcfg, steps=1, lr=1e-3, max_async=0, num_inference=0)
    metrics = run_rl(cfg)
    assert "loss" in metrics and len(loaded) == 1, (metrics, loaded)
