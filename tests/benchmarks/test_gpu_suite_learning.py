"""benchmarks/gpu_suite.sh rl_e2e number_list, its shell logic only: a stand-in python3 and nvidia-smi on PATH record
the commands. The SFT model is kept after an SFT; SFT_REUSE=1 starts RL from it (--sft-model) and refuses to run
without one; both sides get --truncated-reward. scale large reruns its 4B offload run with expandable segments after an
out-of-memory error, torch's own included."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# records its arguments; as benchmarks/rl_e2e.py without --sft-model it leaves an SFT model where rl_e2e writes one
PYTHON = """#!/bin/bash
echo "$*" >> "$CALLS"
if [[ " $* " == *" benchmarks/rl_e2e.py "* && " $* " != *" --sft-model "* ]]; then
  mkdir -p /tmp/learning_out/sft/hf && echo '{}' > /tmp/learning_out/sft/hf/config.json
fi
"""


def _run_suite(tmp_path: Path, python: str, part: str, variant: str, env: dict[str, str]):
    """gpu_suite.sh PART OUT VARIANT with the stand-in python3 (text) and nvidia-smi first on PATH; returns the process
    and the rl_e2e.py command lines the stand-in recorded."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python3", python), ("nvidia-smi", "#!/bin/bash\necho stub\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    calls = tmp_path / "calls.log"
    calls.unlink(missing_ok=True)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), **env}
    full.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    proc = subprocess.run(["bash", "benchmarks/gpu_suite.sh", part, str(tmp_path / "out"), variant], cwd=ROOT,
                          env=full, capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = calls.read_text().splitlines() if calls.is_file() else []
    return proc, [x for x in lines if "benchmarks/rl_e2e.py" in x]


def _suite(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    return _run_suite(tmp_path, PYTHON, "rl_e2e", "number_list", {"SFT_KEEP": str(tmp_path / "kept"), **env})


def test_sft_is_kept_and_reused(tmp_path) -> None:
    proc, runs = _suite(tmp_path, SFT_REUSE="1")  # nothing kept yet
    assert proc.returncode == 2 and "no SFT model" in proc.stdout and runs == []
    proc, runs = _suite(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(runs) == 1 and "--sft-model" not in runs[0] and "--truncated-reward 0" in runs[0]
    assert (tmp_path / "kept" / "config.json").is_file()
    proc, runs = _suite(tmp_path, SFT_REUSE="1", TRUNCATED_REWARD="-0.5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(runs) == 1 and f"--sft-model {tmp_path / 'kept'}" in runs[0] and "--truncated-reward -0.5" in runs[0]


# as benchmarks/rl_e2e.py: the first 4B offload run fails the way torch does outside a memory phase; every run records
# its allocator setting
SCALE_PYTHON = """#!/bin/bash
echo "ALLOC=${PYTORCH_CUDA_ALLOC_CONF:-} $*" >> "$CALLS"
if [[ " $* " == *" --out /tmp/scale_4b_offload "* && -n "${OOM:-}" ]]; then
  echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"; exit 1
fi
"""


def _scale_large(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    return _run_suite(tmp_path, SCALE_PYTHON, "scale", "large", {"SCALE_TESTS": "0", **env})


def test_scale_large_retries_a_raw_cuda_oom_with_expandable_segments(tmp_path) -> None:
    proc, runs = _scale_large(tmp_path, OOM="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [x.split(" --out /tmp/")[1].split()[0] for x in runs]
    assert names == ["scale_4b_offload", "scale_4b_offload_expandable", "scale_4b_no_offload"], runs
    assert runs[0].startswith("ALLOC= ") and runs[1].startswith("ALLOC=expandable_segments:True ")
    assert "--rl-limit-s 240" in runs[1] and "--trainer.offload" in runs[1]
    proc, runs = _scale_large(tmp_path)  # no out-of-memory: no retry
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [x.split(" --out /tmp/")[1].split()[0] for x in runs] == ["scale_4b_offload", "scale_4b_no_offload"]
