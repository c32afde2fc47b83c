"""`python -m prime_spmd eval` end to end on a random tiny model, and the pass@k estimator."""

from __future__ import annotations

import json
import math

import pytest

from prime_spmd.__main__ import main
from prime_spmd.eval import pass_at_k


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 3) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    assert pass_at_k(5, 2, 5) == 1.0


def test_eval_subcommand_end_to_end(tmp_path):
    out = tmp_path / "eval"
    argv = [
        "eval",
        "--config", "configs/reverse_text/eval.toml",
        "--model.path", str(tmp_path / "model"),
        "--model.init_tiny", "qwen3-nano",
        "--output_dir", str(out),
        "--env.num_eval_examples", "6",
        "--samples_per_example", "3",
        "--sampling.max_tokens", "8",
        "--inference.max_batch_size", "4",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 18
    assert {(r["example_id"], r["sample_idx"]) for r in rows} == {(e, s) for e in range(6) for s in range(3)}
    for r in rows:
        assert r["prompt"].startswith("<|im_start|>user\n") and r["answer"] is not None
        assert 1 <= r["completion_tokens"] <= 8 and 0.0 <= r["reward"] <= 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_examples"] == 6 and summary["samples_per_example"] == 3
    assert summary["reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / 18)
    assert {"pass@1", "pass@2", "pass@3"} <= set(summary)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["samples_per_example"] == 3 and cfg["env"]["num_eval_examples"] == 6
    # same seed, same samples
    out2 = tmp_path / "eval2"
    assert main(argv[:-10] + argv[-8:] + ["--output_dir", str(out2)]) == 0
    rows2 = [json.loads(line) for line in (out2 / "samples.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in rows2] == [r["completion"] for r in rows]
