"""The job skeleton the SFT and RL loops share: resume from a checkpoint, the step loop with its
stop/periodic/final saves, HF export, metrics sink and plots.

A loop supplies its own ``step(j)`` (what one step does) and ``save(step)`` (what a checkpoint holds);
this module decides when they run. Every trainer rank calls these functions; ``is_writer`` names the
one rank that writes files (global rank 0, the controller in RL).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prime_spmd.config import to_json
from prime_spmd.log import logger
from prime_spmd.metrics import MetricsSink
from prime_spmd.progress import Progress
from prime_spmd.trainer.build import TrainerParts, strip_prefix
from prime_spmd.trainer.checkpoint import Checkpointer, full_state_dict, save_hf
from prime_spmd.trainer.stop import StopSignal

StepFn = Callable[[int], tuple[dict[str, float], bool]]
"""``step(j)`` -> (step j's metrics, whether the trainer ranks agreed to stop after it)."""


def open_sink(cfg: Any, out: Path, enabled: bool) -> MetricsSink:
    """The run's metrics sink in ``out``, carrying the resolved config (``cfg``: a job config)."""
    return MetricsSink(out, cfg.log, enabled=enabled, run_name=out.name, config=json.loads(to_json(cfg)))


def load_checkpoint(ckpt: Checkpointer, path: Path, parts: TrainerParts) -> dict:
    """Load model, optimizer and LR scheduler from checkpoint ``path``; returns its state dict
    (``step``, ``scheduler`` and the loop's own entries). Collective over the trainer ranks."""
    state = ckpt.load(path, parts.policy, parts.optimizer)
    parts.scheduler.load_state_dict(state["scheduler"])
    return state


def run_steps(
    start: int,
    num_steps: int,
    step: StepFn,
    save: Callable[[int], Path],
    *,
    interval_steps: int,
    save_final: bool,
    stop: StopSignal,
    bar: Progress,
    bar_metric: tuple[str, str],
) -> tuple[dict[str, float], Path | None]:
    """Steps ``start .. num_steps - 1``, with a checkpoint every ``interval_steps`` (0: none) and, with
    ``save_final``, after the last step. When the ranks agree to stop after step j (and j is not the last), save
    w_(j+1) and return at once. ``bar_metric`` is (progress-bar label, metric key). Returns (the last step's
    metrics, the checkpoint saved on a stop, or None when the run went to the end). Every trainer rank calls it.
    """
    label, key = bar_metric
    last: dict[str, float] = {}
    for j in range(start, num_steps):
        last, stop_agreed = step(j)
        bar.update(1, **{label: last.get(key, 0.0)})
        done = j + 1
        if stop_agreed and done < num_steps:
            path = save(done)
            bar.close()
            logger.info(
                f"stopped by {stop.signal_name or 'a signal on another rank'} after {done} steps: "
                f"checkpoint saved to {path}; continue with --ckpt.resume"
            )
            return last, path
        if interval_steps and done % interval_steps == 0 and done < num_steps:
            save(done)
    bar.close()
    if start < num_steps and save_final:
        save(num_steps)
    return last, None


def export_hf(enabled: bool, parts: TrainerParts, out: Path, is_writer: bool) -> Path | None:
    """With ``enabled`` (--ckpt.save_hf), write HF-format weights to ``out/hf`` on the writer rank; returns
    that folder there (None elsewhere or when disabled). Collective over the trainer ranks (full state dict)."""
    if not enabled:
        return None
    sd = strip_prefix(full_state_dict(parts.policy))
    if not is_writer:
        return None
    hf_dir = save_hf(parts.policy.lm, sd, out / "hf", parts.tokenizer)
    logger.info(f"HF-format weights written to {hf_dir}")
    return hf_dir


def close_run(sink: MetricsSink | None, out: Path, plots: bool, is_writer: bool) -> None:
    """Close the metrics sink and, with ``plots`` (--log.plots), draw the run's plots on the writer rank."""
    if sink is not None:
        sink.close()
    if plots and is_writer:
        from prime_spmd.plots import plot_run  # matplotlib: only when plots are asked for

        plot_run(out)
