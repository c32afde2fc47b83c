"""MetricsSink: JSONL contents, resume truncation, NaN handling, plain console lines, wandb offline."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import time

import numpy as np
import pytest
import torch

from prime_spmd.config.sections import LogConfig
from prime_spmd.metrics import METRICS_FILE, WANDB_ID_FILE, MetricsSink

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # everything but \t and \n


def read_lines(path):
    # parse_constant rejects NaN/Infinity tokens: the file must be strict JSON.
    def strict(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    return [json.loads(line, parse_constant=strict) for line in path.read_text().splitlines()]


def test_jsonl_console_and_value_types(tmp_path, capsys):
    with MetricsSink(tmp_path / "run", LogConfig(), enabled=True, run_name="r", config={"a": 1}) as sink:
        sink.log(0, {"reward_mean": 0.5, "loss": 1.25, "num_samples": 8})
        sink.log(1, {"reward_mean": torch.tensor(0.75), "loss": np.float32(0.5), "num_samples": np.int64(9)})
        sink.log(2, {"loss": float("nan"), "grad_norm": float("inf"), "lr": -math.inf, "note": "x\x1b[31my"})
    lines = read_lines(tmp_path / "run" / METRICS_FILE)
    assert lines == [
        {"step": 0, "reward_mean": 0.5, "loss": 1.25, "num_samples": 8},
        {"step": 1, "reward_mean": 0.75, "loss": 0.5, "num_samples": 9},
        {"step": 2, "loss": None, "grad_norm": None, "lr": None, "note": "x\x1b[31my"},
    ]
    err = capsys.readouterr().err
    assert not CONTROL.search(err), repr(err)
    console = err.strip().splitlines()
    assert console[0] == "step 0 | reward_mean 0.5 | loss 1.25"  # default keys: the known ones present
    assert console[2] == "step 2 | loss nan | lr nan | grad_norm nan"


def test_console_keys_and_interval(tmp_path, capsys):
    sink = MetricsSink(tmp_path, LogConfig(interval_steps=5), enabled=True, run_name="r", config={})
    sink.log(3, {"a": 1.0, "b\nc": 2, "d": 3}, console_keys=["b\nc", "a", "missing"])
    sink.close()
    sink.close()  # idempotent
    assert capsys.readouterr().err == "step 3 | bc 2 | a 1\n"
    assert [sink.should_log(s) for s in (0, 4, 5, 7)] == [True, False, True, False]
    assert sink.should_log(7, last=True)


def test_disabled_sink_writes_nothing(tmp_path, capsys):
    sink = MetricsSink(tmp_path / "run", LogConfig(), enabled=False, run_name="r", config={})
    sink.log(0, {"loss": 1.0})
    assert sink.truncate_from(0) == 0
    sink.close()
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().err == ""


def test_resume_truncates_and_appends(tmp_path):
    cfg = LogConfig()
    sink = MetricsSink(tmp_path, cfg, enabled=True, run_name="r", config={})
    for step in range(5):
        sink.log(step, {"loss": float(step)})
    sink.close()
    # A kill mid-write leaves a torn last line; opening the sink drops it.
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 5, "lo')
    sink = MetricsSink(tmp_path, cfg, enabled=True, run_name="r", config={})
    assert sink.truncate_from(3) == 2
    sink.log(3, {"loss": 30.0})
    sink.close()
    assert read_lines(tmp_path / METRICS_FILE) == [
        {"step": 0, "loss": 0.0},
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.0},
        {"step": 3, "loss": 30.0},
    ]


def test_bad_value_type_names_key(tmp_path):
    with MetricsSink(tmp_path, LogConfig(), enabled=True, run_name="r", config={}) as sink:
        with pytest.raises(TypeError, match="'hist'"):
            sink.log(0, {"hist": [1, 2]})


def test_wandb_missing_is_a_clear_error_on_every_rank(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    for enabled in (True, False):
        with pytest.raises(ValueError, match=re.escape("pip install prime-spmd[wandb]")):
            MetricsSink(tmp_path, LogConfig(wandb=True), enabled=enabled, run_name="r", config={})


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")
    cfg = LogConfig(wandb=True, wandb_mode="offline", wandb_project="proj")
    sink = MetricsSink(tmp_path / "run", cfg, enabled=True, run_name="my-run", config={"trainer": {"lr": 0.1}})
    run = sink._wandb_run
    assert run.name == "my-run" and run.project == "proj" and run.config["trainer"] == {"lr": 0.1}
    sink.log(0, {"reward_mean_value": 0.123456789, "loss": float("nan")})
    sink.log(1, {"reward_mean_value": 0.987654321, "loss": 2.0})
    sink.close()
    run_id = (tmp_path / "run" / WANDB_ID_FILE).read_text().strip()
    files = list(wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1, list(wandb_dir.rglob("*"))
    # wandb's service process may still be writing the offline file when finish() returns (seen under
    # load: only the 7-byte header at first); give it a few seconds
    deadline = time.monotonic() + 10
    while b"0.987654321" not in files[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.1)
    data = files[0].read_bytes()  # history values are stored as JSON text inside protobuf records
    assert b"reward_mean_value" in data and b"0.123456789" in data and b"0.987654321" in data
    assert len(read_lines(tmp_path / "run" / METRICS_FILE)) == 2
