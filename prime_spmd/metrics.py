"""The one metrics sink: JSONL in the run directory always, a console line, wandb when asked.

Only global rank 0 writes (``enabled=True``); every other rank holds a sink whose methods do nothing,
so the loops call ``sink.log(...)`` on every rank with no ``if rank == 0``. Non-finite floats are
written as JSON ``null`` (the file stays valid JSON for any reader) and never raise.

Resume: the file is opened for append, so a resumed run continues it; the loop calls
``truncate_from(resume_step)`` first so that lines a killed run wrote after its last checkpoint do not
appear twice. A line torn by a kill mid-write is dropped when the sink opens the file.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any

from prime_spmd.config.sections import LogConfig
from prime_spmd.log import logger

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id.txt"
# Shown on the console when the caller names no keys (those present, in this order).
DEFAULT_CONSOLE_KEYS = (
    "reward_mean",
    "reward",
    "loss",
    "mismatch_kl",
    "policy_lag_mean",
    "policy_lag",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "train_tokens_per_s",
    "inference_tokens_per_s",
)
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def to_json_value(key: str, value: Any) -> float | int | bool | str | None:
    """A metric value as a JSON-safe scalar: non-finite floats -> None, 0-d tensors/arrays -> Python numbers."""
    if hasattr(value, "item") and not isinstance(value, (int, float, bool, str)):
        value = value.item()  # torch / numpy scalar; one host sync per metric, on rank 0 only
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {key!r} has type {type(value).__name__}; expected a float, int, bool or str scalar")


def format_console_line(step: int, metrics: dict[str, Any], keys: list[str] | tuple[str, ...] | None) -> str:
    """One plain-text line ``step N | key value | ...`` with no control characters."""
    if keys is None:
        keys = [k for k in DEFAULT_CONSOLE_KEYS if k in metrics] or list(metrics)
    parts = [f"step {step}"]
    for key in keys:
        if key not in metrics:
            continue
        value = metrics[key]
        if value is None:
            text = "nan"
        elif isinstance(value, float):
            text = f"{value:.4g}"
        else:
            text = str(value)
        parts.append(f"{key} {text}")
    return _CONTROL_CHARS.sub("", " | ".join(parts))


def drop_torn_tail(path: Path) -> None:
    """Drop a final line torn by a kill mid-write (the file does not end in a newline)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        cut = data.rfind(b"\n") + 1  # 0 when the only line is torn
        logger.warning(f"{path}: dropping a torn last line ({len(data) - cut} bytes) left by an interrupted run")
        f.truncate(cut)


class MetricsSink:
    """Writes each step's metrics to ``<output_dir>/metrics.jsonl``, the console and optionally wandb.

    Call on every rank; pass ``enabled=True`` only on global rank 0 (others do nothing). Side effects on
    rank 0: creates ``output_dir``, appends to ``metrics.jsonl``, writes to stderr, and with
    ``log_cfg.wandb`` starts a wandb run (files under ``$WANDB_DIR`` or ``output_dir``) whose id is kept
    in ``output_dir/wandb_run_id.txt`` so that a resumed job continues the same wandb run.
    """

    def __init__(self, output_dir: str | Path, log_cfg: LogConfig, enabled: bool, run_name: str, config: dict) -> None:
        # Checked on every rank, so a missing optional dependency fails the whole job, not rank 0 alone.
        if log_cfg.wandb and importlib.util.find_spec("wandb") is None:
            raise ValueError(
                "--log.wandb is on but wandb is not installed: `pip install prime-spmd[wandb]` "
                "(or turn it off with --log.wandb False)"
            )
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / METRICS_FILE
        self.log_cfg = log_cfg
        self._file = None
        self._wandb_run = None
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        drop_torn_tail(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        if log_cfg.wandb:
            self._wandb_run = self._start_wandb(run_name, config)

    def _start_wandb(self, run_name: str, config: dict) -> Any:
        import wandb

        id_path = self.output_dir / WANDB_ID_FILE
        if id_path.exists():
            run_id = id_path.read_text().strip()
        else:
            run_id = secrets.token_hex(6)  # wandb ids: [a-z0-9]
            id_path.write_text(run_id + "\n")
        return wandb.init(
            project=self.log_cfg.wandb_project,
            name=run_name,
            config=config,
            mode=self.log_cfg.wandb_mode,
            dir=os.environ.get("WANDB_DIR", str(self.output_dir)),
            id=run_id,
            resume="allow",
        )

    def should_log(self, step: int, last: bool = False) -> bool:
        """Whether ``step`` is a logging step (every ``log.interval_steps``, and always the last step)."""
        return last or step % self.log_cfg.interval_steps == 0

    def log(self, step: int, metrics: dict[str, float | int], console_keys: list[str] | None = None) -> None:
        """Append ``{"step": step, **metrics}`` to the JSONL, print a console line, log to wandb.

        Values may be Python or 0-d torch/numpy scalars; NaN/inf are written as null. Rank 0 only
        (no-op elsewhere); no collectives.
        """
        if not self.enabled:
            return
        assert "step" not in metrics, "'step' is the sink's own key; pass it as the step argument"
        record = {"step": int(step), **{k: to_json_value(k, v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        # sys.stderr is looked up now, not bound at start, so that a live rich progress bar (which
        # redirects stderr) prints this line above the bar instead of breaking it.
        sys.stderr.write(format_console_line(step, record, console_keys) + "\n")
        sys.stderr.flush()
        if self._wandb_run is not None:
            numeric = {k: v for k, v in metrics.items() if not isinstance(v, str)}
            self._wandb_run.log({k: _wandb_value(v) for k, v in numeric.items()}, step=int(step))

    def truncate_from(self, step: int) -> int:
        """Drop JSONL lines whose step is >= ``step`` (call on resume from ``step``); return how many.

        Rewrites the file atomically (temp file + rename). Unparseable lines are dropped with a warning.
        wandb keeps what it has: a resumed wandb run ignores steps at or below its last logged step.
        """
        if not self.enabled or not self.path.exists():
            return 0
        self._file.close()
        kept: list[str] = []
        dropped = 0
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record_step = json.loads(line)["step"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    logger.warning(f"{self.path}:{lineno}: dropping a malformed metrics line")
                    dropped += 1
                    continue
                if record_step >= step:
                    dropped += 1
                else:
                    kept.append(line if line.endswith("\n") else line + "\n")
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        if dropped:
            logger.info(f"resume at step {step}: dropped {dropped} metrics lines from {self.path}")
        return dropped

    def close(self, exit_code: int = 0) -> None:
        """Close the JSONL file and finish the wandb run. Safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            self._wandb_run.finish(exit_code=exit_code)
            self._wandb_run = None

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


def _wandb_value(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
