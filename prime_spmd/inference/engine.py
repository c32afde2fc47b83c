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
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

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


class InferenceEngine(abc.ABC):
    """Step-wise engine. Subclasses implement ``add_request``, ``step``, ``has_unfinished``,
    ``load_weights`` and ``reset_cache``; ``generate`` is built on them.

    Called on every rank of an inference engine's tp group with identical inputs in identical order.
    """

    tokenizer: Any
    weights_version: int = 0
    """Optimizer steps of the weights the engine holds. Set by the weight sync (prime_spmd/sync/weights.py) after
    a complete update, to the version the trainer sent; generation reports it with every batch."""

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

    @abc.abstractmethod
    def reset_cache(self) -> None:
        """Drop every cache entry that depends on the weights (prefix cache)."""

    def generate(self, requests: Sequence[Request], progress: bool = False) -> list[Completion]:
        """Run ``requests`` to completion with continuous batching; results in request order."""
        order = {}
        for i, r in enumerate(requests):
            key = (i, r.request_id)
            order[id(r)] = key
        ids = [r.request_id for r in requests]
        if len(set(map(str, ids))) != len(ids):
            raise ValueError("generate: request_id values must be unique within one call")
        for r in requests:
            self.add_request(r)
        done: dict[str, Completion] = {}
        bar = _progress(len(requests)) if progress else None
        while self.has_unfinished():
            for c in self.step():
                done[str(c.request_id)] = c
                if bar is not None:
                    bar.advance()
        if bar is not None:
            bar.close()
        return [done[str(r.request_id)] for r in requests]

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` rendered with the tokenizer's chat template plus the generation prompt."""
        return render_chat_ids(self.tokenizer, messages, tools)


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


class _progress:
    def __init__(self, total: int) -> None:
        self._p = Progress(total=total, desc="generate")

    def advance(self) -> None:
        self._p.update(1)

    def close(self) -> None:
        self._p.close()


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

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        """Submit one request and await its completion. Raises the engine's exception if a step failed."""
        if self.failure is not None:
            raise RuntimeError("the inference engine failed earlier; no new requests") from self.failure
        rid = f"async-{self._next_id}"
        self._next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self._futures[rid] = fut
        self.engine.add_request(Request(prompt_ids=list(prompt_ids), sampling=sampling, request_id=rid))
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


class ThreadedAsyncEngine(AsyncEngine):
    """``AsyncEngine`` that steps the engine on one worker thread, so the event loop's Python (environment
    code, chat rendering, scoring of finished rollouts) runs while the engine computes: a GPU step waits
    in its device sync with the GIL released. Only for engines that any one thread may drive and whose
    step grouping may depend on timing (the native engine; not engines whose ranks step in lockstep, e.g.
    vLLM with tp > 1); the verifiers bridge uses it only with ``engine_thread=True``.

    Every engine call (``add_request``, ``step``, ``has_unfinished``) is made on the worker. The requests
    submitted during one event-loop iteration reach the engine together (coroutines started together
    share a step, as with ``AsyncEngine``); later ones join the next step. The worker starts with the
    first request and ends in ``aclose`` (which the owner must await) once the engine is empty. It
    copies the loop thread's CUDA device and grad mode (thread-local in torch). A failed step is
    handed to every waiter and kept in ``failure``, as in ``AsyncEngine``.
    """

    def __init__(self, engine: InferenceEngine) -> None:
        super().__init__(engine)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batch: list[tuple[Request, asyncio.Future]] = []
        """Loop thread only: submitted during this loop iteration, not yet handed to the worker."""
        self._cond = threading.Condition()
        self._inbox: list[tuple[Request, asyncio.Future]] = []
        """Under ``_cond``: handed to the worker, not yet added to the engine."""
        self._closing = False
        self._thread: threading.Thread | None = None
        self._exited: asyncio.Future | None = None

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion:
        if self.failure is not None:
            raise RuntimeError("the inference engine failed earlier; no new requests") from self.failure
        assert not self._closing, "generate after aclose"
        loop = self._loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self._batch:
            loop.call_soon(self._hand_over)
        self._batch.append(
            (Request(prompt_ids=list(prompt_ids), sampling=sampling, request_id=f"async-{self._next_id}"), fut)
        )
        self._next_id += 1
        if self._thread is None:
            self._exited = loop.create_future()
            cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None
            args = (loop, cuda, torch.is_grad_enabled())
            self._thread = threading.Thread(target=self._work, args=args, name="ps-engine", daemon=True)
            self._thread.start()
        return await fut

    def _hand_over(self) -> None:
        batch, self._batch = self._batch, []
        with self._cond:
            if self.failure is None:
                self._inbox += batch
                self._cond.notify()
                return
        for _, fut in batch:
            _settle(fut, False, RuntimeError("the inference engine failed earlier; no new requests"))

    def _work(self, loop: asyncio.AbstractEventLoop, cuda: int | None, grad: bool) -> None:
        torch.set_grad_enabled(grad)
        if cuda is not None:
            torch.cuda.set_device(cuda)
        futures: dict[int | str, asyncio.Future] = {}
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self.engine.has_unfinished():
                        if self._closing:
                            return
                        self._cond.wait()
                    batch, self._inbox = self._inbox, []
                for request, fut in batch:
                    try:
                        self.engine.add_request(request)
                    # A bad request (too long, bad ids) fails its own caller, as add_request in AsyncEngine does.
                    except Exception as e:  # noqa: BLE001
                        loop.call_soon_threadsafe(_settle, fut, False, e)
                        continue
                    futures[request.request_id] = fut
                done = self.engine.step()
                if done:
                    loop.call_soon_threadsafe(_settle_all, [(futures.pop(c.request_id), c) for c in done])
        # Any engine error: delivered to every waiter (each re-raises it), as in AsyncEngine._drive.
        except Exception as e:  # noqa: BLE001
            with self._cond:
                self.failure = e
                waiting = list(futures.values()) + [fut for _, fut in self._inbox]
                self._inbox = []
            loop.call_soon_threadsafe(_settle_all, [(fut, e) for fut in waiting], False)
        finally:
            loop.call_soon_threadsafe(_settle, self._exited, True, None)

    async def aclose(self) -> None:
        """Let the worker finish every request (also ones nobody awaits any more), then wait for it to exit."""
        if self._thread is None:
            return
        with self._cond:
            self._closing = True
            self._cond.notify()
        assert self._exited is not None
        await self._exited
        self._thread.join()


def _settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if not fut.done():
        fut.set_result(value) if ok else fut.set_exception(value)


def _settle_all(pairs: list[tuple[asyncio.Future, Any]], ok: bool = True) -> None:
    for fut, value in pairs:
        _settle(fut, ok, value)
