"""A wall-clock stack sampler for start-up profiles: where a process's threads spend their first seconds.

``rl_e2e.py --timed-child`` starts one when PRIME_BENCH_SAMPLE_S is set (seconds to sample, from the process's
launch): a daemon thread reads every thread's Python stack (``sys._current_frames``) each ``interval_s`` and
``dump`` writes the samples, their stacks stored once each, as JSON. ``summarize`` turns them into seconds per
function (inclusive: a function counts once a sample wherever it sits in the stack; exclusive: the innermost frame)
over a window, e.g. the launch to the first step's start (rl_e2e_report.py ``startup``: ``profile_to_first_step``);
``children`` splits one function's time by its callees. Wall time, not CPU
time: a frame waiting on the GPU, a lock or the disk counts as its caller's time. It costs far less than cProfile,
which times every call (one stack walk a thread every 5 ms, frame names cached per code object), but it is not free:
it takes the GIL at each tick. On the H100 at aa55e61 the sampled warm start-up reached its first step in 26.9 s
against 21.8 s unsampled, within that machine's run-to-run spread of imports alone (8.5-10.7 s), so sampled runs
stand beside an unsampled one rather than replacing it (gpu_suite.sh startup: warm_sampled).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

_NAMES: dict = {}


def is_import_frame(name: str) -> bool:
    """The import machinery's frames (``<frozen importlib._bootstrap>:...``): on every import's stack, so left out of
    inclusive times and callee splits (an import's time goes to the module it ran)."""
    return name.startswith("<frozen")


def frame_name(code) -> str:
    """``dir/file.py:function`` (the file's last two path parts), the key a profile sums over; cached per code object."""
    name = _NAMES.get(code)
    if name is None:
        parts = code.co_filename.replace("\\", "/").rsplit("/", 2)
        name = _NAMES[code] = f"{'/'.join(parts[-2:])}:{code.co_name}"
    return name


class StackSampler:
    """Samples every thread's Python stack (outermost frame first) each ``interval_s`` for ``duration_s``;
    times are seconds since ``t0`` (a ``time.time()``). Start with ``start()``; ``dump(path)`` writes what it has.
    With ``path`` the thread writes it there itself when it ends (``duration_s`` ran out, or ``stop``), so a process
    killed later (a benchmark's time limit) keeps its samples."""

    def __init__(self, t0: float, duration_s: float, interval_s: float = 0.005, path: str | Path | None = None):
        self.t0, self.duration_s, self.interval_s, self.path = t0, duration_s, interval_s, path
        self.stacks: dict[tuple[str, ...], int] = {}
        self.samples: list[tuple[float, str, int, float]] = []  # (time, thread name, stack id, seconds it stands for)
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        me, prev = threading.get_ident(), time.time() - self.t0
        while (now := time.time() - self.t0) < self.duration_s:
            # a tick stands for the time since the last: the sampler waits for the GIL (up to the 5 ms switch
            # interval) on top of its sleep, so ticks come less often than interval_s while a thread holds it
            weight, prev = round(now - prev, 5), now
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None:
                    stack.append(frame_name(frame.f_code))
                    frame = frame.f_back
                key = tuple(reversed(stack))
                sid = self.stacks.setdefault(key, len(self.stacks))
                self.samples.append((round(now, 4), names.get(ident, str(ident)), sid, weight))
            time.sleep(self.interval_s)
        if self.path is not None:
            self.dump(self.path)

    def stop(self) -> dict:
        """End the sampling (waits for the thread's last tick and, with ``path``, its write); returns ``profile()``.
        A sampler whose time already ran out just returns it."""
        self.duration_s = 0.0
        self._thread.join()
        return self.profile()

    def profile(self) -> dict:
        """The samples so far: ``interval_s``, ``stacks`` (lists of frame names, by id), ``samples``."""
        n = len(self.samples)  # the thread may be appending: a sample's stack is stored before the sample
        stacks = [list(k) for k, _ in sorted(self.stacks.items(), key=lambda kv: kv[1])]
        return {"interval_s": self.interval_s, "stacks": stacks, "samples": self.samples[:n]}

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.profile()))


def summarize(profile: dict, start_s: float, end_s: float, top: int = 40) -> dict:
    """Seconds per function over [start_s, end_s) per thread, each sample weighted by the seconds it stands for:
    ``inclusive`` (the function anywhere on the stack; not the import machinery's ``<frozen ...>`` frames) and
    ``exclusive`` (the innermost frame), the ``top`` of each, largest first."""
    stacks = profile["stacks"]
    out: dict = {"window_s": [start_s, end_s], "interval_s": profile["interval_s"], "threads": {}}
    per_thread: dict[str, tuple[Counter, Counter, list[float]]] = {}
    for t, thread, sid, w in profile["samples"]:
        if not start_s <= t < end_s:
            continue
        inc, exc, n = per_thread.setdefault(thread, (Counter(), Counter(), [0.0]))
        stack = stacks[sid]
        for name in set(stack):
            if not is_import_frame(name):
                inc[name] += w
        if stack:
            exc[stack[-1]] += w
        n[0] += w
    for thread, (inc, exc, n) in per_thread.items():
        out["threads"][thread] = {
            "sampled_s": round(n[0], 3),
            "inclusive_s": [[k, round(c, 3)] for k, c in inc.most_common(top)],
            "exclusive_s": [[k, round(c, 3)] for k, c in exc.most_common(top)],
        }
    return out


def children(profile: dict, func: str, start_s: float, end_s: float, thread: str = "MainThread") -> list:
    """Where ``func``'s time went over [start_s, end_s) in ``thread``: seconds per frame it called (the frame right
    after its outermost occurrence on each sample's stack; ``<self>`` where it was the innermost), largest first,
    the import machinery's frames skipped (``is_import_frame``)."""
    split: Counter = Counter()
    for t, th, sid, w in profile["samples"]:
        if th != thread or not start_s <= t < end_s:
            continue
        stack = [f for f in profile["stacks"][sid] if not is_import_frame(f)]
        if func not in stack:
            continue
        i = stack.index(func)
        split[stack[i + 1] if i + 1 < len(stack) else "<self>"] += w
    return [[k, round(c, 3)] for k, c in split.most_common()]


if __name__ == "__main__":
    # python benchmarks/stack_sampler.py PROFILE.json END_S [START_S] [FUNCTION]: the summary, or FUNCTION's callees
    prof = json.loads(Path(sys.argv[1]).read_text())
    start = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    if len(sys.argv) > 4:
        print(json.dumps(children(prof, sys.argv[4], start, float(sys.argv[2])), indent=1))
    else:
        print(json.dumps(summarize(prof, start, float(sys.argv[2])), indent=1))
