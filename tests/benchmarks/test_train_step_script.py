"""benchmarks/train_step.py on CPU at the tiny shape: it runs the trainer's real step on RL-shaped batches and
reports every variant; bad variant specs stop before any model is built. Run as subprocesses: the script
initializes a process group and compiles, which must not leak into the test process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--device", "cpu", "--shape", "qwen3-nano"]


def test_train_step_script_cpu(tmp_path: Path) -> None:
    out = tmp_path / "ts"
    cmd = [*SCRIPT, "--prompts", "4", "--group-size", "4", "--steps", "2", "--warmup", "1", "--profile-steps", "1",
           "--out", str(out), "--variants", "shared:compile=off;unshared:compile=off,share_prompts=false;lora:compile=off,lora_rank=4"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=300)
    got = json.loads((out / "results.json").read_text())
    assert [v["variant"] for v in got["variants"]] == ["shared", "unshared", "lora"]
    shared, unshared, lora = got["variants"]
    # only the adapters train (nano, r=4: 8,192 of 80,576 parameters)
    assert 0 < lora["trainable_params"] < shared["trainable_params"] / 5
    assert shared["trained_tokens"] == unshared["trained_tokens"] > 0  # the same batches
    assert shared["model_tokens"] < unshared["model_tokens"] == unshared["packed_tokens"]  # prompts forwarded once
    for v in got["variants"]:
        assert len(v["step_s"]) == 2 and v["median"]["step_s"] > 0 and v["profile"]["top_host"]
        # the sampled steps' host stacks: the trainer's step on (nearly) every sample of the main thread
        st = v["stacks"]
        assert st["steps"] == 2 and len(st["step_s"]) == 2
        main = st["threads"]["MainThread"]
        inclusive = dict(main["inclusive_s"])
        assert 0.8 * sum(st["step_s"]) < inclusive["trainer/step.py:train_step"] <= main["sampled_s"]


@pytest.mark.parametrize("spec", ["a:nonsense=1", "a:share_prompts=maybe", "a:compile"])
def test_bad_variant_names_it(spec: str, tmp_path: Path) -> None:
    r = subprocess.run([*SCRIPT, "--out", str(tmp_path), "--variants", spec], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0
    assert spec.split(":")[1].split("=")[0] in r.stderr
    assert not (tmp_path / "results.json").exists()


def test_train_step_flops_counts_blocks_and_head_apart(tmp_path: Path) -> None:
    # MFU's FLOP count (benchmarks/common.py): blocks x the tokens they ran + LM head x every packed token; the
    # input embedding, a lookup, counts for nothing, and a tied one is counted once in num_params
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import train_step_flops

    for tied, params in ((True, 1000 + 10 * 4), (False, 1000 + 2 * 10 * 4)):
        cfg = {"vocab_size": 10, "hidden_size": 4, "tie_word_embeddings": tied}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert train_step_flops(tmp_path, params, model_tokens=7, head_tokens=20) == 6 * (1000 * 7 + 40 * 20)
