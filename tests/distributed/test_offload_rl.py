"""--trainer.offload optimizer in a real RL run (colocated, 2 gloo ranks: FSDP2-sharded DTensor parameters with
host-side moments), with the KV cache released while the trainer steps: the same trajectory as the device optimizer
with a resident cache, and exact resume from its DCP checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prime_spmd.config.job import RLJobConfig
from prime_spmd.config.sections import ModelConfig
from tests.dist_utils import run_ranks
from tests.jobs import TIMING_KEYS, copy_for_resume, read_metrics, rl_rank, tiny_rl_cfg


def _cfg(out: Path, model: Path, offload: str, resume: bool = False) -> RLJobConfig:
    cfg = tiny_rl_cfg(
        out, ModelConfig(path=str(model)), steps=4, lr=1e-3, max_async=1, num_inference=0, resume=resume, keep_last=3
    )
    # the offloaded runs also release the engine's KV cache while the trainer steps (the colocated role's path):
    # neither may change what the run computes
    native = dataclasses.replace(cfg.inference.native, release_kv_cache=offload != "none")
    inference = dataclasses.replace(cfg.inference, native=native)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, offload=offload), inference=inference)


def test_offloaded_optimizer_matches_and_resumes_exactly(tmp_path: Path) -> None:
    from prime_spmd.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "base", "qwen3-nano", seed=0, initializer_range=0.3)
    run_ranks(rl_rank, 2, _cfg(tmp_path / "device", model, "none"))
    run_ranks(rl_rank, 2, _cfg(tmp_path / "host", model, "optimizer"))
    ref, off = read_metrics(tmp_path / "device"), read_metrics(tmp_path / "host")
    assert [r["step"] for r in off] == list(range(4))
    for a, b in zip(ref, off):  # torch's foreach AdamW vs ours: the same math, rounding-level differences
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"])), (a["step"], a["loss"], b["loss"])
        assert abs(a["reward_mean"] - b["reward_mean"]) <= 0.05, (a["step"], a["reward_mean"], b["reward_mean"])
    res = tmp_path / "resumed"
    copy_for_resume(tmp_path / "host", res, 2)
    run_ranks(rl_rank, 2, _cfg(res, model, "optimizer", resume=True))
    got = read_metrics(res)
    for a, b in zip(off[2:], got[2:]):
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == {
            k: v for k, v in b.items() if k not in TIMING_KEYS
        }


def _master_rank(rank: int, world: int, cfg: RLJobConfig) -> dict:
    """``rl_rank`` that also returns what the colocated engine shares with the trainer (``factory.count_shared``)."""
    from prime_spmd.inference import factory
    from prime_spmd.rl.loop import run_rl

    seen: dict = {}
    real = factory.count_shared

    def count(engine_model, trainer_lm, report):
        real(engine_model, trainer_lm, report)
        seen.update(shared=report.shared, owned=report.owned)
        return report

    factory.count_shared = count
    run_rl(cfg)
    return seen


def test_master_offload_shares_every_weight_and_resumes_exactly(tmp_path: Path) -> None:
    """--trainer.offload master on one colocated rank (CPU: the compute dtype is fp32, so the trainer's parameters
    hold what fp32 masters would): the engine reads every trainer weight in place, including the ones it fused (no
    weight of its own), the run follows the device optimizer's trajectory, and it resumes exactly."""
    from prime_spmd.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "base", "qwen3-nano", seed=0, initializer_range=0.3)
    run_ranks(rl_rank, 1, _cfg(tmp_path / "device", model, "none"))
    (seen,) = run_ranks(_master_rank, 1, _cfg(tmp_path / "master", model, "master"))
    assert seen["owned"] == 0 and seen["shared"] > 0
    ref, off = read_metrics(tmp_path / "device"), read_metrics(tmp_path / "master")
    assert [r["step"] for r in off] == list(range(4))
    for a, b in zip(ref, off):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"])), (a["step"], a["loss"], b["loss"])
        assert abs(a["reward_mean"] - b["reward_mean"]) <= 0.05, (a["step"], a["reward_mean"], b["reward_mean"])
    res = tmp_path / "resumed"
    copy_for_resume(tmp_path / "master", res, 2)
    run_ranks(rl_rank, 1, _cfg(res, model, "master", resume=True))
    for a, b in zip(off[2:], read_metrics(res)[2:]):
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == {
            k: v for k, v in b.items() if k not in TIMING_KEYS
        }


def _release_rank(rank: int, world: int, cfg: RLJobConfig) -> list[str]:
    """``rl_rank`` recording, in order, each KV-cache release that freed memory ("R") and each train step ("T")."""
    from prime_spmd.inference.native import NativeEngine
    from prime_spmd.rl import loop

    events: list[str] = []
    release, step = NativeEngine.release_memory, loop.train_step

    def recorded_release(self):
        freed = release(self)
        if freed:
            events.append("R")
        return freed

    def recorded_step(*args, **kwargs):
        events.append("T")
        return step(*args, **kwargs)

    NativeEngine.release_memory, loop.train_step = recorded_release, recorded_step
    loop.run_rl(cfg)
    return events


def test_the_kv_cache_is_released_once_before_each_train_step(tmp_path: Path) -> None:
    """--inference.native.release_kv_cache (colocated): max_async 1 generates two batches before the first step, and
    the run evaluates every 2 steps; the cache is released right before each step, once, and never between two
    generations (which would recapture every graph for nothing)."""
    from prime_spmd.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "base", "qwen3-nano", seed=0, initializer_range=0.3)
    cfg = _cfg(tmp_path / "run", model, "optimizer")
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=3, offload="none"),
                              eval=dataclasses.replace(cfg.eval, interval_steps=2))  # fmt: skip
    (events,) = run_ranks(_release_rank, 1, cfg)
    assert events == ["R", "T"] * 3, events
