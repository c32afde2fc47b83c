"""Reward-function guards for verifiers rubrics: errors and timeouts are counted, never fatal.

verifiers' ``Rubric`` already turns a raising reward function into 0.0 (with a log line), but it
does not count it anywhere and it has no timeout: one hanging reward function stalls the whole
group, and with it the RL step. ``guard_rubric`` wraps every reward function and metric of a
rubric (recursively through ``RubricGroup``) so that each call
- runs under a timeout: coroutine functions via ``asyncio.wait_for``; plain functions on a pool of
  reused daemon worker threads (a hung one is abandoned: its thread leaks until the function
  returns, a new worker takes later calls, and being a daemon it never blocks interpreter exit);
- on an exception, a timeout, or a garbage result (not a finite float, or a group function's list
  of the wrong length) counts ``reward_errors`` / ``reward_timeouts`` in the rollout's
  ``state["ps_bridge"]`` and returns 0.0. The bridge then gives the whole rollout reward 0.

The wrapper keeps the function's ``__name__`` (metric keys) and its signature (verifiers passes
arguments by parameter name and detects group functions by their plural parameter names), adding a
``state`` / ``states`` keyword so it can record the failure on the right rollout.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import verifiers as vf

from prime_spmd.envs.vf_client import bump_stat

logger = logging.getLogger("prime_spmd")
_GUARDED = "__ps_guarded__"


def guard_rubric(rubric: Any, timeout_s: float | None) -> None:
    """Wrap every function of ``rubric`` (and of nested rubrics) in place; idempotent."""
    if isinstance(rubric, vf.RubricGroup):
        for child in rubric.rubrics:
            guard_rubric(child, timeout_s)
    rubric.funcs = [f if getattr(f, _GUARDED, False) else _guard(rubric, f, timeout_s) for f in rubric.funcs]


@dataclass(frozen=True, slots=True)
class GuardInfo:
    """What a guarded wrapper knows of its function."""

    name: str
    is_group: bool
    key: str
    """``state`` or ``states``: the keyword the guard reads the rollout(s) from."""
    passes_key: bool
    """Whether ``func`` itself takes ``key`` (else the guard pops it before the call)."""
    timeout_s: float | None

    def split(self, kwargs: dict) -> Any:
        """The rollout (or list of rollouts) a failure is counted on; pops ``key`` when ``func`` lacks it."""
        return kwargs.get(self.key) if self.passes_key else kwargs.pop(self.key, None)

    def outcome(self, target: Any, ok: bool, value: Any) -> Any:
        """The guarded result of one call: ``value`` checked, or 0.0 (per state) with the failure counted."""
        states = list(target or []) if self.is_group else [target]
        if ok:
            try:
                return _check(value, len(states) if self.is_group else None)
            except ValueError as e:
                value = e
        if isinstance(value, TimeoutError):
            counter, detail = "reward_timeouts", f"timed out after {self.timeout_s} s"
        else:
            counter, detail = "reward_errors", f"{type(value).__name__}: {value}"
        logger.warning("reward function %s failed (%s); the rollout gets reward 0", self.name, detail)
        for st in states:
            if st is not None:
                bump_stat(st, counter)
        return [0.0] * len(states) if self.is_group else 0.0


def _guard(rubric: Any, func: Callable, timeout_s: float | None) -> Callable:
    is_group = rubric._is_group_func(func)
    key = "states" if is_group else "state"
    sig = inspect.signature(func)
    params = list(sig.parameters.values())
    passes_key = key in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in params)
    if not passes_key:
        extra = inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=None)
        params.append(extra)
        sig = sig.replace(parameters=params)
    name = getattr(func, "__name__", type(func).__name__)
    info = GuardInfo(name=name, is_group=is_group, key=key, passes_key=passes_key, timeout_s=timeout_s)

    async def guarded(**kwargs: Any) -> Any:
        target = info.split(kwargs)
        try:
            return info.outcome(target, True, await _call(func, kwargs, timeout_s))
        # Any exception from user code: the point of the guard is that the run goes on (counted).
        except Exception as e:  # noqa: BLE001
            return info.outcome(target, False, e)

    guarded.__name__ = name
    guarded.__qualname__ = getattr(func, "__qualname__", name)
    guarded.__doc__ = getattr(func, "__doc__", None)
    guarded.__signature__ = sig  # type: ignore[attr-defined]
    setattr(guarded, _GUARDED, info)
    return guarded


def _check(value: Any, group_len: int | None) -> Any:
    if group_len is None:
        x = float(value)
        if not math.isfinite(x):
            raise ValueError(f"reward {value!r} is not finite")
        return x
    values = [float(v) for v in value]
    if len(values) != group_len or not all(math.isfinite(v) for v in values):
        raise ValueError(f"group reward {value!r}: expected {group_len} finite floats")
    return values


async def _call(func: Callable, kwargs: dict, timeout_s: float | None) -> Any:
    if inspect.iscoroutinefunction(func):
        return await asyncio.wait_for(func(**kwargs), timeout_s)
    if timeout_s is None:
        result = func(**kwargs)
    else:
        result = await asyncio.wait_for(_in_daemon_thread(func, kwargs), timeout_s)
    if inspect.isawaitable(result):
        result = await asyncio.wait_for(result, timeout_s)
    return result


def _in_daemon_thread(func: Callable, kwargs: dict) -> asyncio.Future:
    """Run ``func(**kwargs)`` on a daemon worker thread; the future resolves in the calling loop."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    _WORKERS.submit(func, kwargs, loop, fut)
    return fut


class _DaemonWorkers:
    """Daemon threads reused across reward calls: a new one starts only when none is idle.

    Starting a thread per call cost ~1 ms of the event loop's time (``Thread.start`` blocks until the
    thread runs, which on a busy machine waits for the GIL); reusing idle workers removes it. A hung
    function keeps its worker busy forever (that thread leaks, as before); it is never counted idle,
    so later calls never queue behind it. Invariant: every queued call is matched by one worker that
    will ``get`` it, either a worker that counted itself idle or one started for it.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        # Also after fork: the child has none of the parent's threads, so none of them is idle.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, func: Callable, kwargs: dict, loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._queue.put((func, kwargs, loop, fut))
        if spawn:
            threading.Thread(target=self._work, name="ps-reward-fn", daemon=True).start()

    def _work(self) -> None:
        while True:
            func, kwargs, loop, fut = self._queue.get()
            try:
                out = (True, func(**kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                out = (False, e)
            # Idle before the result wakes the loop: a call made right after reuses this worker.
            with self._lock:
                self._idle += 1
            try:
                loop.call_soon_threadsafe(_settle, fut, *out)
            except RuntimeError:  # the loop has closed: the call timed out and nobody awaits it
                pass
            del func, kwargs, loop, fut, out  # an idle worker holds no references


def _settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if not fut.done():
        fut.set_result(value) if ok else fut.set_exception(value)


_WORKERS = _DaemonWorkers()
os.register_at_fork(after_in_child=_WORKERS._reset)
