"""plots: PNGs exist at the expected pixel size and plot exactly the JSONL values; CLI errors."""

from __future__ import annotations

import json
import math

import numpy as np
from PIL import Image

from prime_spmd.__main__ import main
from prime_spmd.config.sections import LogConfig
from prime_spmd.metrics import MetricsSink
from prime_spmd.plots import DPI, GROUP_FIGSIZE_IN, PANEL_SIZE_IN, build_figures, plot_main, plot_run, read_metrics

GROUPS = ["reward", "loss", "mismatch_kl", "policy_lag", "throughput", "lr", "other"]


def write_run(run_dir, num_steps=6):
    with MetricsSink(run_dir, LogConfig(), enabled=True, run_name="r", config={}) as sink:
        for step in range(num_steps):
            sink.log(
                step,
                {
                    "reward_mean": 0.1 * step,
                    "reward_std": 0.5 / (step + 1),
                    "loss": float("nan") if step == 2 else 1.0 / (step + 1),
                    "mismatch_kl": 1e-3 * step,
                    "policy_lag_mean": 1.0,
                    "train_tokens_per_s": 1000.0 + step,
                    "inference_tokens_per_s": 2000.0 + step,
                    "lr": 3e-4,
                    "grad_norm": 2.0 - 0.1 * step,
                    "num_filtered": step % 2,
                    "never_finite": float("inf"),
                    "env": "reverse_text",
                    **({"eval/reward_mean": 0.3} if step % 3 == 0 else {}),
                },
            )


def test_png_files_and_pixel_size(tmp_path, capsys):
    write_run(tmp_path)
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == [f"{g}.png" for g in GROUPS]
    assert all(p.parent == tmp_path / "plots" for p in paths)
    group_px = (round(GROUP_FIGSIZE_IN[0] * DPI), round(GROUP_FIGSIZE_IN[1] * DPI))
    for path in paths[:-1]:
        assert Image.open(path).size == group_px
    # "other": grad_norm and num_filtered (eval/reward_mean is a reward key) -> 2 panels in one row
    assert Image.open(paths[-1]).size == (round(2 * PANEL_SIZE_IN[0] * DPI), round(PANEL_SIZE_IN[1] * DPI))
    # The image is not blank: a plotted line leaves many distinct colours.
    assert len(np.unique(np.asarray(Image.open(paths[0]).convert("RGB")).reshape(-1, 3), axis=0)) > 10


def test_plotted_data_equals_jsonl(tmp_path):
    write_run(tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    figures = build_figures(read_metrics(tmp_path / "metrics.jsonl"))
    assert list(figures) == GROUPS
    plotted = {}
    for name, fig in figures.items():
        for ax in fig.axes:
            if not ax.get_visible():
                continue
            for line in ax.get_lines():
                plotted[line.get_label()] = (name, list(line.get_xdata()), list(line.get_ydata()))
    expected_groups = {
        "reward_mean": "reward",
        "reward_std": "reward",
        "eval/reward_mean": "reward",
        "loss": "loss",
        "mismatch_kl": "mismatch_kl",
        "policy_lag_mean": "policy_lag",
        "train_tokens_per_s": "throughput",
        "inference_tokens_per_s": "throughput",
        "lr": "lr",
        "grad_norm": "other",
        "num_filtered": "other",
    }  # never_finite (all null) and env (a string) have nothing to plot
    assert {k: v[0] for k, v in plotted.items()} == expected_groups
    for key, (_, xs, ys) in plotted.items():
        want = [(r["step"], r[key]) for r in records if key in r]
        assert xs == [s for s, _ in want], key
        assert len(ys) == len(want)
        for y, (_, v) in zip(ys, want):
            assert (v is None and math.isnan(y)) or y == v, (key, ys, want)
    assert math.isnan(plotted["loss"][2][2])  # the NaN loss is a gap, not a dropped point


def test_repeated_step_last_line_wins_and_empty_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0}\n{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 3.0}\n'
    )
    (line,) = build_figures(read_metrics(tmp_path / "metrics.jsonl"))["loss"].axes[0].get_lines()
    assert list(line.get_xdata()) == [0, 1] and list(line.get_ydata()) == [1.0, 3.0]
    (tmp_path / "metrics.jsonl").write_text("")
    assert plot_run(tmp_path) == []


def test_cli_errors_and_success(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert plot_main([str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    assert plot_main([str(tmp_path)]) == 2
    assert str(tmp_path / "metrics.jsonl") in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": \n')
    assert plot_main([str(tmp_path)]) == 2
    assert f"{tmp_path / 'metrics.jsonl'}:2: malformed" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n["not", "an", "object"]\n')
    assert plot_main([str(tmp_path)]) == 2
    assert ":2:" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.5}\n')
    assert main(["plot", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "plots" / "loss.png")]
    assert (tmp_path / "plots" / "loss.png").is_file()
