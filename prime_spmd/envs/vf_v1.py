"""Run ``verifiers`` v1 environments (verifiers>=0.4,<0.5) in-process on our engine, token-exact.

The v1 API (``import verifiers.v1 as vf``): an environment is a ``vf.Taskset`` (tasks, each with
``@vf.reward`` / ``@vf.metric`` methods) played by a ``vf.Harness`` (a program, e.g. a chat loop or a
coding agent) under a ``vf.Env`` (``SingleAgentEnv`` unless the taskset ships its own). The harness
never sees the model: it calls an OpenAI-compatible endpoint served by verifiers' interception
server (aiohttp, on 127.0.0.1 in this process), which hands each request to a ``vf.Client``.
``V1EngineClient`` is that client here: it renders the request's messages with ``ChatRenderer``
(multi-turn prompts are stitched onto the previous turn's ids, never re-rendered; vf_client.py's
module doc), submits the ids to the in-process engine through ``AsyncEngine`` and answers with a
``vf.Response`` whose ``TurnTokens`` are the engine's ids and logprobs. It also keeps each rollout's
turns (prompt ids, sampled ids, logprobs) by trace id; ``trace_to_rollout`` chains them into a
``Rollout`` with trajectory.py's rule (env tokens mask 0), so the trained ids are the engine's.

One access to verifiers internals, no patching: the interception server builds its clients from
the rollout's ``ClientConfig`` (``resolve_client``: an HTTP client). verifiers 0.4.0 has no public
way to hand it a client object, so inside ``env.serving()`` the bridge puts ``V1EngineClient`` into
that server's client cache (``InterceptionServer.clients``, keyed by the config's JSON) under a
``TrainClientConfig`` whose URL is never contacted (``_install_client``).

Loading (``load_v1_environment``): ``--env.name`` is a taskset id (an importable top-level module
exporting a ``vf.Taskset`` subclass in ``__all__``, optionally a ``vf.Harness`` and a ``vf.Env``), or
a ``.py`` file holding one (its folder goes on ``sys.path``), or ``module:function`` returning a
``vf.Env``. ``--env.args`` set the taskset's config fields. Every seat runs in the ``subprocess``
runtime (the host) on one ``server`` interception. Splits: v1 tasksets have one task list;
``train`` is all of it, ``eval`` its first ``--env.num_eval_examples`` tasks.

Images: user, system and tool messages may hold ``image_url`` content parts (v1's ``ImageUrlContentPart``, e.g.
``data:image/png;base64,...`` URLs; in the task's prompt or in any later turn). They are rendered token-exact by the
model's image processor (image_turns.py); each engine request and the rollout carry every image of the conversation
so far, in order, each at its own tokens. An image the processor cannot read, or images for a text-only model,
raise a ``ValueError`` naming the environment.

Failures never stop the run: an episode error (harness exit, a raising reward, a timeout) gives the
rollout reward 0, ``metrics["failed"] = 1`` and a counter (``reward_errors`` when a reward is
unscored, ``env_timeouts``, else ``env_errors``), as in the classic bridge.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Literal

import verifiers.v1 as vf
from verifiers.v1.clients.train import serialize_completion, tool_to_wire
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import ProviderError
from verifiers.v1.interception import InterceptionServer

from prime_spmd.config.sections import EnvConfig
from prime_spmd.envs.base import Environment, completion_text
from prime_spmd.envs.chat_render import ChatRenderer, split_tool_calls, turn_seed
from prime_spmd.envs.image_turns import needs_processor, next_prompt
from prime_spmd.envs.rollout import Rollout
from prime_spmd.envs.trajectory import COUNTERS, failed_rollout, stitch_turns
from prime_spmd.inference.engine import AsyncEngine, EngineFailure, InferenceEngine, SamplingParams
from prime_spmd.models.vision import ImageInputError, VisionInputs, has_images

logger = logging.getLogger("prime_spmd")
MODEL_NAME = "prime-spmd"
"""The model name harnesses send (``ModelContext.model``); the engine serves whatever it holds."""
CLIENT_CONFIG = vf.TrainClientConfig(base_url="http://prime-spmd.invalid/v1", api_key_var="PRIME_SPMD_UNUSED")
"""The rollouts' client config: a train config (so streamed requests are generated, not relayed);
its URL is never contacted, the server's client for it is ``V1EngineClient``."""


def wire_to_template(message: dict) -> dict[str, Any]:
    """An OpenAI chat wire message (``message_to_wire``) as the plain dict HF chat templates expect."""
    content = message.get("content")
    if isinstance(content, list) and not has_images([message]):  # text parts: templates here take strings
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    elif isinstance(content, list):  # text and image parts: the model's image processor (image_turns.py)
        content = [p for p in content if isinstance(p, dict)]
    out: dict[str, Any] = {"role": message["role"], "content": content if content is not None else ""}
    if message.get("reasoning_content") is not None:
        out["reasoning_content"] = message["reasoning_content"]
    calls = []
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function") or {}
        calls.append(
            {"type": "function", "id": tc.get("id"), "function": {"name": fn.get("name"), "arguments": _args(fn)}}
        )
    if calls:
        out["tool_calls"] = calls
    if message["role"] == "tool":
        out["tool_call_id"] = message.get("tool_call_id", "")
    return out


def _args(fn: dict) -> Any:
    try:
        return json.loads(fn.get("arguments") or "{}")
    except (json.JSONDecodeError, TypeError):
        return fn.get("arguments")


class V1EngineClient(vf.Client):
    """``vf.Client`` answering chat requests with the in-process engine, token-exact (see module doc).

    ``base`` is the run's sampling (the policy being trained): every request uses it; a request's
    ``max_tokens`` may only lower ``base.max_tokens``. Request seeds derive from ``seeds[trace id]``
    (set by the bridge when the trace is minted) and the turn index. ``turns[trace id]`` and
    ``stats[trace id]`` collect each rollout's engine turns and bridge counters. Runs inside the event
    loop of the ``AsyncEngine``; not thread-safe.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        base: SamplingParams,
        renderer: ChatRenderer | None = None,
        check_rerender: bool = True,
    ) -> None:
        self.engine = engine
        self.base = base
        self.tokenizer = engine.engine.tokenizer
        if renderer is None or renderer.tokenizer is not self.tokenizer:
            renderer = ChatRenderer(self.tokenizer)
        self.renderer = renderer
        self.check_rerender = check_rerender
        self.max_model_len: int | None = getattr(engine.engine, "max_model_len", None)
        self.turns: dict[str, list[dict]] = {}
        self.stats: dict[str, dict[str, int]] = {}
        self.seeds: dict[str, int] = {}
        self.input_errors: list[ImageInputError] = []
        """Bad image input met by requests (the environment raises the first after its episodes)."""

    async def get_response(
        self,
        dialect: Any,
        body: dict,
        sampling: Any,
        session_id: str | None = None,
        turn: Any = None,
        headers: Any = None,
    ) -> vf.Response:
        """One model call of rollout ``session_id`` (the trace id), from the interception server: render or
        stitch the prompt, sample it on the engine, record the turn, return the engine's ids and logprobs."""
        if not isinstance(dialect, ChatDialect):
            raise ProviderError(
                f"prime-spmd serves the chat-completions dialect only, got {type(dialect).__name__}", status_code=400
            )
        request = dialect.parse_request(body)
        messages = [wire_to_template(message_to_wire(m)) for m in request.messages]
        tools = [tool_to_wire(t) for t in request.tools] if request.tools else None
        extra = sampling.model_dump(exclude_none=True) if sampling is not None else {}
        template_kwargs = dict(extra.get("chat_template_kwargs") or {})
        key = session_id or ""
        history = self.turns.setdefault(key, [])
        try:
            prompt_ids, vision = self._prompt_ids(
                messages, tools, history, self.stats.setdefault(key, {}), template_kwargs
            )
        except ImageInputError as e:  # bad input, not a failed episode: the environment raises it after the episodes
            self.input_errors.append(e)
            raise ProviderError(str(e), status_code=400) from e
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            _bump(self.stats[key], "overlong_prompts")
            # A clean stop, as the classic bridge's prompt_too_long: a stopped trace's harness may exit non-zero.
            if turn is not None:
                turn.trace.stop("prompt_too_long")
            raise ProviderError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}", status_code=400
            )
        sp = self.sampling_for(body, key, len(history), len(prompt_ids))
        c = await self.engine.generate(prompt_ids, sp, vision=vision)
        # Content ends at the first end-of-turn token, as the built-in envs score it (the ids keep all).
        content, calls = split_tool_calls(completion_text(self.tokenizer, c.token_ids))
        tool_calls = [vf.ToolCall(id=f"call_{len(history)}_{i}", name=n, arguments=a) for i, (n, a) in enumerate(calls)]
        message = vf.AssistantMessage(content=content, tool_calls=tool_calls or None)
        history.append(
            {
                "prompt_ids": prompt_ids,
                "completion_ids": list(c.token_ids),
                "completion_mask": [1] * len(c.token_ids),
                "completion_logprobs": [float(x) for x in c.logprobs],
                "messages": messages,
                "reply": wire_to_template(message_to_wire(message)),
                "finish_reason": c.finish_reason,
                "vision": vision,
            }
        )
        response = vf.Response(
            id=str(c.request_id),
            created=0,
            model=body.get("model") or MODEL_NAME,
            message=message,
            finish_reason="tool_calls" if tool_calls else c.finish_reason,
            usage=vf.Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(c.token_ids)),
            tokens=vf.TurnTokens(
                prompt_ids=list(prompt_ids),
                completion_ids=list(c.token_ids),
                completion_logprobs=[float(x) for x in c.logprobs],
            ),
        )
        # The server hands ``raw`` to the harness; we generated, so serialize one (as verifiers' TrainClient does).
        response.raw = serialize_completion(response, response.model)
        return response

    def _prompt_ids(
        self, messages: list[dict], tools: list[dict] | None, history: list[dict], stats: dict, kwargs: dict
    ) -> tuple[list[int], VisionInputs | None]:
        """Stitch onto the previous turn's ids when ``messages`` extend its messages; else render afresh. Returns the
        ids and the conversation's images so far (image_turns.py; None without images)."""
        prev = history[-1] if history else None
        if (prev is not None and prev["vision"] is not None) or has_images(messages):
            processor = needs_processor(self.engine.engine, messages)
            if prev is None:
                return processor.render(messages, tools, kwargs)
            ids, vision, stat = next_prompt(
                self.renderer, processor, messages, tools, kwargs, prev["messages"] + [prev["reply"]],
                prev["prompt_ids"], prev["completion_ids"], prev["vision"], self.check_rerender,
            )  # fmt: skip
        elif prev is None:
            return self.renderer.render_ids(messages, tools, kwargs), None
        else:
            vision = None
            ids, stat = self.renderer.stitch_ids(
                messages,
                tools,
                kwargs,
                prev["messages"] + [prev["reply"]],
                prev["prompt_ids"],
                prev["completion_ids"],
                self.check_rerender,
            )
        if stat is not None:
            _bump(stats, stat)
        return ids, vision

    def sampling_for(self, body: dict, key: str, turn: int, prompt_len: int) -> SamplingParams:
        """``base`` with the request's ``max_tokens`` (if lower), clipped to the context; seed per sample and turn."""
        sp = dataclasses.replace(self.base, stop=list(self.base.stop), stop_token_ids=list(self.base.stop_token_ids))
        requested = body.get("max_tokens") or body.get("max_completion_tokens")
        if requested is not None:
            sp.max_tokens = max(1, min(sp.max_tokens, int(requested)))
        if self.max_model_len is not None:
            sp.max_tokens = max(1, min(sp.max_tokens, self.max_model_len - prompt_len))
        base_seed = self.seeds.get(key, self.base.seed)
        sp.seed = None if base_seed is None else turn_seed(int(base_seed), turn)
        return sp


def _bump(stats: dict[str, int], key: str) -> None:
    stats[key] = stats.get(key, 0) + 1


def sample_seed(seed: int, example_id: int, sample_idx: int) -> int:
    """Base seed of one sample (the classic bridge's formula): independent of batch composition."""
    return (seed * 1_000_003 + example_id) * 1_009 + sample_idx


def import_v1_env(name: str, args: dict[str, Any]) -> Any:
    """A ``vf.Env`` from ``--env.name`` (see module doc) with ``args`` as taskset config fields."""
    target, _, func_name = name.partition(":")
    if func_name:
        if target.endswith(".py"):
            raise ValueError(f"--env.name {name!r}: a v1 file is loaded as a taskset id; drop ':{func_name}'")
        fn = getattr(importlib.import_module(target), func_name, None)
        if fn is None:
            raise ValueError(f"--env.name {name!r}: {target} has no function {func_name}")
        env = _call_loader(name, fn, args)
        if not isinstance(env, vf.Env):
            raise ValueError(f"--env.name {name!r} returned {type(env).__name__}, not a verifiers v1 Env")
        return env
    taskset_id = name
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ValueError(f"--env.name {name!r}: no such file {path}")
        # verifiers 0.4 imports taskset ids as top-level modules: the file's folder goes on sys.path.
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        taskset_id = path.stem
    check_v1_taskset(name, taskset_id)
    config = env_config(taskset_id, args)
    return vf.load_environment(config)


def _call_loader(name: str, fn: Any, args: dict[str, Any]) -> Any:
    try:
        return fn(**args)
    except AttributeError as e:
        if "module 'verifiers' has no attribute" in str(e):
            raise ValueError(classic_mismatch(name)) from e
        raise


def classic_mismatch(name: str) -> str:
    return (
        f"--env.name {name!r} is a classic verifiers environment (vf.SingleTurnEnv / MultiTurnEnv / ToolEnv, "
        f"verifiers>=0.3.1,<0.4), but the installed verifiers is {installed_version()}, which has only the v1 "
        "API (vf.Taskset + vf.Harness): install verifiers 0.3.x (the main venv, .venv) for it"
    )


def installed_version() -> str:
    import verifiers

    return verifiers.__version__


def check_v1_taskset(name: str, taskset_id: str) -> None:
    """Raise ``ValueError`` naming ``name`` when module ``taskset_id`` is missing or is not a v1 taskset."""
    try:
        module = importlib.import_module(taskset_id)
    except ModuleNotFoundError as e:
        raise ValueError(f"--env.name {name!r}: no importable module {taskset_id!r} ({e})") from e
    except AttributeError as e:
        if "module 'verifiers' has no attribute" in str(e):
            raise ValueError(classic_mismatch(name)) from e
        raise
    exported = [getattr(module, n, None) for n in getattr(module, "__all__", [])]
    if not any(isinstance(o, type) and issubclass(o, vf.Taskset) for o in exported):
        if hasattr(module, "load_environment"):
            raise ValueError(classic_mismatch(name))
        raise ValueError(f"--env.name {name!r}: module {taskset_id!r} exports no vf.Taskset subclass in __all__")


def env_config(taskset_id: str, args: dict[str, Any]) -> Any:
    """The ``vf.EnvConfig`` of a taskset: ``args`` on its taskset config, every seat on the local
    ``subprocess`` runtime (verifiers' default is a remote Prime sandbox), one ``server`` interception."""
    cls = vf.env_config_type(taskset_id)
    seats = [n for n, f in cls.model_fields.items() if isinstance(f.default, vf.AgentConfig)]
    data: dict[str, Any] = {
        "taskset": {"id": taskset_id, **args},
        "interception": {"type": "server"},
        **{seat: {"runtime": {"type": "subprocess"}} for seat in seats},
    }
    return vf.resolve_env_config(data)


def load_v1_environment(cfg: EnvConfig) -> V1Environment:
    """Load ``cfg.name`` with ``cfg.args`` (strings; JSON values decoded) and wrap it."""
    args: dict[str, Any] = {}
    for k, v in cfg.args.items():
        try:
            args[k] = json.loads(v) if isinstance(v, str) else v
        except json.JSONDecodeError:
            args[k] = v
    env = import_v1_env(cfg.name, args)
    return V1Environment(env, name=cfg.name, num_eval_examples=cfg.num_eval_examples, seed=cfg.seed)


class V1Environment(Environment):
    """Our ``Environment`` over a verifiers v1 ``vf.Env`` (see module doc).

    ``check_rerender``: count turns whose stitched prompt differs from a fresh render of the messages.
    """

    def __init__(
        self,
        v1_env: Any,
        *,
        name: str = "verifiers-v1",
        num_eval_examples: int = 64,
        seed: int = 0,
        check_rerender: bool = True,
    ) -> None:
        if not v1_env.taskset.bounded:
            raise ValueError(f"--env.name {name!r}: the taskset is infinite; the bridge needs a bounded one")
        self.v1_env = v1_env
        self.name = name
        self.num_eval_examples = num_eval_examples
        self.seed = seed
        self.check_rerender = check_rerender
        self._tasks: list[Any] | None = None
        self._renderer: ChatRenderer | None = None

    def tasks(self, split: Literal["train", "eval"]) -> list[Any]:
        if self._tasks is None:
            self._tasks = list(self.v1_env.taskset)
        return self._tasks if split == "train" else self._tasks[: self.num_eval_examples]

    def num_examples(self, split: Literal["train", "eval"]) -> int:
        return len(self.tasks(split))

    def example(self, split: Literal["train", "eval"], index: int) -> dict[str, Any]:
        data = self.tasks(split)[index].data
        prompt: list[dict] = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            prompt.append({"role": "user", "content": data.prompt})
        else:
            prompt += [wire_to_template(message_to_wire(m)) for m in data.prompt or []]
        row = data.model_dump(mode="json", exclude_none=True)
        return {**row, "prompt": prompt, "answer": str(row.get("answer", ""))}

    def run_groups(
        self,
        engine: InferenceEngine,
        split: Literal["train", "eval"],
        example_ids: list[int],
        group_size: int,
        sampling: SamplingParams,
        seed: int,
    ) -> list[list[Rollout]]:
        """See ``Environment.run_groups``. Runs its own event loop (``asyncio.run``): call it from sync code."""
        return asyncio.run(self.arun_groups(engine, split, example_ids, group_size, sampling, seed))

    async def arun_groups(
        self,
        engine: InferenceEngine,
        split: Literal["train", "eval"],
        example_ids: list[int],
        group_size: int,
        sampling: SamplingParams,
        seed: int,
    ) -> list[list[Rollout]]:
        """``run_groups`` inside a running event loop; every episode runs concurrently."""
        aengine = AsyncEngine(engine)
        client = V1EngineClient(aengine, base=sampling, renderer=self._renderer, check_rerender=self.check_rerender)
        self._renderer = client.renderer  # reused by the next call: its prompt cache stays warm
        ctx = vf.ModelContext(
            model=MODEL_NAME,
            client=CLIENT_CONFIG,
            sampling=vf.SamplingConfig(
                temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_tokens
            ),
        )
        tasks = self.tasks(split)
        try:
            async with self.v1_env.serving():
                _install_client(self.v1_env, client)
                groups = await asyncio.gather(
                    *(
                        asyncio.gather(*(self._episode(tasks[e], ctx, client, e, k, seed) for k in range(group_size)))
                        for e in example_ids
                    )
                )
        finally:  # also steps requests of abandoned rollouts to the end: the engine is left empty
            await aengine.aclose()
        if aengine.failure is not None:
            raise EngineFailure("the inference engine failed during verifiers rollouts") from aengine.failure
        if client.input_errors:  # bad image input fails the run, naming the environment (module doc)
            raise ValueError(f"--env.name {self.name!r}: {client.input_errors[0]}") from client.input_errors[0]
        return [list(g) for g in groups]

    async def _episode(self, task: Any, ctx: Any, client: V1EngineClient, eid: int, k: int, seed: int) -> Rollout:
        traces: list[str] = []

        def minted(trace: Any) -> None:
            traces.append(trace.id)
            client.seeds[trace.id] = sample_seed(seed, eid, k)

        try:
            episode = await self.v1_env.run_episode(task, ctx, on_trace=minted)
        # An exception escaping run_episode comes from environment code; the run goes on, counted.
        except Exception as e:  # noqa: BLE001
            logger.warning("verifiers v1 episode failed for example %d: %s: %s", eid, type(e).__name__, e)
            episode = None
        trace = _trainable_trace(episode)
        turns = {t: client.turns.pop(t, []) for t in traces}
        stats = {t: client.stats.pop(t, {}) for t in traces}
        if trace is None:
            prompt_ids = client.renderer.render_ids(self.example("train", eid)["prompt"], None, {})
            return failed_rollout(eid, k, prompt_ids, "group_errors")
        return trace_to_rollout(trace, turns.get(trace.id, []), stats.get(trace.id, {}), eid, k, client.renderer)


def _install_client(v1_env: Any, client: V1EngineClient) -> None:
    # verifiers 0.4.0: no public way to hand the interception server a client object (module doc).
    server = v1_env._interception
    if not isinstance(server, InterceptionServer):
        raise ValueError(f"the v1 bridge needs a 'server' interception, got {type(server).__name__}")
    server.clients[CLIENT_CONFIG.model_dump_json()] = client


def _trainable_trace(episode: Any) -> Any:
    """The episode's first trace of a trainable seat (one sample per episode), or None."""
    if episode is None:
        return None
    return next((t for t in episode.traces if t.agent is None or t.agent.trainable), None)


def trace_to_rollout(
    trace: Any, turns: list[dict], stats: dict[str, int], example_id: int, sample_idx: int, renderer: ChatRenderer
) -> Rollout:
    """One v1 trace and the engine turns recorded for it, as a token-exact ``Rollout`` (trajectory.py).

    ``info["graph_match"]``: whether verifiers' own record of the sample (the trace's last branch,
    ``Branch.token_ids`` / ``sampled_mask``) equals ours, id for id and mask for mask.
    """
    unscored = [n for n, r in trace.rewards.items() if r is None]
    if not turns:
        counter = (
            "env_timeouts"
            if trace.is_timeout
            else "overlong_prompts"
            if stats.get("overlong_prompts")
            else "env_errors"
        )
        prompt = [{"role": "user", "content": trace.task.data.prompt_text}]
        return failed_rollout(example_id, sample_idx, renderer.render_ids(prompt, None, {}), counter)
    st = stitch_turns(turns)
    metrics = {c: float(stats.get(c, 0)) for c in COUNTERS}
    if unscored:
        metrics["reward_errors"] += 1.0
    elif trace.is_timeout:
        metrics["env_timeouts"] += 1.0
    elif not trace.ok:
        metrics["env_errors"] += 1.0
    failed = any(metrics[c] > 0 for c in ("reward_errors", "reward_timeouts", "env_errors", "env_timeouts"))
    reward = float(trace.reward) if not unscored else 0.0
    if not math.isfinite(reward):
        metrics["reward_errors"] += 1.0
        failed, reward = True, 0.0
    for key, value in [*((n, r.score if r else None) for n, r in trace.rewards.items()), *trace.metrics.items()]:
        if isinstance(value, (int, float)) and math.isfinite(value):
            metrics[f"env/{key}"] = float(value)
    metrics["num_turns"] = float(len(turns))
    metrics["turns_dropped"] = float(len(turns) - st.used)
    metrics["failed"] = float(failed)
    branch = trace.branches[-1] if trace.branches else None
    ids = st.prompt_ids + st.completion_ids
    mask = [0] * len(st.prompt_ids) + st.completion_mask
    graph_match = branch is not None and branch.token_ids == ids and [int(m) for m in branch.sampled_mask] == mask
    vision = turns[st.used - 1].get("vision")  # the images of the rollout's last turn (every image, in order)
    return Rollout(
        example_id=example_id,
        sample_idx=sample_idx,
        prompt_ids=st.prompt_ids,
        completion_ids=st.completion_ids,
        completion_mask=st.completion_mask,
        inference_logprobs=st.logprobs,
        reward=0.0 if failed else reward,
        vision=None if vision is None else vision.without_images(),
        metrics=metrics,
        info={
            "answer": str(getattr(trace.task.data, "answer", "")),
            "finish_reason": turns[st.used - 1]["finish_reason"],
            "stop_condition": trace.stop_condition,
            "trace_id": trace.id,
            "graph_match": graph_match,
            "errors": [f"{e.type}: {e.message}" for e in trace.errors],
        },
    )
