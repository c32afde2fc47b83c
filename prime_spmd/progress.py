"""Progress bars: rich on a terminal, plain periodic lines (no control characters) in a log file."""

from __future__ import annotations

import re
import sys
import time

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def format_duration(seconds: float) -> str:
    """``75`` -> ``1:15``, ``3725`` -> ``1:02:05`` (what a log reader scans for)."""
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """A progress bar over ``total`` units. ``update(n, **fields)`` advances and shows the fields.

    On a TTY it draws a rich bar (which also redirects stderr, so log lines print above it); otherwise
    it prints one plain line ``desc: n/total [elapsed<eta, rate/s] k=v ...`` at most every
    ``interval_s`` and at the end. Only call it on rank 0 (or pass ``enabled=False`` elsewhere).
    Usable as a context manager.
    """

    def __init__(self, total: int, desc: str, enabled: bool = True, interval_s: float = 10.0) -> None:
        self.total, self.desc, self.enabled, self.interval_s = total, desc, enabled, interval_s
        self.n = 0
        self.start = self._last = time.perf_counter()
        self.fields: dict[str, str] = {}
        self._printed_n = 0
        self._rich = None
        if enabled and sys.stderr.isatty():
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
        """Advance by ``n`` and set the shown fields (floats to 4 significant digits)."""
        if not self.enabled:
            return
        self.n += n
        self.fields.update({k: (f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in fields.items()})
        if self._rich is not None:
            self._rich.update(self._task, advance=n, info=self._info())
            return
        now = time.perf_counter()
        if now - self._last >= self.interval_s or self.n >= self.total:
            self._last = now
            self._print_line(now)

    def _info(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.fields.items())

    def _print_line(self, now: float) -> None:
        elapsed = now - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        eta = format_duration((self.total - self.n) / rate) if rate > 0 and self.n < self.total else "0:00"
        line = f"{self.desc}: {self.n}/{self.total} [{format_duration(elapsed)}<{eta}, {rate:.3g}/s] {self._info()}"
        print(_CONTROL_CHARS.sub("", line.rstrip()), file=sys.stderr, flush=True)
        self._printed_n = self.n

    def close(self) -> None:
        """Stop the bar; in plain mode print a final line if the last progress was not shown yet."""
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
        elif self.enabled and self.n != self._printed_n:
            self._print_line(time.perf_counter())
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
