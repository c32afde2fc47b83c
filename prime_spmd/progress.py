"""Progress bars: rich on a terminal, plain periodic lines (no control characters) in a log file."""

from __future__ import annotations

import sys
import time


class Progress:
    """A progress bar over ``total`` units. ``update(n, **fields)`` advances and shows the fields.

    On a TTY it draws a rich bar; otherwise it prints one plain line at most every ``interval_s``.
    Only call it on rank 0 (or pass ``enabled=False`` elsewhere).
    """

    def __init__(self, total: int, desc: str, enabled: bool = True, interval_s: float = 10.0) -> None:
        self.total, self.desc, self.enabled, self.interval_s = total, desc, enabled, interval_s
        self.n = 0
        self.start = self._last = time.perf_counter()
        self.fields: dict[str, str] = {}
        self._rich = None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                transient=False,
            )
            self._rich.start()
            self._task = self._rich.add_task(desc, total=total, info="")

    def update(self, n: int = 1, **fields: float | int | str) -> None:
        if not self.enabled:
            return
        self.n += n
        self.fields.update({k: (f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in fields.items()})
        info = " ".join(f"{k}={v}" for k, v in self.fields.items())
        if self._rich is not None:
            self._rich.update(self._task, advance=n, info=info)
            return
        now = time.perf_counter()
        if now - self._last >= self.interval_s or self.n >= self.total:
            self._last = now
            elapsed = now - self.start
            eta = elapsed / max(self.n, 1) * (self.total - self.n)
            print(f"{self.desc}: {self.n}/{self.total} [{elapsed:.0f}s<{eta:.0f}s] {info}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
