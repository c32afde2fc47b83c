"""A classic ``vf.SingleTurnEnv`` defined in a test file (tests/envs_for_tests.py, not one of ours) runs
through ``prime_spmd rl`` and ``prime_spmd eval`` unchanged, colocated (the CLI, a world of one) and
disjoint (1 trainer rank + 1 inference rank), with a tiny random Qwen3 and the character tokenizer.

The env's rubric is ``exact`` (answer in the completion) + ``length_bonus`` (min(len, 10) / 100): a
random model gets exact = 0 but varying length bonuses, so groups have non-zero advantages and the
loss trains. Asserted: rewards come from that rubric (env/length_bonus in the step metrics, reward_mean
equals exact + length_bonus), policy lag follows the schedule, mismatch KL is logged (0 on-policy).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers")

from prime_spmd.config.job import RLJobConfig  # noqa: E402
from prime_spmd.config.rl_sections import RolloutConfig  # noqa: E402
from prime_spmd.config.sections import (  # noqa: E402
    CkptConfig,
    EnvConfig,
    InferenceConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    SamplingConfig,
    TopologyConfig,
    TrainerConfig,
)
from tests.dist_utils import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = "tests.envs_for_tests:load_single_turn_env"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from prime_spmd.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vf_rl") / "base", "qwen3-nano", seed=0, initializer_range=0.3)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _check_rubric_metrics(m: list[dict], steps: int, k: int) -> None:
    assert [r["step"] for r in m] == list(range(steps))
    assert [r["policy_lag_mean"] for r in m] == [float(min(j, k)) for j in range(steps)]
    for r in m:
        # Rewards are the env rubric's: exact + length_bonus, both averaged over the batch.
        assert r["reward_mean"] == pytest.approx(r["env/exact"] + r["env/length_bonus"], abs=1e-9)
        assert 0 < r["env/length_bonus"] <= 0.1
        assert r["failed_rollouts"] == 0.0 and r["env/reward_errors"] == 0.0
        assert r["train_samples"] > 0 and r["loss"] == r["loss"]
    # Step 0 trains on a batch generated with the weights being trained: no mismatch (fp32, CPU).
    assert m[0]["mismatch_kl"] < 1e-9


def test_rl_and_eval_cli_colocated(tiny_model: Path, tmp_path: Path) -> None:
    """``python -m prime_spmd rl --env.name tests.envs_for_tests:...`` (a world of one), then ``eval``."""
    out = tmp_path / "rl"
    common = ["--model.path", str(tiny_model), "--env.name", ENV, "--env.args", "num_examples", "8"]
    cmd = [
        sys.executable, "-m", "prime_spmd", "rl", *common, "--output_dir", str(out),
        "--trainer.max_steps", "3", "--trainer.seq_len", "96", "--trainer.micro_batch_tokens", "384",
        "--trainer.seed", "1", "--trainer.num_threads", "1",
        "--rollout.prompts_per_step", "2", "--rollout.group_size", "4", "--rollout.max_async", "1",
        "--sampling.max_tokens", "8", "--inference.max_batch_size", "8", "--optim.lr", "1e-3",
        "--log.no_progress", "--log.no_plots", "--ckpt.interval_steps", "0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = _metrics(out)
    _check_rubric_metrics(m, 3, k=1)
    assert m[1]["mismatch_kl"] > 0  # batch 1 was generated with w_0 and trained at step 1 on w_1
    assert (out / "hf" / "config.json").is_file()

    # eval of the trained weights with the same env (in-process: the CLI path is tested in tests/unit).
    from prime_spmd.config.job import EvalJobConfig
    from prime_spmd.eval import run_eval

    ev = tmp_path / "eval"
    summary = run_eval(
        EvalJobConfig(
            output_dir=str(ev),
            model=ModelConfig(path=str(out / "hf")),
            env=EnvConfig(name=ENV, num_eval_examples=3),
            sampling=SamplingConfig(max_tokens=6),
            inference=InferenceConfig(max_batch_size=8),
            log=LogConfig(progress=False, plots=False),
            samples_per_example=2,
        )
    )
    rows = [json.loads(line) for line in (ev / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all("What is" in r["prompt"] for r in rows)
    assert summary["num_examples"] == 3


def _cfg(out: Path, model: Path) -> RLJobConfig:
    return RLJobConfig(
        output_dir=str(out),
        model=ModelConfig(path=str(model)),
        topology=TopologyConfig(num_inference_ranks=1, timeout_s=120),
        trainer=TrainerConfig(max_steps=3, micro_batch_tokens=384, seq_len=96, seed=1, num_threads=1),
        optim=OptimConfig(lr=1e-3),
        rollout=RolloutConfig(prompts_per_step=2, group_size=4, max_async=1),
        sampling=SamplingConfig(max_tokens=8),
        inference=InferenceConfig(max_batch_size=8, weight_bucket_mb=1),
        env=EnvConfig(name=ENV, args={"num_examples": "8"}),
        ckpt=CkptConfig(interval_steps=0, save_hf=False),
        log=LogConfig(progress=False, plots=False),
    )


def _rl(rank: int, world: int, cfg: RLJobConfig) -> None:
    from prime_spmd.trainer.rl import run_rl

    run_rl(cfg)


def test_rl_disjoint_one_trainer_one_engine(tiny_model: Path, tmp_path: Path) -> None:
    """The same env with the inference engine on its own rank (weights and rollouts over the bridges)."""
    out = tmp_path / "disjoint"
    run_ranks(_rl, 2, _cfg(out, tiny_model))
    _check_rubric_metrics(_metrics(out), 3, k=1)
