"""Numerical guards: non-finite steps are skipped and counted, N in a row stop the run with a message;
importance ratios cannot overflow; an RL batch emptied by zero-advantage filtering is a skipped,
counted step and the run goes on; out of memory while the trainer or the engine is built names that phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from prime_spmd.config.job import RLJobConfig, SFTJobConfig
from prime_spmd.config.rl_sections import LossConfig, RolloutConfig
from prime_spmd.config.sections import (
    CkptConfig,
    DataConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    SamplingConfig,
    SFTTrainerConfig,
    TrainerConfig,
)
from prime_spmd.rl.loss import compute_policy_loss
from prime_spmd.trainer.stop import SkipGuard


def _tiny(tmp: Path) -> Path:
    from prime_spmd.models.tiny import build_tiny_model

    return build_tiny_model(tmp / "base", "qwen3-nano", seed=0, initializer_range=0.3)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("loss_type", ["dppo", "ppo"])
def test_importance_ratio_cannot_overflow(loss_type: str) -> None:
    cfg = LossConfig(type=loss_type, kl_coef=0.1)
    # log-ratios of +-1e4 (exp overflows fp32 past ~88): trainer and inference logprobs far apart both ways
    lp = torch.tensor([0.0, -1e4, -0.5, -1e4, 0.0], requires_grad=True)
    lq = torch.tensor([-1e4, 0.0, -0.5, 0.0, -1e4])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    per_tok, masked = compute_policy_loss(lp, lq, adv, cfg)
    assert torch.isfinite(per_tok).all(), per_tok
    per_tok.sum().backward()
    assert torch.isfinite(lp.grad).all(), lp.grad
    assert per_tok.abs().max() < 1e6  # bounded by exp(max_log_ratio) |A| + kl_coef max_log_ratio^2


def test_skip_guard_counts_in_a_row_and_names_the_flag() -> None:
    g = SkipGuard(3)
    for step, bad in enumerate([True, True, False, True, True]):
        g.update(step, bad)  # a finite step resets the count
    with pytest.raises(
        RuntimeError, match=r"3 optimizer steps in a row \(the last one step 5\).*--trainer.max_skipped_steps"
    ):
        g.update(5, True)
    off = SkipGuard(0)
    for step in range(100):
        off.update(step, True)


def _cleanup_group() -> None:
    if dist.is_initialized():  # the run raised before closing its world of one
        dist.destroy_process_group()


def test_nonfinite_steps_are_skipped_counted_then_stop_the_run(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from prime_spmd.trainer.sft import run_sft

    model = _tiny(tmp_path)
    weights = model / "model.safetensors"
    sd = load_file(weights)
    name = next(k for k in sd if k.endswith("norm.weight"))
    sd[name] = torch.full_like(sd[name], float("nan"))  # the injected fault: every forward gives NaN
    save_file(sd, weights, metadata={"format": "pt"})
    out = tmp_path / "nan"
    cfg = SFTJobConfig(
        output_dir=str(out),
        model=ModelConfig(path=str(model)),
        trainer=SFTTrainerConfig(max_steps=6, batch_size=4, micro_batch_tokens=64, seq_len=64, max_skipped_steps=3),
        data=DataConfig(min_chars=3, max_chars=6),
        ckpt=CkptConfig(save_hf=False),
        log=LogConfig(progress=False, plots=False),
        eval_examples=0,
    )
    try:
        with pytest.raises(RuntimeError, match=r"3 optimizer steps in a row \(the last one step 2\) had a non-finite"):
            run_sft(cfg)
    finally:
        _cleanup_group()
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["skipped_steps"] == 1.0 and r["nonfinite_steps"] == 1.0 for r in rows)
    assert all(r["loss"] is None for r in rows)  # NaN is written as null


def test_rl_all_groups_zero_advantage_is_a_skipped_counted_step(tmp_path: Path, monkeypatch) -> None:
    import prime_spmd.rl.loop as rl
    import prime_spmd.rl.roles as roles

    inner = roles.generate_share

    def equal_rewards(*args, **kwargs):
        batch = inner(*args, **kwargs)
        for g in batch.groups:
            for r in g:
                r.reward = 0.5  # every group: equal rewards, zero advantages, filtered out
        return batch

    monkeypatch.setattr(roles, "generate_share", equal_rewards)  # colocated: the role generates
    model = _tiny(tmp_path)
    out = tmp_path / "empty"
    cfg = RLJobConfig(
        output_dir=str(out),
        model=ModelConfig(path=str(model)),
        trainer=TrainerConfig(max_steps=3, micro_batch_tokens=256, seq_len=48, max_skipped_steps=1),
        optim=OptimConfig(lr=1e-2),
        rollout=RolloutConfig(prompts_per_step=2, group_size=4, max_async=1),
        sampling=SamplingConfig(max_tokens=8),
        ckpt=CkptConfig(save_hf=True),
        log=LogConfig(progress=False, plots=False),
    )
    try:
        rl.run_rl(cfg)  # max_skipped_steps=1: empty batches must not count as failures
    finally:
        _cleanup_group()
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["dropped_groups"] == r["groups"] == 2.0 and r["train_samples"] == 0.0
        assert r["empty_batch"] == 1.0 and r["skipped_steps"] == 1.0 and r["nonfinite_steps"] == 0.0
        assert r["trained_tokens"] == 0.0 and r["loss"] == 0.0
    from safetensors.torch import load_file

    before, after = load_file(model / "model.safetensors"), load_file(out / "hf" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in after)  # no update ever happened


@pytest.mark.parametrize("where", ["trainer", "engine"])
def test_out_of_memory_while_building_names_the_phase(tmp_path: Path, monkeypatch, where: str) -> None:
    """An out-of-memory error in the trainer's build (load, LoRA, FSDP2) or the engine's is raised as one that names
    the phase and the flags that make a run smaller, not only torch's trace (one H100, 30B-A3B LoRA at 667582b ran
    out of memory in fully_shard with a bare CUDA trace)."""
    import prime_spmd.inference.factory as factory
    import prime_spmd.rl.loop as rl

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 MiB")

    monkeypatch.setattr(*((rl, "build_trainer", oom) if where == "trainer" else (factory, "build_engine", oom)))
    cfg = RLJobConfig(
        output_dir=str(tmp_path / "run"),
        model=ModelConfig(path=str(_tiny(tmp_path))),
        trainer=TrainerConfig(max_steps=1, micro_batch_tokens=256, seq_len=48),
        rollout=RolloutConfig(prompts_per_step=2, group_size=2),
        sampling=SamplingConfig(max_tokens=4),
        log=LogConfig(progress=False, plots=False),
    )
    try:
        with pytest.raises(RuntimeError, match=f"out of device memory during the {where}'s build") as err:
            rl.run_rl(cfg)
    finally:
        _cleanup_group()
    assert "flags that make a run smaller" in str(err.value) and isinstance(err.value.__cause__, torch.OutOfMemoryError)
