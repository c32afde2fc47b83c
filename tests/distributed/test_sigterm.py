"""SIGTERM stops a run cleanly: the current step finishes, a checkpoint is saved, the job exits 0 with a
log line naming the checkpoint, and ``--ckpt.resume`` reaches the end with the metrics of an
uninterrupted run (bitwise on CPU, timing metrics aside).

- SFT and colocated RL as a subprocess (world of one) that gets SIGTERM from outside after a few steps;
- disjoint RL (1 trainer + 1 inference rank): SIGTERM reaches only the controller (a hook sends it
  to its own process at step 1); the inference rank must leave through the controller's stop key.

Run as a script, this file is the job's entry point with a test hook installed: every training step
sleeps STEP_SLEEP_S afterwards, so that a signal from outside lands mid-run and not after the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.jobs import TIMING_KEYS

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8

SFT_FLAGS = [
    "--model.impl", "hf", "--trainer.batch_size", "8", "--trainer.micro_batch_tokens", "128",
    "--trainer.seq_len", "64", "--trainer.seed", "3", "--trainer.num_threads", "1", "--optim.lr", "3e-3",
    "--optim.warmup_steps", "2", "--optim.schedule", "cosine", "--data.min_chars", "3", "--data.max_chars", "8",
    "--ckpt.interval_steps", "3", "--ckpt.no_save_hf", "--log.no_plots", "--log.no_progress", "--eval_examples", "0",
]  # fmt: skip
RL_FLAGS = [
    "--trainer.micro_batch_tokens", "256", "--trainer.seq_len", "48",
    "--trainer.seed", "1", "--trainer.num_threads", "1", "--optim.lr", "1e-3",
    "--rollout.prompts_per_step", "2", "--rollout.group_size", "4", "--rollout.max_async", "1",
    "--sampling.max_tokens", "10", "--inference.max_batch_size", "8", "--inference.weight_bucket_mb", "1",
    "--ckpt.interval_steps", "3", "--ckpt.no_save_hf", "--log.no_plots", "--log.no_progress",
]  # fmt: skip


def job_flags(cmd: str, out: Path, model: Path, *extra: str) -> list[str]:
    flags = SFT_FLAGS if cmd == "sft" else RL_FLAGS
    return [
        cmd,
        "--output_dir",
        str(out),
        "--model.path",
        str(model),
        "--trainer.max_steps",
        str(STEPS),
        *flags,
        *extra,
    ]


def parse(argv: list[str]):
    from prime_spmd.config import RLJobConfig, SFTJobConfig, parse_cli

    return parse_cli({"sft": SFTJobConfig, "rl": RLJobConfig}[argv[0]], argv[1:], "test")


def run_in_process(argv: list[str]) -> None:
    from prime_spmd.rl.loop import run_rl
    from prime_spmd.trainer.sft import run_sft

    (run_sft if argv[0] == "sft" else run_rl)(parse(argv))


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def tiny_model(tmp: Path) -> Path:
    from prime_spmd.models.tiny import build_tiny_model

    return build_tiny_model(tmp / "base", "qwen3-nano", seed=0, initializer_range=0.3)


def start_job(argv: list[str], log: Path, step_sleep_s: float, **env: str) -> subprocess.Popen:
    """This file as the job's entry point, in its own session (the test signals exactly what it started)."""
    full = {
        **os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT),
        "STEP_SLEEP_S": str(step_sleep_s), **env,
    }  # fmt: skip
    return subprocess.Popen(
        [sys.executable, __file__, *argv], cwd=ROOT, env=full, stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def num_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _sigterm_then_resume(tmp_path: Path, cmd: str) -> None:
    model = tiny_model(tmp_path)
    ref = tmp_path / f"{cmd}_ref"
    run_in_process(job_flags(cmd, ref, model))
    out, log = tmp_path / f"{cmd}_stopped", tmp_path / f"{cmd}.log"
    job = start_job(job_flags(cmd, out, model), log, step_sleep_s=0.4)
    try:
        wait_for(lambda: num_lines(out / "metrics.jsonl") >= 2 or job.poll() is not None, 120, "two steps")
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=60) == 0, log.read_text()
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    assert ckpts and not any(p.suffix == ".tmp" for p in ckpts), ckpts
    stopped = int(ckpts[-1].name[5:])
    assert 2 <= stopped < STEPS, text
    assert f"stopped by SIGTERM after {stopped} steps: checkpoint saved to {ckpts[-1]}" in text, text
    assert [r["step"] for r in metrics(out)] == list(range(stopped))
    assert not (out / "hf").exists()  # an interrupted run does not export "final" weights
    run_in_process(job_flags(cmd, out, model, "--ckpt.resume"))
    assert without_timing(metrics(out)) == without_timing(metrics(ref))


def test_sigterm_sft_saves_exits_0_and_resumes_exactly(tmp_path: Path) -> None:
    _sigterm_then_resume(tmp_path, "sft")


def test_sigterm_rl_colocated_saves_exits_0_and_resumes_exactly(tmp_path: Path) -> None:
    _sigterm_then_resume(tmp_path, "rl")


def _disjoint(rank: int, world: int, argv: list[str]) -> None:
    if rank == 0:  # the controller alone gets SIGTERM, during step 1: the stop is agreed at step 2
        import prime_spmd.rl.loop as rl

        inner = rl.train_step

        def hooked(*args, **kwargs):
            if hooked.calls == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            hooked.calls += 1
            return inner(*args, **kwargs)

        hooked.calls = 0
        rl.train_step = hooked
    run_in_process(argv)


def test_sigterm_rl_disjoint_inference_rank_leaves(tmp_path: Path) -> None:
    from tests.dist_utils import run_ranks

    model = tiny_model(tmp_path)
    out = tmp_path / "disjoint"
    argv = job_flags("rl", out, model, "--topology.num_inference_ranks", "1", "--topology.timeout_s", "60")
    run_ranks(_disjoint, 2, argv)  # returns only if both ranks returned
    assert [p.name for p in sorted((out / "checkpoints").glob("step_*"))] == ["step_000003"]
    assert [r["step"] for r in metrics(out)] == [0, 1, 2]
    run_ranks(_disjoint_resume, 2, argv + ["--ckpt.resume"])
    assert [r["step"] for r in metrics(out)] == list(range(STEPS))


def _disjoint_resume(rank: int, world: int, argv: list[str]) -> None:
    run_in_process(argv)


def _main() -> int:
    """Entry point of the subprocess jobs: ``python -m prime_spmd`` with the step-sleep hook."""
    import prime_spmd.rl.loop as rl
    import prime_spmd.trainer.sft as sft
    from prime_spmd.__main__ import main

    sleep_s = float(os.environ.get("STEP_SLEEP_S", "0"))
    for mod in (rl, sft):
        inner = mod.train_step

        def slow(*args, _inner=inner, **kwargs):
            out = _inner(*args, **kwargs)
            time.sleep(sleep_s)
            return out

        mod.train_step = slow
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(_main())
