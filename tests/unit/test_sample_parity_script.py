"""benchmarks/sample_parity.py on CPU with a tiny model: both samplers run on the same prompts and are scored."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sample_parity  # noqa: E402

from prime_spmd.models.tiny import build_tiny_model  # noqa: E402


def test_sample_parity_script_cpu(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "m", "qwen3-nano", seed=0)
    out = tmp_path / "r.json"
    sample_parity.main(
        ["--model", str(model), "--prompts", "3", "--samples", "4", "--max-tokens", "5", "--out", str(out)]
    )
    got = json.loads(out.read_text())
    for side in ("native", "hf_generate"):
        assert got[side]["n"] == 12 and 0.0 <= got[side]["reward"] <= 1.0 and got[side]["reward_se"] >= 0


def test_odd_env_args_are_refused(tmp_path: Path) -> None:
    try:
        sample_parity.main(["--model", str(tmp_path), "--env-args", "alphabet"])
    except SystemExit as err:
        assert "key value pairs" in str(err)
    else:
        raise AssertionError("odd --env-args accepted")
