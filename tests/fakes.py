"""Small fakes, and checks against a direct engine, shared by several test files (no verifiers import:
both venvs use them)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable

import pytest
import torch

from prime_spmd.inference.engine import Completion, InferenceEngine, Request


class QueueBridge:
    """Stands in for the weight bridge in one process: the sender's broadcasts are queued (copied), the
    receiver's broadcasts pop them in order (set ``receiving`` to switch sides)."""

    def __init__(self) -> None:
        self.sent: collections.deque[torch.Tensor] = collections.deque()
        self.receiving = False

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.receiving:
            tensor.copy_(self.sent.popleft())
        else:
            self.sent.append(tensor.detach().clone())


class WeightHoldingEngine(InferenceEngine):
    """Holds the tensors a weight sync loads (``loaded``, copied); generates nothing."""

    tokenizer = None

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def add_request(self, request: Request) -> None:
        raise NotImplementedError

    def step(self) -> list[Completion]:
        return []

    def has_unfinished(self) -> bool:
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.loaded.update({n: t.clone() for n, t in weights})

    def reset_cache(self) -> None:
        pass


class FakeStepEngine(InferenceEngine):
    """Continuous-batching fake: each ``step`` admits queued requests and samples one token for each running one.

    Records every request's prompt ids and every completion, so tests can compare with the rollouts.
    """

    def __init__(self, tokenizer, max_model_len: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []
        self.running: list[tuple[Request, list[int], list[float]]] = []
        self.log: list[Completion] = []
        self.max_batch_seen = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def next_token(self, request: Request, generated: list[int]) -> tuple[int, float]:
        raise NotImplementedError

    def step(self) -> list[Completion]:
        self.running += [(r, [], []) for r in self.waiting]
        self.waiting = []
        self.max_batch_seen = max(self.max_batch_seen, len(self.running))
        done, still = [], []
        for req, toks, lps in self.running:
            tok, lp = self.next_token(req, toks)
            toks.append(tok)
            lps.append(lp)
            sp = req.sampling
            stop = (tok == self.tokenizer.eos_token_id and not sp.ignore_eos) or tok in sp.stop_token_ids
            if stop or len(toks) >= sp.max_tokens:
                c = Completion(
                    request_id=req.request_id,
                    prompt_ids=list(req.prompt_ids),
                    token_ids=list(toks),
                    logprobs=list(lps),
                    finish_reason="stop" if stop else "length",
                    text=self.tokenizer.decode(toks, skip_special_tokens=True),
                )
                self.log.append(c)
                done.append(c)
            else:
                still.append((req, toks, lps))
        self.running = still
        return done

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def reset_cache(self) -> None:
        pass


class RecordingEngine(InferenceEngine):
    """Delegates to a real engine; records completions and the most requests ever in flight at once."""

    def __init__(self, inner: InferenceEngine) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.max_model_len = inner.max_model_len
        self.log: list[Completion] = []
        self.in_flight = 0
        self.max_batch_seen = 0
        self.step_threads: set[int] = set()

    def add_request(self, request: Request) -> None:
        self.in_flight += 1
        self.inner.add_request(request)

    def step(self) -> list[Completion]:
        self.step_threads.add(threading.get_ident())
        self.max_batch_seen = max(self.max_batch_seen, self.in_flight)
        done = self.inner.step()
        self.in_flight -= len(done)
        self.log += done
        return done

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.inner.load_weights(weights)

    def reset_cache(self) -> None:
        self.inner.reset_cache()


def native_engine(model, tokenizer) -> RecordingEngine:
    from prime_spmd.inference.native import NativeEngine

    return RecordingEngine(
        NativeEngine(model, tokenizer, max_batch_size=8, max_model_len=512, device="cpu", cuda_graphs=False)
    )


class ScriptedEngine(FakeStepEngine):
    """Emits ``script(prompt_text)`` tokenized, one token per step, logprob -0.1 * (position + 1)."""

    def __init__(self, tokenizer, script: Callable[[str], str], **kw) -> None:
        super().__init__(tokenizer, **kw)
        self.script = script
        self.prompts: list[str] = []
        self._planned: dict[str, list[int]] = {}

    def next_token(self, request: Request, generated: list[int]) -> tuple[int, float]:
        key = str(request.request_id)
        if not generated:
            text = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
            self.prompts.append(text)
            self._planned[key] = self.tokenizer.encode(self.script(text), add_special_tokens=False)
        planned = self._planned[key]
        return planned[len(generated)], -0.1 * (len(generated) + 1)


def direct_completion(model, tokenizer, prompt: list[dict], sampling) -> Completion:
    """What a fresh native engine samples for the chat ``prompt`` alone: the token-exactness reference."""
    engine = native_engine(model, tokenizer)
    return engine.generate([Request(prompt_ids=engine.render_chat(prompt), sampling=sampling)])[0]


def assert_rollout_is(rollout, example_id: int, sample_idx: int, completion: Completion) -> None:
    """``rollout`` validates, is sample ``sample_idx`` of ``example_id`` and carries exactly ``completion``'s
    prompt ids, completion ids (every one trained) and logprobs."""
    rollout.validate()
    assert (rollout.example_id, rollout.sample_idx) == (example_id, sample_idx)
    assert rollout.prompt_ids == completion.prompt_ids
    assert rollout.completion_ids == completion.token_ids
    assert rollout.completion_mask == [1] * len(completion.token_ids)
    assert rollout.inference_logprobs == pytest.approx(completion.logprobs)


def walk_turns(
    log: list[Completion], prompt_ids: list[int], num_turns: int
) -> tuple[list[int], list[int], list[float]]:
    """(token stream, mask, logprobs) that a ``num_turns``-turn rollout starting at ``prompt_ids`` must train
    on, walked through the engine's completions ``log``: each turn's prompt is the shortest logged one
    extending the previous prompt + completion; sampled tokens get mask 1 and their logprobs, the env
    tokens between turns mask 0 and logprob 0."""
    by_prompt = {tuple(c.prompt_ids): c for c in log}
    seq, mask, lps = list(prompt_ids), [], []
    for turn in range(num_turns):
        c = by_prompt[tuple(seq)]
        seq += c.token_ids
        mask += [1] * len(c.token_ids)
        lps += c.logprobs
        if turn < num_turns - 1:  # the next turn's prompt (later turns' prompts extend it too)
            nxt = min((p for p in by_prompt if len(p) > len(seq) and list(p[: len(seq)]) == seq), key=len)
            mask += [0] * (len(nxt) - len(seq))
            lps += [0.0] * (len(nxt) - len(seq))
            seq = list(nxt)
    return seq, mask, lps
