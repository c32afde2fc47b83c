"""benchmarks/gpu_suite.sh rl_e2e number_list, its shell logic only: a stand-in python3 and nvidia-smi on PATH record
the commands. The SFT model is kept after an SFT; SFT_REUSE=1 starts RL from it (--sft-model) and refuses to run
without one; both sides get --truncated-reward."""

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


def _suite(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python3", PYTHON), ("nvidia-smi", "#!/bin/bash\necho stub\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    calls = tmp_path / "calls.log"
    calls.unlink(missing_ok=True)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls),
            "SFT_KEEP": str(tmp_path / "kept"), **env}  # fmt: skip
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "benchmarks/gpu_suite.sh", "rl_e2e", str(out), "number_list"], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = calls.read_text().splitlines() if calls.is_file() else []
    return proc, [x for x in lines if "benchmarks/rl_e2e.py" in x]


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
