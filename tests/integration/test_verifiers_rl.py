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

from prime_spmd.config.sections import EnvConfig  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402
from tests.jobs import ROOT, read_metrics, rl_rank, vf_eval_cfg, vf_rl_disjoint_cfg, vf_rl_flags  # noqa: E402

ENV = "tests.envs_for_tests:load_single_turn_env"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from prime_spmd.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vf_rl") / "base", "qwen3-nano", seed=0, initializer_range=0.3)


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
    flags = vf_rl_flags(tiny_model, out, ENV, seq_len=96, micro_batch_tokens=384)
    proc = subprocess.run(
        [sys.executable, "-m", "prime_spmd", "rl", *flags], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = read_metrics(out)
    _check_rubric_metrics(m, 3, k=1)
    assert m[1]["mismatch_kl"] > 0  # batch 1 was generated with w_0 and trained at step 1 on w_1
    assert (out / "hf" / "config.json").is_file()

    # eval of the trained weights with the same env (in-process: the CLI path is tested in tests/unit).
    from prime_spmd.eval import run_eval

    ev = tmp_path / "eval"
    summary = run_eval(vf_eval_cfg(out / "hf", ev, EnvConfig(name=ENV, num_eval_examples=3)))
    rows = [json.loads(line) for line in (ev / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all("What is" in r["prompt"] for r in rows)
    assert summary["num_examples"] == 3


def test_rl_disjoint_one_trainer_one_engine(tiny_model: Path, tmp_path: Path) -> None:
    """The same env with the inference engine on its own rank (weights and rollouts over the bridges)."""
    out = tmp_path / "disjoint"
    run_ranks(rl_rank, 2, vf_rl_disjoint_cfg(tiny_model, out, ENV, seq_len=96, micro_batch_tokens=384))
    _check_rubric_metrics(read_metrics(out), 3, k=1)
