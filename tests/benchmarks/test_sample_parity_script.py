"""benchmarks/sample_parity.py on CPU with a tiny model: both samplers run on the same prompts and are scored.
Run as subprocesses (the script's model loading and generate must not change the test process's state)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from prime_spmd.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, str(ROOT / "benchmarks" / "sample_parity.py")]


def test_sample_parity_script_cpu(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "m", "qwen3-nano", seed=0)
    out = tmp_path / "r.json"
    cmd = [*SCRIPT, "--model", str(model), "--prompts", "3", "--samples", "4", "--max-tokens", "5", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300)
    got = json.loads(out.read_text())
    for side in ("native", "hf_generate"):
        assert got[side]["n"] == 12 and 0.0 <= got[side]["reward"] <= 1.0 and got[side]["reward_se"] >= 0


def test_odd_env_args_are_refused(tmp_path: Path) -> None:
    r = subprocess.run([*SCRIPT, "--model", str(tmp_path), "--env-args", "alphabet"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and "key value pairs" in r.stderr
