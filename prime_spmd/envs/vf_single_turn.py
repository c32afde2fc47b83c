"""The single-turn fast path of the classic verifiers bridge: one engine batch for all rollouts of a call.

verifiers' ``run_group`` runs each rollout as its own task: a turn loop that evaluates every stop
condition through ``inspect.signature`` before and after the turn, one ``asyncio`` round trip per
engine request, an ``asyncio.to_thread`` hop in ``add_model_response`` and ``state_to_output`` in a
thread; groups are scored one after another as they finish. With a zero-cost fake engine that was
~35 ms of CPU per 64 rollouts here (docs/log.md), +20-30% of a 32-token generation on the
H200. For environments that do exactly one turn (``max_turns == 1``, e.g. ``vf.SingleTurnEnv``)
``run_single_turn`` does the same steps phase by phase over all rollouts of the call:

1. per rollout, verifiers' own ``init_state``, ``setup_state`` and ``get_prompt_messages``;
2. the prompts rendered (cached per distinct prompt) and sampled as ONE ``engine.generate`` batch, with
   the request ids, seeds and sampling arguments ``EngineClient.get_native_response`` would give them;
3. per rollout, the client's ``from_native_response`` and ``add_model_response`` (MultiTurnEnv's own
   inlined without the thread hop; an override is called as is); the stop condition, found in
   ``is_completed``'s order by calling MultiTurnEnv's conditions directly, rendered by ``_render_stop``;
   the environment's ``cleanup``;
4. all groups scored at once by ``vf_scoring.score_groups`` (verifiers' ``Rubric`` / ``RubricGroup``
   scoring with each reward function's signature read once, and a plain function's calls for every
   rollout in one hop to the reward guard's worker thread; a rubric that overrides scoring gets its own
   ``score_group`` per group), then ``rubric.cleanup`` (skipped when it has no handler to run); the states
   become ``Rollout`` s without the ``state_to_output`` copy.

When every per-rollout method of the environment is verifiers' own (``_inline``: they only update the
state and never suspend), each phase awaits the rollouts one after another instead of as one task per
rollout; an environment that overrides one of them (it may wait on I/O) has them gathered, as verifiers
runs them. The environment's cleanup handlers are called with the arguments ``maybe_call_with_named_args``
would pass, their signatures read once per call instead of once per rollout.

``single_turn_blocker`` says why an environment takes the general path (``run_group``) instead: more
than one turn, overridden ``rollout`` / ``get_model_response``, a rollout timeout (it would bound the
generation), a remote env client, or stop conditions other than MultiTurnEnv's own. Rollouts, rewards,
metrics and what reward functions see are the same on both paths (tests/unit/test_vf_single_turn.py).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import verifiers as vf
from verifiers.types import TimeSpan, TrajectoryStep, TrajectoryStepTokens
from verifiers.utils.error_utils import ErrorChain
from verifiers.utils.message_utils import maybe_normalize_messages
from verifiers.utils.response_utils import parse_response_message

from prime_spmd.envs.rollout import Rollout
from prime_spmd.envs.vf_client import EngineClient
from prime_spmd.envs.vf_output import failed_group, output_to_rollout
from prime_spmd.envs.vf_scoring import score_groups, scoring_blocker
from prime_spmd.inference.engine import InferenceEngine, Request

logger = logging.getLogger("prime_spmd")

MODEL = "prime-spmd"
"""The model name the bridge passes to verifiers (both paths)."""
# Read once: ``vf.X`` goes through verifiers' lazy module ``__getattr__`` (~2 us a read, twice per rollout).
_OWN_ADD_MODEL_RESPONSE = vf.MultiTurnEnv.add_model_response
_OWN_RENDER_STOP = vf.Environment._render_stop


def single_turn_blocker(vf_env: Any) -> str | None:
    """None when ``run_single_turn`` may run ``vf_env``; else why it takes the general path."""
    cls = type(vf_env)
    if not isinstance(vf_env, vf.MultiTurnEnv) or getattr(vf_env, "max_turns", None) != 1:
        return "not a MultiTurnEnv with max_turns == 1"
    if cls.rollout is not vf.MultiTurnEnv.rollout or cls.get_model_response is not vf.Environment.get_model_response:
        return "overrides rollout or get_model_response"
    if getattr(vf_env, "timeout_seconds", None) is not None:
        return "has a rollout timeout (timeout_seconds)"
    if getattr(vf_env, "env_client", None) is not None:
        return "runs on a remote env server (env_client)"
    own = [c for c in vf_env._stop_conditions if getattr(c, "__func__", None) is not _own(c)]
    if own:
        return f"has its own stop conditions {[getattr(c, '__name__', repr(c)) for c in own]}"
    return None


def _own(method: Any) -> Any:
    """MultiTurnEnv's function of the same name as ``method`` (None if it has none)."""
    return getattr(vf.MultiTurnEnv, getattr(method, "__name__", ""), None)


@dataclass(slots=True)
class _Group:
    example_id: int
    inputs: list[dict]
    states: list[Any] = field(default_factory=list)
    failed: bool = False


async def run_single_turn(
    vf_env: Any,
    client: EngineClient,
    engine: InferenceEngine,
    inputs: list[tuple[int, list[dict]]],
    sampling_args: dict,
) -> list[list[Rollout]]:
    """Run every group's single-turn rollouts with one engine batch (see module doc); one list per group.

    ``inputs``: (example id, the group's RolloutInputs) per group. A group whose environment code raises
    (an exception other than ``vf.Error``, as would escape ``run_group``) fails as a whole
    (``group_errors``); a ``vf.Error`` is recorded on its rollout, as verifiers' turn loop records it.
    Raises ``RuntimeError`` when the engine fails. Called inside an event loop; blocks it while the
    engine generates (nothing else runs then: every rollout of the call waits on that batch).
    """
    groups = [_Group(eid, inp) for eid, inp in inputs]
    inline, fresh = _inline(vf_env), _fresh_states(vf_env)
    for g in groups:
        args = copy.deepcopy(sampling_args)  # one copy per group, as run_group gets one
        await _guarded(g, _setup_group(vf_env, client, g, args))
    pending: list[tuple[_Group, Any, tuple]] = []
    for g in groups:
        if not g.failed:
            reqs = await _guarded(g, _each(inline, (_request(vf_env, client, st, fresh) for st in g.states)))
            pending += [(g, st, r) for st, r in zip(g.states, reqs or []) if r is not None]
    requests = [
        Request(prompt_ids=r[1], sampling=r[2], request_id=f"single-{i}") for i, (_, _, r) in enumerate(pending)
    ]
    t0 = time.time()
    try:
        completions = engine.generate(requests) if requests else []
    # Any engine error: the whole call fails loudly, as the general path does for a failed engine step.
    except Exception as e:  # noqa: BLE001
        raise RuntimeError("the inference engine failed during verifiers rollouts") from e
    span = TimeSpan(start=t0, end=time.time())
    by_group: dict[int, list] = {}
    for (g, st, (messages, ids, _, turn)), c in zip(pending, completions):
        st["timing"].model.spans.append(span.model_copy())
        by_group.setdefault(id(g), []).append((st, messages, client.engine_response(ids, c, turn)))
    live = [g for g in groups if not g.failed]
    # All groups at once: an environment's own awaits (e.g. I/O in add_trajectory_step) overlap.
    await _each(
        inline,
        (_guarded(g, _each(inline, (_finish(vf_env, client, *a) for a in by_group.get(id(g), [])))) for g in live),
    )
    cleanup = _cleanup_calls(vf_env)
    await _each(inline, (_guarded(g, _close_group(vf_env, g, cleanup)) for g in live))
    await _score(vf_env, [g for g in groups if not g.failed])
    if _rubric_cleans_up(vf_env.rubric):
        await asyncio.gather(*(_guarded(g, _cleanup_rubric(vf_env, g)) for g in groups if not g.failed))
    return [
        failed_group(vf_env, client.renderer, g.example_id, g.inputs)
        if g.failed
        else [output_to_rollout(st, g.example_id, k, client.renderer) for k, st in enumerate(g.states)]
        for g in groups
    ]


async def _guarded(group: _Group, work: Any) -> Any:
    """Await ``work`` for ``group``; an exception from environment code fails the group (logged), not the run."""
    try:
        return await work
    except Exception as e:  # noqa: BLE001 - environment or rubric code outside the reward guards
        logger.warning("verifiers run_group failed for example %d: %s: %s", group.example_id, type(e).__name__, e)
        group.failed = True
        return None


async def _each(inline: bool, coroutines: Iterable[Any]) -> list:
    """The coroutines' results: awaited one after another when ``inline``, else gathered as tasks."""
    if inline:
        return [await c for c in coroutines]
    return list(await asyncio.gather(*coroutines))


_INLINE_ENV_METHODS = ("get_prompt_messages", "add_model_response", "add_trajectory_step", "cleanup", "_render_stop")


def _inline(vf_env: Any) -> bool:
    """True when every environment method the per-rollout phases await is verifiers' own
    (``MultiTurnEnv`` / ``SingleTurnEnv``: pure state updates that never suspend), and the only cleanup
    handler is MultiTurnEnv's ``render_state``. Then the phases await the rollouts one after another: a
    task per rollout (``asyncio.gather`` of 64) cost ~0.3 ms per phase here and overlaps nothing. An
    override may wait on I/O, so it is gathered as verifiers would run it."""
    cls = type(vf_env)
    bases = (vf.SingleTurnEnv, vf.MultiTurnEnv) if isinstance(vf_env, vf.SingleTurnEnv) else (vf.MultiTurnEnv,)
    for name in _INLINE_ENV_METHODS:
        if not any(getattr(cls, name) is getattr(b, name) for b in bases):
            return False
    return all(getattr(h, "__func__", None) is vf.MultiTurnEnv.render_state for h in vf_env._cleanup_handlers)


def _fresh_states(vf_env: Any) -> bool:
    """True when the states reach the turn as verifiers' own ``init_state`` and ``setup_state`` leave them:
    no error, no ``prompt_too_long``, no trajectory step, no usage, no ``final_env_response``. Then none of
    MultiTurnEnv's stop conditions (the only ones ``single_turn_blocker`` lets through) can hold before the
    turn: ``max_turns_reached`` needs a step, ``max_total_completion_tokens_reached`` output tokens."""
    cls = type(vf_env)
    return cls.init_state is vf.Environment.init_state and cls.setup_state is vf.MultiTurnEnv.setup_state


def _cleanup_calls(vf_env: Any) -> list[tuple[Any, frozenset[str] | None]] | None:
    """``Environment.cleanup``'s handlers with the parameter names ``maybe_call_with_named_args`` reads from
    ``inspect.signature`` on every call (None: all, for ``**kwargs``), read once per call of the fast path;
    None when the environment overrides ``cleanup`` (then its own runs)."""
    if type(vf_env).cleanup is not vf.Environment.cleanup:
        return None
    out = []
    for handler in vf_env._cleanup_handlers:
        params = inspect.signature(handler).parameters
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        out.append((handler, None if var_kw else frozenset(params)))
    return out


async def _cleanup(vf_env: Any, state: Any, calls: list[tuple[Any, frozenset[str] | None]] | None) -> None:
    """``vf_env.cleanup(state)``; with its own method, each handler called as ``maybe_call_with_named_args``
    calls it (task and resources None, as ``cleanup``'s defaults) without a signature read per call."""
    if calls is None:
        await vf_env.cleanup(state)
        return
    objects = {"task": None, "state": state, "env": vf_env, "resources": None}
    for handler, names in calls:
        kwargs = objects if names is None else {k: v for k, v in objects.items() if k in names}
        result = handler(**kwargs)
        if inspect.isawaitable(result):
            await result


def _rubric_cleans_up(rubric: Any) -> bool:
    """False when ``rubric.cleanup`` is verifiers' own and no rubric in it has a cleanup handler (a no-op)."""
    if type(rubric).cleanup not in (vf.Rubric.cleanup, vf.RubricGroup.cleanup) or rubric._cleanup_handlers:
        return True
    return isinstance(rubric, vf.RubricGroup) and any(_rubric_cleans_up(r) for r in rubric.rubrics)


async def _setup_group(vf_env: Any, client: EngineClient, group: _Group, sampling_args: dict) -> None:
    """``MultiTurnEnv.rollout`` up to its first turn, per rollout: ``init_state`` and ``setup_state``."""
    for inp in group.inputs:
        state = await vf_env.init_state(inp, client, MODEL, sampling_args)
        state["timing"].generation.start = state["timing"].setup.start = time.time()
        try:
            new = await vf_env.setup_state(state)
            if new is not None:
                state = new
        except vf.Error as e:
            state["error"] = e
        finally:
            state["timing"].setup.end = time.time()
        group.states.append(state)


async def _request(vf_env: Any, client: EngineClient, state: Any, fresh: bool) -> tuple | None:
    """The turn's (prompt messages, prompt ids, sampling params, turn index), as ``get_model_response`` and
    ``EngineClient`` build it; None when no model call is made (a stop condition holds before the turn,
    or a ``vf.Error``, recorded as the turn loop records it). ``fresh``: ``_fresh_states`` (no stop
    condition can hold yet, so the turn loop's first ``is_completed`` is not evaluated)."""
    if not fresh and await _first_stop(vf_env, state) is not None:
        return None
    try:
        messages = maybe_normalize_messages(await vf_env.get_prompt_messages(state), field_name="prompt_messages")
        if state.get("final_env_response") is not None:
            return None
        tools = await client.to_native_tools(state.get("tool_defs") or None)
        vf_env._get_usage_tracker(state, create_if_missing=True)
        try:
            native, _ = await client.to_native_prompt(messages)
            ids, sp, turn = client.prepare_request(native, state["sampling_args"] or {}, tools, state)
        except vf.Error:
            raise
        except Exception as e:  # as vf.Client.get_response wraps a client error
            raise vf.ModelError() from e
        return messages, ids, sp, turn
    except vf.Error as e:
        _record(state, e)
        return None


async def _finish(vf_env: Any, client: EngineClient, state: Any, messages: list, response: Any) -> None:
    """The rest of the turn: the client's response object, usage, and the environment's ``add_model_response``."""
    try:
        try:
            resp = await client.from_native_response(response)
        except vf.Error:
            raise
        except Exception as e:  # as vf.Client.get_response wraps a client error
            raise vf.ModelError() from e
        vf_env.increment_state_usage_from_response(state, resp)
        if type(vf_env).add_model_response is _OWN_ADD_MODEL_RESPONSE:
            await _add_model_response(vf_env, state, messages, resp)
        else:
            await vf_env.add_model_response(state, messages, resp)
    except vf.Error as e:
        _record(state, e)


async def _add_model_response(vf_env: Any, state: Any, messages: list, response: Any) -> None:
    """``MultiTurnEnv.add_model_response`` without its ``asyncio.to_thread`` hop: the token fields are
    copied inline, with the same ``max_seq_len`` truncation as verifiers' ``parse_response_tokens``
    (the engine client's responses carry no multimodal, routed-expert or attribution sidecars)."""
    tok = response.message.tokens
    assert tok.multi_modal_data is None and tok.routed_experts is None and tok.prompt_attribution is None
    prompt_ids, prompt_mask = tok.prompt_ids, tok.prompt_mask
    completion_ids, completion_mask, logprobs = tok.completion_ids, tok.completion_mask, tok.completion_logprobs
    overlong = truncated = False
    limit = vf_env.max_seq_len
    if limit is not None and len(prompt_ids) > limit:
        overlong = truncated = True
        prompt_ids, prompt_mask = prompt_ids[:limit], prompt_mask[:limit]
        completion_ids, completion_mask, logprobs = [], [], []
    elif limit is not None and len(prompt_ids) + len(completion_ids) > limit:
        truncated = True
        keep = limit - len(prompt_ids)
        completion_ids, completion_mask, logprobs = completion_ids[:keep], completion_mask[:keep], logprobs[:keep]
    tokens = TrajectoryStepTokens(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        completion_logprobs=logprobs,
        overlong_prompt=overlong,
        is_truncated=truncated,
        routed_experts=None,
    )
    step = TrajectoryStep(
        prompt=messages,
        completion=await parse_response_message(response),
        response=response,
        tokens=tokens,
        reward=None,
        advantage=None,
        is_truncated=bool(response.message.is_truncated) or truncated,
        trajectory_id=state["trajectory_id"],
        extras={},
    )
    await vf_env.add_trajectory_step(state, step)


def _record(state: Any, e: Exception) -> None:
    """A ``vf.Error`` of the turn, recorded as ``MultiTurnEnv.rollout``'s loop records it."""
    if isinstance(e, vf.OverlongPromptError):
        state["prompt_too_long"] = True
        state["is_truncated"] = True
    else:
        state["error"] = e


async def _first_stop(vf_env: Any, state: Any) -> Any:
    """The first stop condition that holds, in ``is_completed``'s order; called directly (they are all
    MultiTurnEnv's own, see ``single_turn_blocker``) instead of through ``inspect.signature`` each time."""
    for condition in vf_env._stop_conditions:
        if await condition(state):
            return condition
    return None


async def _close_group(vf_env: Any, group: _Group, cleanup: list | None) -> None:
    """Per rollout the loop's closing ``is_completed`` and ``cleanup`` (``_cleanup_calls``)."""
    for state in group.states:
        try:
            condition = await _first_stop(vf_env, state)
            # max_turns == 1: only an add_trajectory_step that stores no step leaves the loop running.
            if condition is None:
                raise RuntimeError("a single-turn rollout is not completed after its turn (no trajectory step)")
            await _render_stop(vf_env, state, condition)
        finally:
            await _cleanup(vf_env, state, cleanup)


async def _render_stop(vf_env: Any, state: Any, condition: Any) -> None:
    """``Environment._render_stop`` for a condition that holds: is_completed, is_truncated, stop_condition.
    Verifiers' own re-evaluates the condition through ``inspect.signature``; with its own method and a
    MultiTurnEnv condition (pure checks of the state, just evaluated) the fields are set directly."""
    if type(vf_env)._render_stop is not _OWN_RENDER_STOP:
        await vf_env._render_stop(state, condition)
        return
    state["is_completed"] = True
    state["is_truncated"] = state.get("is_truncated", False) or any(
        step.get("is_truncated", False) for step in state.get("trajectory", [])
    )
    state["stop_condition"] = condition.__name__
    if state.get("stop_condition") == "has_error":
        vf_env.logger.error(f"Aborted rollout due to {ErrorChain(state['error'])!r}")


async def _score(vf_env: Any, groups: list[_Group]) -> None:
    """``_run_group_states``' scoring for every group: one ``score_groups`` call for all of them (vf_scoring.py)
    when the rubric allows it, else ``rubric.score_group`` per group, concurrently. An exception outside the
    reward guards in the batched call (rubric code such as ``score_objects``) rescores group by group, so
    that only the raising group fails, as in the general path (reward functions may then run twice)."""
    start = time.time()
    for g in groups:
        for state in g.states:
            state["timing"].scoring.start = start
    rubric = vf_env.rubric
    if not vf_env.score_rollouts:
        await asyncio.gather(*(_guarded(g, rubric.dummy_score_group(g.states)) for g in groups))
    elif scoring_blocker(rubric) is None:
        try:
            await score_groups(rubric, [g.states for g in groups])
        except Exception:  # noqa: BLE001 - rescored per group below, where the raising group fails
            await asyncio.gather(*(_guarded(g, score_groups(rubric, [g.states])) for g in groups))
    else:
        await asyncio.gather(*(_guarded(g, rubric.score_group(g.states)) for g in groups))
    end = time.time()
    for g in groups:
        for state in g.states:
            state["timing"].scoring.end = end


async def _cleanup_rubric(vf_env: Any, group: _Group) -> None:
    for state in group.states:
        await vf_env.rubric.cleanup(state)
