"""benchmarks/train_step.py on CPU at the tiny shape: it runs the trainer's real step on RL-shaped batches and
reports every variant; bad variant specs stop before any model is built."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_step  # noqa: E402


def test_train_step_script_cpu(tmp_path: Path) -> None:
    out = tmp_path / "ts"
    train_step.main(["--device", "cpu", "--shape", "qwen3-nano", "--prompts", "4", "--group-size", "4",
                     "--steps", "2", "--warmup", "1", "--profile-steps", "1", "--out", str(out),
                     "--variants", "shared:compile=off;unshared:compile=off,share_prompts=false"])  # fmt: skip
    got = json.loads((out / "results.json").read_text())
    assert [v["variant"] for v in got["variants"]] == ["shared", "unshared"]
    shared, unshared = got["variants"]
    assert shared["trained_tokens"] == unshared["trained_tokens"] > 0  # the same batches
    assert shared["model_tokens"] < unshared["model_tokens"] == unshared["packed_tokens"]  # prompts forwarded once
    for v in got["variants"]:
        assert len(v["step_s"]) == 2 and v["median"]["step_s"] > 0 and v["profile"]["top_host"]


@pytest.mark.parametrize("spec", ["a:nonsense=1", "a:share_prompts=maybe", "a:compile"])
def test_bad_variant_names_it(spec: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as err:
        train_step.main(["--device", "cpu", "--shape", "qwen3-nano", "--out", str(tmp_path), "--variants", spec])
    assert spec.split(":")[1].split("=")[0] in str(err.value)
    assert not (tmp_path / "results.json").exists()
