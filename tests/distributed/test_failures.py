"""A rank that dies or hangs ends the whole job, across two torchrun agents ("nodes") on localhost.

- SIGKILL of the inference rank (node 1): the controller's next bridge op fails with "connection
  closed/reset by peer", rank 0 exits non-zero, both agents exit non-zero within seconds; the killed rank's
  agent names it (rank 1, SIGKILL) as its root cause.
- The inference rank hangs (a fault hook, below, sleeps forever in generation): the controller's
  weight broadcast times out after --topology.bridge_timeout_s, node 0's agent exits; node 1's agent loses
  the rendezvous store node 0 hosted and stops its hung worker with SIGTERM. Bound: timeout_s + ~1 s.
  (Not covered, and not handled by torchrun: every rank of the store-hosting node hung outside a
  collective; there srun --kill-on-bad-exit or the Job's backoffLimit 0 ends the job, see docs/scaling.md.)

Run as a script this file is the job's entry point with the fault hook installed (torchrun
tests/distributed/test_failures.py rl ...): FAULT_RANK's ``_generate_and_send`` for batch FAULT_BATCH
writes FAULT_MARKER and sleeps forever. The hook patches only this test's processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from tests.dist_utils import free_port
from tests.distributed.test_multinode import SMALL_RL_FLAGS, start_agents, wait_agents

TIMEOUT_S = 5  # --topology.timeout_s in the hang test


def _agents_argv(entry: list[str], port: int, out: Path, timeout_s: int) -> list[list[str]]:
    """torchrun command lines of node 0 and node 1. As on a cluster, node 0 hosts the rendezvous store
    (is_host) and sorts first in the rendezvous (its address), so it holds rank 0 and node 1 rank 1."""
    job = [
        *entry, "rl", "--config", "configs/reverse_text/rl.toml", "--output_dir", str(out),
        "--model.path", str(out.parent / "model"), "--trainer.max_steps", "400", "--ckpt.interval_steps", "0",
        "--topology.num_inference_ranks", "1", "--topology.timeout_s", str(timeout_s),
        "--topology.bridge_timeout_s", str(timeout_s), *SMALL_RL_FLAGS,
    ]  # fmt: skip
    return [
        ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fail-test", "--rdzv-conf", f"is_host={int(node == 0)}",
         "--local-addr", f"127.0.0.{node + 1}", "--max-restarts", "0", *job]
        for node in (0, 1)
    ]  # fmt: skip


def _metrics_lines(out: Path) -> int:
    m = out / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.exists() else 0


def _wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _worker_of_rank(agent_pids: list[int], rank: int) -> int | None:
    """The pid of the torchrun worker with global RANK ``rank`` among the agents' children."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid in agent_pids and f"RANK={rank}".encode() in environ:
            return int(entry)
    return None


def _root_causes(log: str) -> list[tuple[int, str, str]]:
    """(rank, exitcode line, time) of each torchrun 'Root Cause' block in an agent's log."""
    pattern = r"Root Cause \(first observed failure\):.*?time\s*: (\S+).*?rank\s*: (\d+).*?exitcode\s*: ([^\n]*)"
    return [(int(r), code.strip(), t) for t, r, code in re.findall(pattern, log, re.S)]


def test_killed_inference_rank_ends_every_agent(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argvs = _agents_argv(["-m", "prime_spmd"], free_port(), out, timeout_s=60)
    logs = [tmp_path / "agent0.log", tmp_path / "agent1.log"]
    agents = start_agents(argvs, logs)
    try:
        _wait_for(lambda: _metrics_lines(out) >= 2, 120, "two RL steps")
        victim = _worker_of_rank([a.pid for a in agents], 1)
        assert victim is not None
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
    finally:
        codes = wait_agents(agents, timeout_s=60)
    elapsed = time.monotonic() - t0
    text = {p.name: p.read_text() for p in logs}
    everything = "\n".join(text.values())
    assert None not in codes and all(c != 0 for c in codes), (codes, everything)
    # Far below the 60 s collective timeout: gloo sees the closed connection at once.
    assert elapsed < 20, elapsed
    # Each agent names its first failed rank: node 1 the killed rank 1, node 0 the controller, no earlier.
    (r0, code0, t0_), (r1, code1, t1_) = sorted(c for t in text.values() for c in _root_causes(t))
    assert (r0, r1) == (0, 1) and code0.startswith("1 ") and code1.startswith("-9") and "SIGKILL" in code1
    assert t1_ <= t0_, (t0_, t1_)
    assert re.search(r"Connection (closed|reset) by peer", everything)  # gloo's words vary with the timing
    assert _metrics_lines(out) < 400


def test_hung_inference_rank_times_out_and_ends_every_agent(tmp_path: Path) -> None:
    out, marker = tmp_path / "run", tmp_path / "hung"
    argvs = _agents_argv([__file__], free_port(), out, timeout_s=TIMEOUT_S)
    logs = [tmp_path / "agent0.log", tmp_path / "agent1.log"]
    env = {"FAULT_RANK": "1", "FAULT_BATCH": "3", "FAULT_MARKER": str(marker)}
    agents = start_agents(argvs, logs, env)
    try:
        _wait_for(marker.exists, 120, "the fault hook to hang rank 1")
        t0 = time.monotonic()
    finally:
        codes = wait_agents(agents, timeout_s=90)
    elapsed = time.monotonic() - t0
    everything = "\n".join(p.read_text() for p in logs)
    assert None not in codes and all(c != 0 for c in codes), (codes, everything)
    # bridge_timeout_s for rank 0's bridge op; node 1's agent then loses the store and sends its hung worker
    # SIGTERM, which the worker takes as "stop at the next step boundary" (graceful stop, docs/resume.md)
    # and, being hung, never reaches: torchrun SIGKILLs it after its 30 s grace. Measured 38 s.
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 30 + 20, elapsed
    assert "Timed out waiting 5000ms" in everything
    # Node 0 names rank 0, whose weight broadcast to the hung rank timed out; node 1's agent loses node 0's
    # store and stops its hung worker (rank 1) with SIGTERM, then exits on the store error.
    causes = _root_causes(logs[0].read_text())
    assert [(r, c.split()[0]) for r, c, _ in causes] == [(0, "1")], causes
    node1 = logs[1].read_text()
    assert "closing signal SIGTERM" in node1 and "RendezvousConnectionError" in node1
    assert 2 <= _metrics_lines(out) <= 3  # batch 3 never came


def _install_fault_hook() -> None:
    if int(os.environ.get("RANK", "0")) != int(os.environ["FAULT_RANK"]):
        return
    from prime_spmd.rl import inference_loop

    batch, original = int(os.environ["FAULT_BATCH"]), inference_loop.InferenceLoop._generate_and_send

    def generate_or_hang(self, b: int, version: int) -> None:
        if b == batch:
            Path(os.environ["FAULT_MARKER"]).write_text(json.dumps({"rank": os.environ["RANK"], "batch": b}))
            while True:
                time.sleep(60)
        original(self, b, version)

    inference_loop.InferenceLoop._generate_and_send = generate_or_hang


if __name__ == "__main__":
    _install_fault_hook()
    from prime_spmd.__main__ import main

    sys.exit(main())
