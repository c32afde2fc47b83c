"""Exact mode in the RL loop (colocated, one process, CPU under the Triton interpreter): at lag 0 (max_async 0) every
trained token's trainer logprob equals the engine's, so the importance ratios are exactly 1 and the logged mismatch
KL exactly 0.0, at every step (the weights the engine samples with are the trainer's, synced after each step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from prime_spmd.config import RLJobConfig
from prime_spmd.config.rl_sections import RolloutConfig
from prime_spmd.config.sections import (
    CkptConfig,
    InferenceConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    SamplingConfig,
    TrainerConfig,
)
from prime_spmd.models.tiny import build_tiny_model


def test_rl_lag0_ratios_are_exactly_one(tmp_path: Path, monkeypatch) -> None:
    import prime_spmd.rl.loop as rl
    from prime_spmd.rl.loss import RLLoss

    seen: list[tuple[float, int]] = []  # per micro-batch: max |lp - lq| over trained tokens, and their count
    stats = RLLoss.stats

    def recording(self, lp, ent, fields):
        m = fields["loss_mask"] > 0
        seen.append((float((lp - fields["inference_logprobs"])[m].abs().max()) if m.any() else 0.0, int(m.sum())))
        return stats(self, lp, ent, fields)

    monkeypatch.setattr(RLLoss, "stats", recording)
    model = build_tiny_model(tmp_path / "base", "qwen3-nano", seed=0, initializer_range=0.3)
    out = tmp_path / "run"
    cfg = RLJobConfig(
        output_dir=str(out),
        model=ModelConfig(path=str(model), impl="custom", exact=True),
        trainer=TrainerConfig(max_steps=2, micro_batch_tokens=128, seq_len=40),
        optim=OptimConfig(lr=1e-2),
        rollout=RolloutConfig(prompts_per_step=2, group_size=3, max_async=0, drop_zero_advantage_groups=False),
        sampling=SamplingConfig(max_tokens=6),
        inference=InferenceConfig(max_batch_size=8),
        ckpt=CkptConfig(save_hf=False),
        log=LogConfig(progress=False, plots=False),
    )
    try:
        rl.run_rl(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["mismatch_kl"] == 0.0 and r["policy_lag_mean"] == 0.0 for r in rows), rows
    assert sum(n for _, n in seen) > 0 and all(d == 0.0 for d, _ in seen), seen
    assert rows[1]["grad_norm"] > 0  # the weights moved between the two steps: step 1 samples with new ones


def test_exact_refuses_what_it_does_not_cover(tmp_path: Path) -> None:
    base = dict(output_dir=str(tmp_path), model=ModelConfig(path=str(tmp_path), exact=True))
    with pytest.raises(ValueError, match="--model.exact needs --inference.engine native"):
        RLJobConfig(**base, inference=InferenceConfig(engine="vllm"))._check_exact()
    with pytest.raises(ValueError, match="--model.exact needs --inference.native.kv_cache slot"):
        cfg = RLJobConfig(**base)
        cfg.inference.native.kv_cache = "paged"
        cfg._check_exact()
    cfg = RLJobConfig(**base)
    cfg.model.lora.rank = 8
    with pytest.raises(ValueError, match="LoRA is not covered"):
        cfg._check_exact()
    cfg = RLJobConfig(output_dir=str(tmp_path), model=ModelConfig(path=str(tmp_path), exact=True, impl="hf"))
    with pytest.raises(ValueError, match="--model.impl custom"):
        cfg._check_exact()
