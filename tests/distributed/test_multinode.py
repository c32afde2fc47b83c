"""Two torchrun agents on localhost standing in for two nodes: c10d rendezvous, gloo, a short disjoint
RL job started by launch/torchrun_multinode.sh (node 0 trains on 2 ranks, node 1 runs 2 engines).

What this does not cover: NCCL, GPUs, a real network between hosts, vLLM tp groups (see docs/scaling.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
# A tiny job: 3 steps of 16 rollouts (4 prompts x 4) of at most 12 tokens.
SMALL_RL_FLAGS = [
    "--model.init_tiny", "qwen3-nano",
    "--trainer.micro_batch_tokens", "256", "--trainer.seq_len", "48",
    "--rollout.prompts_per_step", "4", "--rollout.group_size", "4",
    "--sampling.max_tokens", "12", "--inference.max_batch_size", "16",
    "--log.no_plots", "--log.no_progress",
]  # fmt: skip


def start_agents(argvs: list[list[str]], logs: list[Path], env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start one agent per argv, each in its own session (so a test can end exactly what it started)."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return [
        subprocess.Popen(
            argv, cwd=ROOT, env=full, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        for argv, log in zip(argvs, logs)
    ]


def wait_agents(agents: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Exit codes of the agents (None for one still running at the deadline, which is then killed with its workers)."""
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    for a in agents:
        try:
            codes.append(a.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for a, code in zip(agents, codes):
        if code is None:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    return codes


def test_two_agents_run_disjoint_rl_to_completion(tmp_path: Path) -> None:
    model, out = tmp_path / "model", tmp_path / "run"  # rank 0 writes the tiny model; node 1 waits on the store
    env = {"NNODES": "2", "HEAD_ADDR": "127.0.0.1", "RDZV_PORT": str(free_port()), "RDZV_ID": "mn-test",
           "GPUS_PER_NODE": "2", "INFERENCE_NODES": "1"}  # fmt: skip
    argv = ["bash", "launch/torchrun_multinode.sh", "configs/reverse_text/rl.toml", "--output_dir", str(out),
            "--model.path", str(model), "--trainer.max_steps", "3", "--topology.timeout_s", "60", *SMALL_RL_FLAGS]  # fmt: skip
    logs = [tmp_path / "agent0.log", tmp_path / "agent1.log"]
    codes = wait_agents(start_agents([argv, argv], logs, env), timeout_s=150)
    text = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in logs)
    assert codes == [0, 0], text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["policy_lag_mean"] for r in rows] == [0.0, 1.0, 1.0]  # max_async 1 from the recipe
    assert all(r["trained_tokens"] > 0 for r in rows)
    assert "trainer ranks [0, 1], inference ranks [2, 3] (2 engine(s) x tp 1)" in text
    assert (out / "hf" / "config.json").is_file() and (out / "checkpoints" / "step_000003").is_dir()
