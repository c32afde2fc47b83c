"""PNG plots of a run's ``metrics.jsonl``: ``python -m prime_spmd plot RUN_DIR``.

One figure per metric group found in the data (reward, loss, mismatch KL, policy lag, throughput,
learning rate), one line per metric key against ``step``, and every other numeric key in a panel
figure ("other"). Uses matplotlib's ``Figure`` directly (Agg canvas, no pyplot global state), so it is
safe to call at the end of a training run and from tests. A ``null`` value (a NaN or inf the sink
wrote) is plotted as a gap.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from prime_spmd.metrics import METRICS_FILE

PLOTS_DIR = "plots"
DPI = 100
GROUP_FIGSIZE_IN = (8.0, 4.5)  # 800 x 450 px at DPI
PANEL_SIZE_IN = (4.0, 3.0)  # per panel of the "other" figure: 400 x 300 px at DPI
PANEL_COLS = 3

# (figure name, title, y label, which keys belong): the first group that matches a key takes it. Keys are
# matched on their last "/" component, so "eval/reward_mean" joins the reward figure.
GROUPS: list[tuple[str, str, str, Callable[[str], bool]]] = [
    ("reward", "Reward", "reward", lambda k: k.startswith("reward")),
    ("loss", "Loss", "loss", lambda k: k.startswith("loss")),
    ("mismatch_kl", "Trainer-inference mismatch KL", "KL", lambda k: k.startswith("mismatch_kl")),
    ("policy_lag", "Policy lag (steps behind the trainer)", "steps", lambda k: k.startswith("policy_lag")),
    ("throughput", "Throughput", "tokens/s", lambda k: k.endswith("tokens_per_s")),
    ("lr", "Learning rate", "lr", lambda k: k == "lr" or k.startswith(("lr_", "lr/"))),
]
OTHER = "other"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Parse a metrics JSONL file. Raises ValueError naming the file and line of a malformed line."""
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed metrics line ({e.msg}): {line.strip()[:80]!r}") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(f"{path}:{lineno}: a metrics line must be a JSON object with an integer 'step'")
            records.append(record)
    return records


def series_by_key(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Per numeric key: (steps, values) sorted by step; null -> NaN; for a repeated step the last line wins.

    A key is numeric if its non-null values are all int/float (not bool); keys with no finite value
    are left out (nothing to draw).
    """
    by_key: dict[str, dict[int, float]] = {}
    non_numeric: set[str] = set()
    for record in records:
        step = record["step"]
        for key, value in record.items():
            if key == "step" or key in non_numeric:
                continue
            if value is None:
                by_key.setdefault(key, {})[step] = math.nan
            elif isinstance(value, int | float) and not isinstance(value, bool):
                by_key.setdefault(key, {})[step] = float(value)
            else:
                non_numeric.add(key)
    series = {}
    for key, points in by_key.items():
        if key in non_numeric or not any(math.isfinite(v) for v in points.values()):
            continue
        steps = sorted(points)
        series[key] = (steps, [points[s] for s in steps])
    return series


def group_keys(keys: list[str]) -> dict[str, list[str]]:
    """Assign each key to the first GROUPS entry matching its last "/" component, else to "other".

    Empty groups are left out; keys within a group are sorted.
    """
    groups: dict[str, list[str]] = {}
    for key in keys:
        leaf = key.rsplit("/", 1)[-1]
        name = next((name for name, _, _, match in GROUPS if match(leaf)), OTHER)
        groups.setdefault(name, []).append(key)
    order = [name for name, *_ in GROUPS] + [OTHER]
    return {name: sorted(groups[name]) for name in order if name in groups}


def build_figures(records: list[dict[str, Any]]) -> dict[str, Figure]:
    """One matplotlib Figure per non-empty group, keyed by group name; each line is labelled with its key.

    Group figures are GROUP_FIGSIZE_IN at DPI with one axes; "other" has one axes per key (titled with
    the key) in a grid of PANEL_COLS columns.
    """
    series = series_by_key(records)
    figures: dict[str, Figure] = {}
    titles = {name: (title, ylabel) for name, title, ylabel, _ in GROUPS}
    for name, keys in group_keys(list(series)).items():
        if name == OTHER:
            figures[name] = _panel_figure(keys, series)
            continue
        fig = Figure(figsize=GROUP_FIGSIZE_IN, dpi=DPI, layout="constrained")
        ax = fig.add_subplot()
        for key in keys:
            ax.plot(*series[key], label=key, marker="." if len(series[key][0]) < 50 else None)
        title, ylabel = titles[name]
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        figures[name] = fig
    return figures


def _panel_figure(keys: list[str], series: dict[str, tuple[list[int], list[float]]]) -> Figure:
    cols = min(PANEL_COLS, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(PANEL_SIZE_IN[0] * cols, PANEL_SIZE_IN[1] * rows), dpi=DPI, layout="constrained")
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax, key in zip(axes, keys, strict=False):
        ax.plot(*series[key], label=key, marker="." if len(series[key][0]) < 50 else None)
        ax.set_title(key, fontsize="small")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(keys) :]:  # unused cells of the last row
        ax.set_visible(False)
    return fig


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``<run_dir>/plots/<group>.png`` for each group in ``<run_dir>/metrics.jsonl``; return the paths.

    Call on rank 0 only. Raises ValueError when the directory or file is missing or a line is malformed.
    Returns [] (and writes nothing) when the file holds no numeric metrics.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist (expected the output_dir of a run)")
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise ValueError(f"{metrics_path} not found: is {run_dir} the output_dir of a run that logged a step?")
    figures = build_figures(read_metrics(metrics_path))
    if not figures:
        return []
    out_dir = run_dir / PLOTS_DIR
    out_dir.mkdir(exist_ok=True)
    paths = []
    for name, fig in figures.items():
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=DPI)
        paths.append(path)
    return paths


def plot_main(argv: list[str]) -> int:
    """CLI: ``python -m prime_spmd plot RUN_DIR``. Returns 0 on success, 2 on a bad run directory."""
    parser = argparse.ArgumentParser(
        prog="python -m prime_spmd plot", description="Write PNG plots of RUN_DIR/metrics.jsonl into RUN_DIR/plots/."
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's output directory (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not paths:
        print(f"no numeric metrics in {Path(args.run_dir) / METRICS_FILE}; nothing plotted", file=sys.stderr)
    for path in paths:
        print(path)
    return 0
