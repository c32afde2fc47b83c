"""Exact mode in the RL loop (CPU under the Triton interpreter, or CUDA): at lag 0 (max_async 0) every trained token's
trainer logprob equals the engine's, so the importance ratios are exactly 1 and the logged mismatch KL exactly 0.0,
at every step (the weights the engine samples with are the trainer's, synced after each step): colocated in one
process, and disjoint (a trainer rank and an inference rank, weights broadcast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from prime_spmd.config import RLJobConfig
from prime_spmd.config.rl_sections import RolloutConfig
from prime_spmd.config.sections import (
    CkptConfig,
    InferenceConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RLTopologyConfig,
    SamplingConfig,
    TrainerConfig,
)
from prime_spmd.models.tiny import build_tiny_model


def _cfg(tmp_path: Path, num_inference: int) -> RLJobConfig:
    model = build_tiny_model(tmp_path / "base", "qwen3-nano", seed=0, initializer_range=0.3)
    return RLJobConfig(
        output_dir=str(tmp_path / "run"),
        model=ModelConfig(path=str(model), impl="custom", exact=True),
        topology=RLTopologyConfig(num_inference_ranks=num_inference, timeout_s=300),
        trainer=TrainerConfig(max_steps=2, micro_batch_tokens=128, seq_len=40),
        optim=OptimConfig(lr=1e-2),
        rollout=RolloutConfig(prompts_per_step=2, group_size=3, max_async=0, drop_zero_advantage_groups=False),
        sampling=SamplingConfig(max_tokens=6),
        inference=InferenceConfig(max_batch_size=8),
        ckpt=CkptConfig(save_hf=False),
        log=LogConfig(progress=False, plots=False),
    )


def run_recording(rank: int, world: int, cfg: RLJobConfig, record: Path) -> None:
    """Run the RL job; the trainer rank appends, per micro-batch, max |lp - lq| over its trained tokens and their
    count to ``record`` (``run_ranks`` entry, or called in-process with world 1)."""
    from prime_spmd.rl.loop import run_rl
    from prime_spmd.rl.loss import RLLoss

    stats = RLLoss.stats

    def recording(self, lp, ent, fields):
        m = fields["loss_mask"] > 0
        d = float((lp - fields["inference_logprobs"])[m].abs().max()) if m.any() else 0.0
        with open(record, "a") as f:
            f.write(f"{d!r} {int(m.sum())}\n")
        return stats(self, lp, ent, fields)

    RLLoss.stats = recording
    try:
        run_rl(cfg)
    finally:
        RLLoss.stats = stats


def _check(cfg: RLJobConfig, record: Path) -> None:
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["mismatch_kl"] == 0.0 and r["policy_lag_mean"] == 0.0 for r in rows), rows
    seen = [(float(d), int(n)) for d, n in (line.split() for line in record.read_text().splitlines())]
    assert sum(n for _, n in seen) > 0 and all(d == 0.0 for d, _ in seen), seen
    assert rows[1]["grad_norm"] > 0  # the weights moved between the two steps: step 1 samples with new ones


def test_rl_lag0_ratios_are_exactly_one_colocated(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, num_inference=0)
    try:
        run_recording(0, 1, cfg, tmp_path / "record.txt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _check(cfg, tmp_path / "record.txt")


@pytest.mark.skipif(torch.cuda.is_available(), reason="spawned ranks would share one GPU; CPU ranks over gloo")
def test_rl_lag0_ratios_are_exactly_one_disjoint(tmp_path: Path) -> None:
    from tests.dist_utils import run_ranks

    cfg = _cfg(tmp_path, num_inference=1)
    run_ranks(run_recording, 2, cfg, tmp_path / "record.txt")
    _check(cfg, tmp_path / "record.txt")


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
