"""An in-process ``vf.Client`` over our inference engine: chat messages in, token-exact responses out.

verifiers' classic environments (``MultiTurnEnv`` and subclasses, verifiers>=0.3.1,<0.4) call
``client.get_response(prompt_messages, model, sampling_args, tools, state=state)`` once per turn.
``EngineClient`` answers it without HTTP: it renders the messages with the tokenizer's chat template
(tools included), submits the ids through ``AsyncEngine`` (so concurrent rollouts share the engine's
continuous batch), and returns a ``vf.Response`` whose ``message.tokens`` carries prompt ids,
completion ids, masks and the per-token logprobs the engine sampled with. The environment stores
those on each trajectory step (``state["trajectory"][i]["tokens"]``).

Multi-turn token exactness (docs/environments.md): the next turn's prompt is NOT re-rendered from
messages when it extends the previous turn's messages. It is built as
``previous prompt ids + previous completion ids + bridge ids``, where the bridge is the rendered
text between the assistant message's content and the new messages' generation prompt (the
template's assistant "close" the engine did not sample, e.g. ``"\\n"`` after a sampled
``<|im_end|>``, then the new user/tool turns). So the trained sequence is the engine's token
stream. A full re-render would differ wherever the template rewrites history (Qwen3 strips earlier
``<think>`` blocks) or BPE merges differ; such differences are detected and counted per rollout
(``rerender_mismatches``), never used. When the environment rewrites the message history itself
(the new prompt does not extend the previous messages), the prompt is rendered afresh and the
break is counted (``prefix_breaks``); the Rollout conversion then stops at the break.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import verifiers as vf
from verifiers.types import (
    Messages,
    Response,
    ResponseMessage,
    ResponseTokens,
    SamplingArgs,
    Tool,
    ToolCall,
    Usage,
)

from prime_spmd.envs.base import completion_text, end_token_ids
from prime_spmd.envs.chat_render import ChatRenderer, split_tool_calls, turn_seed
from prime_spmd.envs.image_turns import needs_processor, next_prompt, rollout_vision
from prime_spmd.inference.engine import AsyncEngine, Completion, SamplingParams
from prime_spmd.models.vision import ImageInputError, VisionInputs, has_images

STATS_KEY = "ps_bridge"
"""State key of the per-rollout bridge counters (a JSON-able dict of ints, returned as a state column)."""
SEED_KEY = "ps_seed"
"""RolloutInput key carrying the per-sample seed; request seeds derive from it and the turn index."""


def bump_stat(state: Any, key: str, n: int = 1) -> None:
    """Add ``n`` to the rollout counter ``key`` in ``state[STATS_KEY]`` (created on first use)."""
    stats = state.get(STATS_KEY)
    if stats is None:
        stats = {}
        state[STATS_KEY] = stats
    stats[key] = stats.get(key, 0) + n


def parse_hermes_tool_calls(text: str, turn: int) -> tuple[str, list[ToolCall]]:
    """``split_tool_calls`` (prime_spmd/envs/chat_render.py) as classic ``vf.ToolCall`` objects."""
    content, calls = split_tool_calls(text)
    tool_calls = [ToolCall(id=f"call_{turn}_{i}", name=name, arguments=args) for i, (name, args) in enumerate(calls)]
    return content, tool_calls


def to_template_message(message: Any) -> dict[str, Any]:
    """A verifiers message (pydantic or dict) as the plain dict HF chat templates expect."""
    d = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    role = "user" if d.get("role") == "text" else d["role"]
    content = d.get("content")
    if isinstance(content, list) and not has_images([{"content": content}]):  # text parts: templates take strings
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    elif isinstance(content, list):  # text and image parts: the engine's render_prompt (vision-language models)
        content = [p for p in content if isinstance(p, dict)]
    out: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
    if d.get("reasoning_content") is not None:
        out["reasoning_content"] = d["reasoning_content"]
    if d.get("tool_calls"):
        out["tool_calls"] = [
            {"type": "function", "id": tc["id"], "function": {"name": tc["name"], "arguments": _args(tc["arguments"])}}
            for tc in d["tool_calls"]
        ]
    if role == "tool":
        out["tool_call_id"] = d.get("tool_call_id", "")
    return out


def _args(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return arguments


@dataclass(slots=True)
class EngineResponse:
    """What ``get_native_response`` returns: the exact ids the engine saw and sampled."""

    prompt_ids: list[int]
    completion: Completion
    text: str
    turn: int


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")
"""Request fields that change the distribution a token is sampled from (and so its logprob)."""


def refuse_sampling_overrides(env_name: str, refused: dict[str, float], base: SamplingParams) -> None:
    """Raise ``ValueError`` when an environment overrode the sampling distribution of training rollouts."""
    if not refused:
        return
    got = ", ".join(f"{k}={v}" for k, v in sorted(refused.items()))
    run = ", ".join(f"--sampling.{k}={getattr(base, k)}" for k in sorted(refused))
    raise ValueError(
        f"environment {env_name!r} sets sampling_args {got} for training rollouts, but the run samples with {run}: "
        "the trainer's logprobs are of the run's distribution, so the importance ratio would be biased. "
        "Set the --sampling flags to the environment's values, or drop the override from the environment"
    )


class EngineClient(vf.Client):
    """``vf.Client`` answering chat requests with the in-process engine, token-exact (see module doc).

    ``base`` holds the sampling parameters of the run (the policy being trained); keys present in a
    request's ``sampling_args`` override them (``temperature``, ``top_p``, ``max_tokens`` /
    ``max_completion_tokens``, ``stop``, ``seed``; ``top_k``, ``min_p``, ``chat_template_kwargs`` in
    ``extra_body`` too). ``check_rerender`` also renders each stitched prompt from messages and counts
    disagreements (``rerender_mismatches``); it costs one template render per turn.
    ``fixed_sampling`` (training rollouts): an override of temperature / top_p / top_k / min_p that
    differs from ``base`` fails the request and is recorded in ``refused_overrides`` (the trainer's
    logprobs are of ``base``'s distribution); ``refuse_sampling_overrides`` turns that into an error.
    Runs inside one event loop (the ``AsyncEngine``'s); not thread-safe.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        base: SamplingParams | None = None,
        check_rerender: bool = True,
        tool_parser: Any = None,
        renderer: ChatRenderer | None = None,
        fixed_sampling: bool = False,
    ) -> None:
        super().__init__(engine)
        self.engine = engine
        self.base = base or SamplingParams()
        self.fixed_sampling = fixed_sampling
        self.refused_overrides: dict[str, float] = {}
        self.check_rerender = check_rerender
        # A renderer kept across calls (same tokenizer) keeps its prompt cache warm.
        if renderer is None or renderer.tokenizer is not engine.engine.tokenizer:
            renderer = ChatRenderer(engine.engine.tokenizer)
        self.renderer = renderer
        self.tokenizer = engine.engine.tokenizer
        self._end_ids = end_token_ids(self.tokenizer)
        self.tool_parser = tool_parser or parse_hermes_tool_calls
        self.max_model_len: int | None = getattr(engine.engine, "max_model_len", None)
        self.visions: dict[Any, list[tuple[list[int], VisionInputs | None]]] = {}
        """Each turn's (prompt ids, images) of each sample with images (key: the sample's seed, ``SEED_KEY``), for
        its requests and its ``Rollout`` (``pop_vision``; verifiers' state columns must be JSON)."""
        self.input_errors: list[ImageInputError] = []
        """Bad image input met by requests (the bridge raises the first, naming the environment)."""

    def setup_client(self, config: Any) -> Any:
        raise ValueError("EngineClient wraps an in-process engine; it cannot be built from a ClientConfig")

    async def close(self) -> None:
        return None

    async def to_native_tool(self, tool: Tool) -> dict:
        return {
            "type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
        }

    async def to_native_prompt(self, messages: Messages) -> tuple[list[dict], dict]:
        return [to_template_message(m) for m in messages], {}

    async def get_native_response(
        self,
        prompt: list[dict],
        model: str,
        sampling_args: SamplingArgs,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> EngineResponse:
        state = kwargs.get("state")
        try:
            prompt_ids, sampling, turn = self.prepare_request(prompt, sampling_args, tools, state)
        except ImageInputError as e:  # verifiers turns a client error into the rollout's error: keep it for the run
            self.input_errors.append(e)
            raise
        turns = self.visions.get(_sample_key(state))
        vision = turns[-1][1] if turns else None
        completion = await self.engine.generate(prompt_ids, sampling, vision=vision)
        return self.engine_response(prompt_ids, completion, turn)

    def pop_vision(self, key: Any, ids: list[int]) -> VisionInputs | None:
        """The images of the rollout of sample ``key`` whose ids are ``ids`` (image_turns.py's ``rollout_vision``);
        forgets the sample's turns."""
        return rollout_vision(self.visions.pop(key, None) or [], ids)

    def prepare_request(
        self, prompt: list[dict], sampling_args: SamplingArgs | None, tools: list[dict] | None, state: Any
    ) -> tuple[list[int], SamplingParams, int]:
        """(prompt ids, sampling params, turn index) of one request; raises ``vf.OverlongPromptError``."""
        extra = dict((sampling_args or {}).get("extra_body") or {})
        template_kwargs = dict(extra.get("chat_template_kwargs") or {})
        turn = len(state["trajectory"]) if state is not None else 0
        prompt_ids = self._prompt_ids(prompt, tools, state, template_kwargs)
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            raise vf.OverlongPromptError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}")
        return prompt_ids, self.sampling_for(sampling_args, state, turn, len(prompt_ids)), turn

    def engine_response(self, prompt_ids: list[int], completion: Completion, turn: int) -> EngineResponse:
        # Content ends at the first end-of-turn token, as the built-in envs score it (the ids keep all).
        text = completion_text(self.tokenizer, completion.token_ids, self._end_ids)
        return EngineResponse(prompt_ids=prompt_ids, completion=completion, text=text, turn=turn)

    def _prompt_ids(self, prompt: list[dict], tools: list[dict] | None, state: Any, kwargs: dict) -> list[int]:
        """Stitch onto the previous turn's ids when ``prompt`` extends its messages; else render afresh. Prompts
        with images (in any turn) go through the engine's image processor (image_turns.py)."""
        step = _last_step_with_tokens(state)
        key = _sample_key(state)
        turns = self.visions.get(key)
        if step is None:
            if has_images(prompt):  # the processor expands each image's tokens (models/vision.py)
                ids, vision = needs_processor(self.engine.engine, prompt).render(prompt, tools, kwargs)
                self.visions[key] = [(ids, vision)]
                return ids
            return self.renderer.render_ids(prompt, tools, kwargs)
        previous = [to_template_message(m) for m in list(step["prompt"]) + list(step["completion"])]
        tokens = step["tokens"]
        prompt_ids, completion_ids = list(tokens["prompt_ids"]), list(tokens["completion_ids"])
        if turns is not None or has_images(prompt):
            last = next((v for ids, v in reversed(turns or []) if ids == prompt_ids), None)
            processor = needs_processor(self.engine.engine, prompt)
            ids, vision, stat = next_prompt(
                self.renderer, processor, prompt, tools, kwargs, previous, prompt_ids, completion_ids, last,
                self.check_rerender,
            )  # fmt: skip
            self.visions.setdefault(key, []).append((ids, vision))
        else:
            ids, stat = self.renderer.stitch_ids(
                prompt, tools, kwargs, previous, prompt_ids, completion_ids, self.check_rerender
            )
        if stat is not None:
            bump_stat(state, stat)
        return ids

    def sampling_for(self, args: SamplingArgs | None, state: Any, turn: int, prompt_len: int) -> SamplingParams:
        """The request's ``SamplingParams``: ``base`` overridden by ``args``; seed derived per sample and turn."""
        args = dict(args or {})
        extra = dict(args.pop("extra_body", None) or {})
        merged = {**extra, **args}
        sp = dataclasses.replace(self.base, stop=list(self.base.stop), stop_token_ids=list(self.base.stop_token_ids))
        if merged.get("n", 1) not in (1, None):
            raise ValueError(f"sampling_args n={merged['n']}: the engine client returns one completion per request")
        for key in SAMPLING_KEYS:
            if merged.get(key) is not None:
                value = type(getattr(sp, key))(merged[key])
                if self.fixed_sampling and value != getattr(self.base, key):
                    self.refused_overrides[key] = value
                    raise ValueError(f"sampling_args {key}={value} differs from the run's {getattr(self.base, key)}")
                setattr(sp, key, value)
        max_tokens = merged.get("max_tokens") or merged.get("max_completion_tokens")
        if max_tokens is not None:
            sp.max_tokens = int(max_tokens)
        stop = merged.get("stop")
        if stop:
            sp.stop = sp.stop + ([stop] if isinstance(stop, str) else list(stop))
        if self.max_model_len is not None:
            sp.max_tokens = max(1, min(sp.max_tokens, self.max_model_len - prompt_len))
        base_seed = None
        if state is not None:
            base_seed = (state.get("input") or {}).get(SEED_KEY)
        if base_seed is None:
            base_seed = merged.get("seed", self.base.seed)
        sp.seed = None if base_seed is None else turn_seed(int(base_seed), turn)
        return sp

    async def raise_from_native_response(self, response: EngineResponse) -> None:
        # An empty completion is a legitimate sample (reward it, train on it): not an error here.
        return None

    async def from_native_response(self, response: EngineResponse) -> Response:
        c = response.completion
        content, tool_calls = self.tool_parser(response.text, response.turn)
        finish = "tool_calls" if tool_calls else c.finish_reason
        tokens = ResponseTokens(
            prompt_ids=list(response.prompt_ids),
            prompt_mask=[0] * len(response.prompt_ids),
            completion_ids=list(c.token_ids),
            completion_mask=[1] * len(c.token_ids),
            completion_logprobs=[float(x) for x in c.logprobs],
        )
        n_p, n_c = len(response.prompt_ids), len(c.token_ids)
        return Response(
            id=str(c.request_id),
            created=0,
            model="prime-spmd",
            usage=Usage(prompt_tokens=n_p, reasoning_tokens=0, completion_tokens=n_c, total_tokens=n_p + n_c),
            message=ResponseMessage(
                content=content,
                finish_reason=finish,
                is_truncated=c.finish_reason == "length",
                tokens=tokens,
                tool_calls=tool_calls or None,
            ),
        )


def _sample_key(state: Any) -> Any:
    """The sample's seed (unique per sample of a run_groups call), None outside a rollout."""
    return None if state is None else (state.get("input") or {}).get(SEED_KEY)


def _last_step_with_tokens(state: Any) -> dict | None:
    if state is None:
        return None
    for step in reversed(state.get("trajectory") or []):
        if step.get("tokens") is not None:
            return step
    return None
