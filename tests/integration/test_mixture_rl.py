"""A mixture of environments through the whole RL loop (issue 41), tiny random Qwen3, CPU:

the built-in reverse_text (weight 3) and a classic verifiers multi-turn environment whose environment
code raises on half its examples (tests/integration/mixture_envs.py, weight 1). Asserted: each batch
holds 3:1 of the prompts, per-environment metrics, the flaky environment's failed groups are dropped and
counted while the run goes on, evals of w_0, w_2 and the final weights; a run resumed from step 2
logs the uninterrupted run's metrics (the planner's state is in the checkpoint); disjoint mode (1 + 1
ranks: plans through the store, evals on the inference rank) does the same and resumes the same way; a failure rate above
--rollout.max_env_failure_rate stops the run with a message naming the environment.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("verifiers")

from prime_spmd.config.rl_sections import RLEvalConfig  # noqa: E402
from prime_spmd.config.sections import EnvConfig, ModelConfig  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402
from tests.jobs import copy_for_resume, read_metrics, rl_rank, tiny_rl_cfg  # noqa: E402

FLAKY = "tests.integration.mixture_envs:load_flaky_env"
TIMING = ("time", "_s", "tokens_per_s")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from prime_spmd.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("mix") / "base", "qwen3-nano", seed=0, initializer_range=0.3)


def _cfg(model: Path, out: Path, *, num_inference: int = 0, resume: bool = False, max_rate: float = 0.9):
    cfg = tiny_rl_cfg(out, ModelConfig(path=str(model)), steps=4, lr=1e-3, max_async=1, num_inference=num_inference)
    cfg.trainer.seq_len = 96
    cfg.trainer.micro_batch_tokens = 384
    cfg.ckpt.resume = resume
    cfg.rollout.max_env_failure_rate = max_rate
    cfg.envs = [
        EnvConfig(name="reverse_text", label="rev", weight=3.0, num_eval_examples=4, args={"max_chars": "6"}),
        EnvConfig(name=FLAKY, label="flaky", weight=1.0, max_tokens=6, args={"num_examples": "8"}),
    ]
    cfg.eval = RLEvalConfig(interval_steps=2, samples_per_example=2)
    cfg.validate()
    return cfg


def _same(a: dict, b: dict) -> None:
    for k, v in a.items():
        if not any(t in k for t in TIMING) and isinstance(v, float):
            assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (a["step"], k, v, b[k])


def _check_mixture(rows: list[dict]) -> None:
    m = [r for r in rows if "loss" in r]  # train rows; the final weights' eval is a row of step 4
    assert [r["step"] for r in m] == [0, 1, 2, 3]
    for r in m:
        assert r["env/rev/prompts"] == 3.0 and r["env/flaky/prompts"] == 1.0  # 3:1 of 4, every batch
        assert r["env/rev/groups"] == 3.0 and r["env/rev/failed_groups"] == 0.0
        assert 0.0 <= r["env/rev/reward"] <= 1.0 and r["train_samples"] > 0
    # half the flaky env's examples raise: their groups are dropped and counted, the run goes on
    assert sum(r["env/flaky/failed_groups"] for r in m) >= 1
    evals = {r["eval_step"]: r for r in rows if "eval_step" in r}
    assert set(evals) == {0.0, 2.0, 4.0}  # before training, every 2 steps, the final weights
    assert evals[4.0]["step"] == 4 and "loss" not in evals[4.0]
    for r in evals.values():
        assert 0.0 <= r["env/rev/eval_reward"] <= 1.0 and "env/rev/eval_pass@2" in r
        assert r["env/flaky/eval_failed_groups"] == 4.0  # 4 of its 8 eval examples raise


def test_mixture_colocated_runs_isolates_failures_evaluates_and_resumes(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "full"
    run_ranks(rl_rank, 1, _cfg(tiny_model, out))
    m = read_metrics(out)
    _check_mixture(m)
    resumed = tmp_path / "resumed"
    copy_for_resume(out, resumed, 2)
    run_ranks(rl_rank, 1, _cfg(tiny_model, resumed, resume=True))
    got = read_metrics(resumed)
    assert [r["step"] for r in got] == [r["step"] for r in m]
    for a, b in zip(m[2:], got[2:]):
        _same({k: v for k, v in a.items() if not k.startswith("env/") or "eval" not in k}, b)


def test_mixture_disjoint_runs_and_resumes(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "disjoint"
    run_ranks(rl_rank, 2, _cfg(tiny_model, out, num_inference=1))
    m = read_metrics(out)
    _check_mixture(m)
    resumed = tmp_path / "resumed"
    copy_for_resume(out, resumed, 2)  # rows 0, 1 (the eval of w_0 arrives in row 1 or 2 here, not its own row)
    run_ranks(rl_rank, 2, _cfg(tiny_model, resumed, num_inference=1, resume=True))
    got = [r for r in read_metrics(resumed) if "loss" in r]
    train = [r for r in m if "loss" in r]
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    for a, b in zip(train[2:], got[2:]):  # the plans of batches 2.. come from the checkpoint's planner
        _same({k: v for k, v in a.items() if "eval" not in k}, b)


def test_failure_rate_stops_the_run_naming_the_environment(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(Exception) as info:
        run_ranks(rl_rank, 1, _cfg(tiny_model, tmp_path / "stop", max_rate=0.1))
    assert "'flaky' failed" in str(info.value) and "max_env_failure_rate" in str(info.value)
    rows = read_metrics(tmp_path / "stop") if (tmp_path / "stop" / "metrics.jsonl").is_file() else []
    assert len(rows) < 4, json.dumps(rows)[:300]
