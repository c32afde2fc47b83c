"""The inference-engine interface every engine (native, vLLM) implements.

An engine owns a model and a tokenizer on one device (or one tp group). Work is submitted as
``Request`` objects (token ids + ``SamplingParams``) and comes back as ``Completion`` objects
(sampled token ids, the logprob of each sampled token, finish reason). The core is step-wise so
that continuous batching serves both a synchronous batch call (``generate``) and many concurrent
asyncio callers (``AsyncEngine``, used by the verifiers bridge).

Logprob contract (docs/inference.md): ``Completion.logprobs[i]`` is log p(token_i) under exactly
the distribution token_i was sampled from: softmax(logits / temperature) after top-k / top-p /
min-p filtering and renormalisation. With no filtering this is log_softmax(logits / T)[token],
which the trainer recomputes teacher-forced. Greedy (temperature 0) reports log_softmax(logits).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from prime_spmd.models.vision import VisionInputs, has_images, no_image_support
from prime_spmd.progress import Progress


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    min_p: float = 0.0
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    """Sampling one of these ends the completion (the token is kept); the tokenizer's eos is added by the engine."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: the completion ends at the first token whose decoded text completes one (the token is kept)."""
    seed: int | None = None
    """Per-request seed: the same seed, prompt and weights give the same completion regardless of batch."""
    ignore_eos: bool = False


@dataclass(kw_only=True, slots=True)
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: int | str = 0
    vision: VisionInputs | None = None
    """The prompt's images (vision-language models): prompt_ids hold their image tokens (``render_prompt``)."""


@dataclass(kw_only=True, slots=True)
class Completion:
    request_id: int | str
    prompt_ids: list[int]
    token_ids: list[int]
    """Sampled tokens, including the stop token that ended the completion."""
    logprobs: list[float]
    """log p of each sampled token under the distribution it was sampled from (see module doc)."""
    finish_reason: Literal["stop", "length"]
    text: str = ""
    """Decoded completion (special tokens skipped)."""


class EngineFailure(RuntimeError):
    """An engine step raised (``InferenceEngine.generate``, or ``AsyncEngine``'s driver as the verifiers bridges report
    it): the engine's state is unknown, so the run cannot go on.
    Not an environment's error: ``rl/isolation.py`` re-raises it instead of dropping the environment's groups (at
    c730d53 a CUDA allocator assert inside a step was counted as the environment's failure and the run then hung)."""


class InferenceEngine(abc.ABC):
    """Step-wise engine. Subclasses implement ``add_request``, ``step``, ``has_unfinished``,
    ``load_weights`` and ``reset_cache``; ``generate`` is built on them.

    Called on every rank of an inference engine's tp group with identical inputs in identical order.
    """

    tokenizer: Any
    weights_version: int = 0
    """Optimizer steps of the weights the engine holds. Set by the weight sync (prime_spmd/sync/weights.py) after
    a complete update, to the version the trainer sent; generation reports it with every batch."""
    processor: Any = None
    """The model's ``VisionProcessor`` (vision-language models; set by ``factory.build_engine``), else None."""

    @abc.abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a request; it is admitted into a free KV-cache slot by a later ``step``."""

    @abc.abstractmethod
    def step(self) -> list[Completion]:
        """Run one engine iteration (admit/prefill waiting requests, one decode step); return the finished ones."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """True while any request is queued or running."""

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, tensor) pairs into the model in place (no re-allocation), then ``reset_cache``."""

    def load_lora_weights(self, adapters: Iterable[tuple[str, torch.Tensor]], scale: float) -> None:
        """Take LoRA adapter tensors (HF module names + ``.lora_A.weight`` / ``.lora_B.weight``) of adapters that
        scale by ``scale`` (alpha / rank). A bucketed update calls it once per bucket (a pair may span two calls),
        then ``finish_weight_update``. The caller may reuse the tensors' storage once it returns. Engines that can
        take adapters override it; this one raises ValueError."""
        raise ValueError(
            f"LoRA weight sync: {type(self).__name__} takes no adapters: use --inference.engine=native with "
            "--model.lora.rank > 0"
        )

    def finish_weight_update(self) -> None:  # noqa: B027  (a hook: engines with nothing to close keep it)
        """Close a weight update (after its last ``load_weights`` / ``load_lora_weights``); nothing to do here."""

    @abc.abstractmethod
    def reset_cache(self) -> None:
        """Drop every cache entry that depends on the weights (prefix cache)."""

    def generate(self, requests: Sequence[Request], progress: bool = False) -> list[Completion]:
        """Run ``requests`` to completion with continuous batching; results in request order."""
        ids = [r.request_id for r in requests]
        if len(set(map(str, ids))) != len(ids):
            raise ValueError("generate: request_id values must be unique within one call")
        for r in requests:
            self.add_request(r)
        done: dict[str, Completion] = {}
        bar = Progress(total=len(requests), desc="generate") if progress else None
        while self.has_unfinished():
            try:
                completions = self.step()
            except Exception as e:  # noqa: BLE001 - any step failure: the engine's state is unknown from here
                raise EngineFailure(f"the inference engine failed in a step: {type(e).__name__}: {e}") from e
            for c in completions:
                done[str(c.request_id)] = c
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [done[str(r.request_id)] for r in requests]

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` rendered with the tokenizer's chat template plus the generation prompt."""
        return render_chat_ids(self.tokenizer, messages, tools)

    def render_prompt(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> tuple[list[int], VisionInputs | None]:
        """``render_chat`` for messages that may hold image parts: (prompt ids with the images' tokens, the vision
        inputs or None). ``ValueError`` for an image given to a text-only model or one that cannot be read."""
        if self.processor is not None:
            return self.processor.render(messages, tools)
        if has_images(messages):
            raise no_image_support("render_prompt", getattr(self.tokenizer, "name_or_path", "?"))
        return self.render_chat(messages, tools), None


def render_chat_ids(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` as a list of ids.

    transformers 5 returns a BatchEncoding; older versions a list. Raises ``ValueError`` without a template.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat_template; chat requests need one (set --model.tokenizer_path)")
    out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


class AsyncEngine:
    """asyncio front of a step-wise engine: many coroutines ``await generate(request)`` at once and
    their requests share the engine's continuous batch. One driver task steps the engine while any
    request is pending. Single-threaded: the engine runs inside the event loop between awaits.

    If ``engine.step()`` raises, the driver hands that exception to every pending ``generate`` (a
    dead driver would otherwise leave them awaiting forever), keeps it in ``failure`` and refuses
    later requests: the engine's state after a failed step is unknown. Callers that swallow per-call
    errors (verifiers records them per rollout) check ``failure`` to fail loudly.
    """

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.failure: BaseException | None = None
        """The exception that stopped the driver, if any."""
        self._futures: dict[str, asyncio.Future] = {}
        self._driver: asyncio.Task | None = None
        self._next_id = 0

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, vision: VisionInputs | None = None
    ) -> Completion:
        """Submit one request (``vision``: its prompt's images) and await its completion. Raises the engine's
        exception if a step failed."""
        if self.failure is not None:
            raise EngineFailure("the inference engine failed earlier; no new requests") from self.failure
        rid = f"async-{self._next_id}"
        self._next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self._futures[rid] = fut
        self.engine.add_request(Request(prompt_ids=list(prompt_ids), sampling=sampling, request_id=rid, vision=vision))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())
        return await fut

    async def _drive(self) -> None:
        # Yield once so that coroutines started together submit before the first step (one batch).
        await asyncio.sleep(0)
        try:
            while self.engine.has_unfinished():
                for c in self.engine.step():
                    fut = self._futures.pop(str(c.request_id))
                    if not fut.done():
                        fut.set_result(c)
                await asyncio.sleep(0)
        # Any engine error: delivered to every waiter (each re-raises it), not lost in a dead task.
        except Exception as e:  # noqa: BLE001
            self.failure = e
            futures, self._futures = self._futures, {}
            for fut in futures.values():
                if not fut.done():
                    fut.set_exception(e)

    async def aclose(self) -> None:
        """Wait until the driver has finished every request, including ones nobody awaits any more (a
        cancelled rollout), so the engine is left empty for its next user. Call before leaving the loop."""
        if self._driver is not None:
            await self._driver
