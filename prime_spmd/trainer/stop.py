"""Graceful stop on SIGTERM/SIGINT, and the guard against runs of non-finite steps.

A signal only sets a flag (``StopSignal.requested``); nothing is interrupted mid-step. The loops
hand the flag to ``train_step``, which sums it into the per-step all-reduce it already does, so every
trainer rank learns "someone was asked to stop" at the same step and they all save the same
checkpoint and leave together (a rank that got the signal a step later, or not at all, agrees).
A second signal restores the default handler and re-raises it: the process then dies at once.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from prime_spmd.log import logger

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Install handlers for SIGTERM and SIGINT on this process (main thread only; elsewhere a no-op).

    ``requested`` becomes True on the first signal; ``restore()`` (or leaving the ``with`` block)
    puts the previous handlers back.
    """

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:  # second signal: stop waiting for the step boundary
            self.restore()
            signal.raise_signal(signum)
            return
        self.requested, self.signal_name = True, name
        logger.warning(f"{name} received: saving a checkpoint at the end of this step, then exiting")

    def __enter__(self) -> StopSignal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


class SkipGuard:
    """Count consecutive skipped-for-non-finite steps; raise once ``max_skipped_steps`` are in a row.

    Every trainer rank sees the same (all-reduced) ``nonfinite`` flag, so all raise at the same step.
    ``max_skipped_steps`` 0 disables the guard. Empty batches do not count: they are not an error.
    """

    def __init__(self, max_skipped_steps: int) -> None:
        self.max_skipped_steps = max_skipped_steps
        self.in_a_row = 0

    def update(self, step: int, nonfinite: bool) -> None:
        self.in_a_row = self.in_a_row + 1 if nonfinite else 0
        if self.max_skipped_steps and self.in_a_row >= self.max_skipped_steps:
            raise RuntimeError(
                f"{self.in_a_row} optimizer steps in a row (the last one step {step}) had a non-finite loss or "
                "gradient norm and were skipped; stopping. Lower --optim.lr, check the data and the model "
                "weights for NaN/inf, or raise --trainer.max_skipped_steps (0 disables this check)"
            )
