"""Scoring for the single-turn fast path: verifiers' ``Rubric.score_group`` over all groups of a call at once.

verifiers' ``Rubric.score_group`` calls each reward function once per rollout through
``_call_individual_reward_func``: ``inspect.signature`` and ``score_objects`` per call, an asyncio task
per call, and, for a plain (non-async) function under ``--env.reward_timeout_s``, one hop to the reward
guard's worker thread per call (vf_rewards.py). ``score_groups`` does the same for every group of the
call: the same arguments (``score_objects`` / ``group_score_objects`` per call, filtered by the guarded
wrapper's parameter names, read once from its ``GuardInfo``), functions in rubric order, the same
aggregation into reward, advantage, per-step reward/advantage and metrics, and ``RubricGroup``'s
combination of its rubrics. The differences are in how calls are made: a plain function's calls for
all rollouts of the call run on ONE worker thread in order (``call_burst``, each still under its own
timeout); an async function's calls run as one task each, awaited together (a task past the timeout is
cancelled); without a timeout (``reward_timeout_s`` None) the guarded wrappers are gathered, as verifiers
calls them.

``scoring_blocker`` sends a rubric to verifiers' own ``score_group`` instead: any rubric class that
overrides ``score_group`` or the ``_call_*_reward_func`` helpers, or a function not wrapped by
``guard_rubric``.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import verifiers as vf
from verifiers.envs.multiturn_env import MultiTurnMonitorRubric

from prime_spmd.envs.vf_rewards import call_burst, guard_info

_OWN = ("score_group", "_call_individual_reward_func", "_call_group_reward_func")


def scoring_blocker(rubric: Any) -> str | None:
    """None when ``score_groups`` may score with ``rubric``; else why verifiers' ``score_group`` must."""
    base = vf.RubricGroup if isinstance(rubric, vf.RubricGroup) else vf.Rubric
    cls = type(rubric)
    if not isinstance(rubric, vf.Rubric) or any(getattr(cls, m) is not getattr(base, m) for m in _OWN):
        return f"{cls.__name__} overrides verifiers' scoring"
    if base is vf.RubricGroup:
        for child in rubric.rubrics:
            if (why := scoring_blocker(child)) is not None:
                return why
        return None
    unguarded = [getattr(f, "__name__", repr(f)) for f in rubric.funcs if guard_info(f) is None]
    return f"reward functions {unguarded} are not guarded" if unguarded else None


async def score_groups(rubric: Any, groups: list[list[Any]]) -> None:
    """``rubric.score_group(states)`` for every group (see module doc); requires ``scoring_blocker`` None."""
    if isinstance(rubric, vf.RubricGroup):
        await _score_rubric_group(rubric, groups)
    else:
        await _score_rubric(rubric, groups)


# A state's reward, metrics, advantage and trajectory are its own keys: verifiers' ``State`` methods forward
# only input fields, so the dict's own methods read and write the same values without two Python calls
# each (~900 of them per 64 rollouts here).
_get, _set, _item = dict.get, dict.__setitem__, dict.__getitem__


async def _score_rubric_group(rubric: Any, groups: list[list[Any]]) -> None:
    """``RubricGroup.score_group``'s combination, every group at once."""
    states = [st for g in groups for st in g]
    n = len(states)
    aggregated_rewards = [0.0] * n
    aggregated_metrics: dict[str, list[float]] = {}
    original_rewards = [_get(st, "reward", 0.0) for st in states]
    original_metrics = [_get(st, "metrics", {}).copy() if _get(st, "metrics") else {} for st in states]
    for child in rubric.rubrics:
        await score_groups(child, groups)
        for i, st in enumerate(states):
            aggregated_rewards[i] += _get(st, "reward", 0.0)
            for key, value in (_get(st, "metrics", {}).copy() if _get(st, "metrics") else {}).items():
                if key not in aggregated_metrics:
                    aggregated_metrics[key] = [0.0] * n
                aggregated_metrics[key][i] += value
            _set(st, "reward", original_rewards[i])
            _set(st, "metrics", original_metrics[i].copy())
    for i, st in enumerate(states):
        _set(st, "reward", aggregated_rewards[i])
        if aggregated_metrics:
            if "metrics" not in st:
                _set(st, "metrics", {})
            for key, values in aggregated_metrics.items():
                _item(st, "metrics")[key] = values[i]


async def _score_rubric(rubric: Any, groups: list[list[Any]]) -> None:
    """``Rubric.score_group`` for every group: each function's scores for all groups, then the sums."""
    groups = [g for g in groups if g or _warn_empty(rubric)]
    rewards = [[0.0] * len(g) for g in groups]
    metrics: list[dict[str, list[float]]] = [{} for _ in groups]
    for func, weight in zip(rubric.funcs, rubric.weights):
        info = guard_info(func)
        if info.is_group:
            calls = [_kwargs(info, rubric.group_score_objects(g)) for g in groups]
            flat = await asyncio.gather(*(func(**kw) for kw in calls))
            per_group = list(flat)
        else:
            direct = _direct_names(rubric, info)
            if direct is not None:
                calls = [{k: _DIRECT[k](st) for k in direct} for g in groups for st in g]
            else:
                calls = [_kwargs(info, rubric.score_objects(st)) for g in groups for st in g]
            flat = iter(await _individual(func, info, calls))
            per_group = [[next(flat) for _ in g] for g in groups]
        for gi, scores in enumerate(per_group):
            values = metrics[gi].setdefault(func.__name__, [0.0] * len(groups[gi]))
            for i in range(len(groups[gi])):
                rewards[gi][i] += scores[i] * weight
                values[i] = scores[i]
    for g, agg, met in zip(groups, rewards, metrics):
        avg = sum(agg) / len(g)
        for i, st in enumerate(g):
            _set(st, "reward", agg[i])
            _set(st, "advantage", agg[i] - avg)
            for t in _item(st, "trajectory"):
                if t["advantage"] is None:
                    t["advantage"] = agg[i] - avg
                if t["reward"] is None:
                    t["reward"] = agg[i]
            _set(st, "metrics", {name: values[i] for name, values in met.items()})


async def _tasks(coroutines: list, timeout_s: float) -> list[tuple[bool, Any]]:
    """One task per coroutine, all awaited together: (True, result) or (False, exception) each; a task
    still running after ``timeout_s`` is cancelled (and awaited) and gets (False, TimeoutError), as the
    guard's ``asyncio.wait_for`` gives it, with one task per call instead of two."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    out: list[tuple[bool, Any]] = []
    for t in tasks:
        if t in pending:
            out.append((False, TimeoutError()))
        elif t.cancelled():
            out.append((False, asyncio.CancelledError()))
        else:
            e = t.exception()
            out.append((True, t.result()) if e is None else (False, e))
    return out


_PURE_METRICS = (MultiTurnMonitorRubric.num_turns,)
"""verifiers' own async metrics that only read the state (never suspend, cannot hang): awaited in order,
without a task each (64 tasks and ``asyncio.wait``: ~0.4 ms here); an exception is counted as the guard counts it."""


async def _inline_call(func: Any, kwargs: dict) -> tuple[bool, Any]:
    try:
        return True, await func(**kwargs)
    except Exception as e:  # noqa: BLE001 - counted by the guard's outcome, as in the wrapper
        return False, e


def _warn_empty(rubric: Any) -> bool:
    rubric.logger.warning("No states to score")
    return False


_DIRECT: dict[str, Any] = {
    "prompt": lambda st: st["prompt"],
    "completion": lambda st: st["completion"],
    "answer": lambda st: st.get("answer", ""),
    "state": lambda st: st,
    "info": lambda st: st.get("info", {}),
}
"""The objects ``Rubric.score_objects`` sets from the state itself, in its order, and how it reads them."""


def _direct_names(rubric: Any, info: Any) -> tuple[str, ...] | None:
    """The function's arguments, in ``score_objects``' order, when all of them are ``_DIRECT`` objects and
    ``score_objects`` is verifiers' own with nothing that could replace them (no class object of that name,
    no score-object provider); None otherwise. Then the call's kwargs are read from the state without
    building the rest of ``score_objects`` (the row's fields, the task) per call: ~5 us each here."""
    if info.names is None or type(rubric).score_objects is not vf.Rubric.score_objects:
        return None
    if rubric.score_object_providers or not info.names <= _DIRECT.keys() or info.names & rubric.class_objects.keys():
        return None
    return tuple(k for k in _DIRECT if k in info.names)


def _kwargs(info: Any, merged: dict) -> dict:
    """What verifiers' ``_call_*_reward_func`` passes the guarded wrapper: all objects, or those it names."""
    return dict(merged) if info.names is None else {k: v for k, v in merged.items() if k in info.names}


async def _individual(func: Any, info: Any, calls: list[dict]) -> list[float]:
    """The guarded scores of ``calls`` (kwargs per rollout) of one individual reward function."""
    if info.timeout_s is None:  # inline: the guarded wrapper itself, as verifiers calls it
        return [float(x) for x in await asyncio.gather(*(func(**kw) for kw in calls))]
    targets = [info.split(kw) for kw in calls]
    if getattr(info.func, "__func__", None) in _PURE_METRICS:
        raw = [await _inline_call(info.func, kw) for kw in calls]
    elif info.is_coroutine:
        raw = await _tasks([info.func(**kw) for kw in calls], info.timeout_s)
    else:
        raw = await call_burst([(info.func, kw) for kw in calls], info.timeout_s)
    out = []
    for target, (ok, value) in zip(targets, raw):
        if ok and inspect.isawaitable(value):
            try:
                value = await asyncio.wait_for(value, info.timeout_s)
            except Exception as e:  # noqa: BLE001 - counted by the guard's outcome, as in the wrapper
                ok, value = False, e
        out.append(float(info.outcome(target, ok, value)))
    return out
