"""SIGKILL of an RL run, between steps and in the middle of a checkpoint write, then ``--ckpt.resume``:
the run ends with the metrics of an uninterrupted run (timing metrics aside), and the half-written
checkpoint (every shard and state.json written, not yet renamed) is never taken as the latest.

The job runs as a subprocess through tests/distributed/test_sigterm.py's entry point (each step
sleeps STEP_SLEEP_S, so the kill lands mid-run); the mid-write kill uses checkpoint.py's test hook
PRIME_SPMD_TEST_CKPT_PAUSE_S (the writer sleeps between the last write and the rename).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from prime_spmd.trainer.checkpoint import latest_checkpoint
from tests.distributed.test_sigterm import (
    STEPS,
    job_flags,
    metrics,
    num_lines,
    run_in_process,
    start_job,
    tiny_model,
    wait_for,
    without_timing,
)


def _kill(job) -> None:
    os.killpg(job.pid, signal.SIGKILL)  # the job's own session (start_new_session)
    job.wait(timeout=30)


def test_rl_sigkill_between_steps_and_mid_checkpoint_then_resume(tmp_path: Path) -> None:
    model = tiny_model(tmp_path)  # checkpoints every 3 steps (job_flags): step 3, step 6, step 8 (end)
    ref = tmp_path / "ref"
    run_in_process(job_flags("rl", ref, model))
    out = tmp_path / "killed"

    # 1. SIGKILL between steps: after step 4 is logged, so step_000003 is the latest complete checkpoint.
    job = start_job(job_flags("rl", out, model), tmp_path / "a.log", step_sleep_s=0.4)
    try:
        wait_for(lambda: num_lines(out / "metrics.jsonl") >= 5 or job.poll() is not None, 120, "five steps")
    finally:
        _kill(job)
    assert job.returncode == -signal.SIGKILL, (tmp_path / "a.log").read_text()
    assert latest_checkpoint(out) == out / "checkpoints" / "step_000003"

    # 2. Resume, and SIGKILL while step_000006 is being written (all of it on disk, not yet renamed).
    tmp_ckpt = out / "checkpoints" / "step_000006.tmp"
    job = start_job(
        job_flags("rl", out, model, "--ckpt.resume"), tmp_path / "b.log", 0.0, PRIME_SPMD_TEST_CKPT_PAUSE_S="120"
    )
    try:
        wait_for(lambda: (tmp_ckpt / "PAUSED").exists() or job.poll() is not None, 120, "the step-6 checkpoint write")
    finally:
        _kill(job)
    log = (tmp_path / "b.log").read_text()
    assert (tmp_ckpt / "PAUSED").exists(), log
    assert (tmp_ckpt / "state.json").is_file() and (tmp_ckpt / "dcp").is_dir()  # complete but for the rename
    assert not (out / "checkpoints" / "step_000006").exists()
    assert latest_checkpoint(out) == out / "checkpoints" / "step_000003"

    # 3. Resume to the end: from step 3 again, the stale .tmp removed, the same metrics as the reference run.
    run_in_process(job_flags("rl", out, model, "--ckpt.resume"))
    assert not tmp_ckpt.exists()
    assert [r["step"] for r in metrics(out)] == list(range(STEPS))
    assert without_timing(metrics(out)) == without_timing(metrics(ref))
    assert latest_checkpoint(out) == out / "checkpoints" / f"step_{STEPS:06d}"
