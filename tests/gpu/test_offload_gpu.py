"""--trainer.offload optimizer in a CUDA RL run (one process, colocated): every step updates with the moments in
pinned host memory, and the final checkpoint saves them. Advantages +1/-1 (benchmarks/speed_advantages.py): with a
random model's all-zero rewards the fused LM-head loss gives no gradient and the optimizer would have nothing to do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
# The RL run of the probes below (3 steps of the reverse-text config on a random nano model) with --trainer.offload
# OFFLOAD; the probe script before it defines ``seen``, printed at the end.
RUN = """
from prime_spmd.models.tiny import build_tiny_model
build_tiny_model(sys.argv[1] + "/model", "qwen3-nano")
from prime_spmd.__main__ import main
sys.argv = ["prime_spmd", "rl", "--config", "configs/reverse_text/rl.toml", "--model.path", sys.argv[1] + "/model",
            "--output_dir", sys.argv[1] + "/run", "--trainer.max_steps", "3", "--trainer.offload", "OFFLOAD",
            "--log.no_progress", "--log.no_plots", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
            "--rollout.advantage", "benchmarks/speed_advantages.py:alternating", "--ckpt.interval_steps", "0"]
try:
    main()
finally:
    print("PROBE " + json.dumps(seen))
"""
PROBE = """
import json, sys, traceback
from prime_spmd.trainer import offload
seen = []
step = offload.HostOffloadAdamW.step
def probe(self, closure=None):
    out = step(self, closure)
    moments = [s[m] for s in self.state.values() for m in offload.MOMENTS]
    seen.append(dict(grads=sum(p.grad is not None for g in self.param_groups for p in g["params"]), states=len(self.state),
                     host=all(m.to_local().device.type == "cpu" and m.to_local().is_pinned() for m in moments),
                caller=[f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in traceback.extract_stack()[-5:-1]]))
    return out
offload.HostOffloadAdamW.step = probe
""" + RUN.replace("OFFLOAD", "optimizer")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_moments_stay_on_the_host_in_a_cuda_run(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    lines = [x for x in out.stdout.splitlines() if x.startswith("PROBE ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    seen = json.loads(lines[-1][len("PROBE ") :])
    steps = [x for x in (out.stdout + out.stderr).splitlines() if "step" in x]  # the run's own account, for a failure
    assert len(seen) == 3 and all(s["states"] == s["grads"] > 0 and s["host"] for s in seen), (seen, steps[-40:])
    assert (tmp_path / "run" / "checkpoints").is_dir()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_large_moments_are_registered_pinned_memory_of_their_exact_size() -> None:
    """A moment of at least REGISTER_MIN_BYTES: ordinary host memory registered with CUDA, which torch sees as pinned
    (non_blocking copies are asynchronous), and none of it from torch's rounding pinned allocator."""
    from prime_spmd.trainer import offload

    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    n = 9 * (1 << 20)  # 36 MiB of fp32: a power-of-two allocator would hand out 64 MiB
    host = offload._host_zeros(torch.Size([n]), pin=True)
    assert host.is_pinned() and host.numel() == n
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    host.fill_(3.0)
    dev = host.to("cuda", non_blocking=True)
    back = torch.empty_like(host)
    back.copy_(dev * 2, non_blocking=True)
    torch.cuda.synchronize()
    assert bool((back == 6.0).all())


MASTER_PROBE = """
import json, sys
import torch
from prime_spmd.inference import factory
from prime_spmd.trainer import offload
steps, shared = [], {}
seen = dict(steps=steps, engine=shared)  # filled as the run goes
step, count = offload.HostMasterAdamW.step, factory.count_shared
def probe(self, closure=None):
    out = step(self, closure)
    ps = [p for g in self.param_groups for p in g["params"]]
    steps.append(dict(bf16=all(p.dtype == torch.bfloat16 and p.is_cuda for p in ps), states=len(self.state),
                     host=all(s["master"].device.type == "cpu" and s["master"].is_pinned() for s in self.state.values()),
                     cast=all(torch.equal(p.detach(), self.state[p]["master"].cuda().bfloat16()) for p in ps)))
    return out
def count_probe(engine_model, trainer_lm, report):
    count(engine_model, trainer_lm, report)
    shared.update(owned=report.owned, shared=report.shared)
    return report
offload.HostMasterAdamW.step, factory.count_shared = probe, count_probe
""" + RUN.replace("OFFLOAD", "master")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_master_offload_cuda_run_shares_the_bf16_weights_with_the_engine(tmp_path: Path) -> None:
    """--trainer.offload master in a CUDA RL run: bf16 parameters on the device, each step's fp32 masters in pinned
    host memory with every parameter equal to its master cast, and an engine that owns no weight."""
    out = subprocess.run([sys.executable, "-c", MASTER_PROBE, str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    lines = [x for x in out.stdout.splitlines() if x.startswith("PROBE ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    seen = json.loads(lines[-1][len("PROBE ") :])
    assert seen["engine"]["owned"] == 0 and seen["engine"]["shared"] > 0, seen
    assert len(seen["steps"]) == 3 and all(
        s["bf16"] and s["host"] and s["cast"] and s["states"] > 0 for s in seen["steps"]
    )
