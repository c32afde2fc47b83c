"""The native engine's host-side scheduler: which request runs in which slot, which prompts prefill together, when a
sequence stops. Plain Python over token ids, no model and no device: the engine asks it what to run and tells it what
was sampled (``NativeEngine`` in native.py does the forward passes).

- admission: requests wait in FIFO order until a slot is free (lowest slot first) and, with a paged KV cache, until
  the pool has the blocks of the request's prompt + max_tokens (a prompt admitted in the same round is shared);
- prompt sharing: requests admitted together with identical prompts (a GRPO group) are ordered next to each other
  and prefill once (``leaders``);
- stop rules: a stop token (``stop_token_ids``, the tokenizer's eos unless ``ignore_eos``), a stop string that the
  new token's text completes, ``max_tokens`` or the cache length.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prime_spmd.inference.engine import Completion, Request


@dataclass(slots=True)
class Seq:
    """One admitted request in its slot."""

    req: Request
    slot: int
    seed: int
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_launched: int = 0
    """Tokens whose sampling has been launched on the device (>= len(tokens): the host lags one step)."""
    finished: bool = False

    @property
    def length(self) -> int:
        return len(self.req.prompt_ids) + len(self.tokens)


class Scheduler:
    """Slots, the waiting queue and the stop rules of one engine (see the module doc).

    ``blocks``: the paged KV cache whose free blocks gate admission (``blocks_for``, ``num_free_blocks``), None for
    a cache of whole slots. ``release(slot)`` is called when a sequence finishes (the engine frees its cache slot).
    ``tokenizer`` (may be None) gives the eos ids, decodes stop strings and completion texts. ``seed`` seeds the
    per-request seeds of requests that bring none.
    """

    def __init__(
        self,
        *,
        num_slots: int,
        max_model_len: int,
        prefill_tokens: int,
        share_prompts: bool,
        tokenizer: Any = None,
        seed: int = 0,
        blocks: Any = None,
        release: Callable[[int], None] = lambda slot: None,
    ) -> None:
        self.max_model_len, self.prefill_tokens, self.share_prompts = max_model_len, prefill_tokens, share_prompts
        self.tokenizer, self.blocks, self.release = tokenizer, blocks, release
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Seq] = {}
        self.free = list(range(num_slots))
        self._rng = random.Random(seed)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.num_generated_tokens = 0

    def reserve_len(self, req: Request) -> int:
        """Cache positions a request can fill: its prompt and max_tokens, within the cache length."""
        return min(len(req.prompt_ids) + req.sampling.max_tokens, self.max_model_len)

    def admit(self) -> list[list[Seq]]:
        """Move waiting requests into free slots; return them in prefill chunks (identical prompts adjacent, at most
        ``prefill_tokens`` padded tokens of distinct prompts a chunk), to be prefilled in this order."""
        admitted: list[Seq] = []
        budget = self.blocks.num_free_blocks if self.blocks is not None else 0
        prompts: set[tuple[int, ...]] = set()  # admitted this round: a repeat shares their whole prompt blocks
        while self.waiting and self.free:
            req = self.waiting[0]
            if self.blocks is not None:  # wait (FIFO) while the pool is short of this request's blocks
                key = tuple(req.prompt_ids)
                shared = len(key) if self.share_prompts and key in prompts else 0
                need = self.blocks.blocks_for(self.reserve_len(req), shared)
                if need > budget:
                    break
                budget -= need
                prompts.add(key)
            self.waiting.popleft()
            self.free.sort()
            slot = self.free.pop(0)
            s = req.sampling
            seed = s.seed if s.seed is not None else self._rng.getrandbits(63)
            stop = set(s.stop_token_ids) | (set() if s.ignore_eos else set(self._eos_ids))
            admitted.append(Seq(req=req, slot=slot, seed=seed, stop_ids=frozenset(stop)))
        # identical prompts end up adjacent, so a group shares one chunk (and one prefill)
        admitted.sort(key=lambda q: (len(q.req.prompt_ids), tuple(q.req.prompt_ids)))
        chunks: list[list[Seq]] = []
        chunk: list[Seq] = []
        num_unique = 0
        for q in admitted:
            t = len(q.req.prompt_ids)
            new = not (self.share_prompts and chunk and chunk[-1].req.prompt_ids == q.req.prompt_ids)
            if new and chunk and (num_unique + 1) * t > self.prefill_tokens:
                chunks.append(chunk)
                chunk, num_unique = [], 0
            chunk.append(q)
            num_unique += new
        if chunk:
            chunks.append(chunk)
        return chunks

    def leaders(self, seqs: list[Seq]) -> tuple[list[Seq], list[int]]:
        """The seqs of a chunk that prefill (one per distinct prompt when sharing) and each seq's row among them."""
        leaders: list[Seq] = []
        row = []
        for q in seqs:
            same = leaders and leaders[-1].req.prompt_ids == q.req.prompt_ids
            same = same and _image_key(leaders[-1].req) == _image_key(q.req)  # equal ids, other pixels: not shared
            if not (self.share_prompts and same):
                leaders.append(q)
            row.append(len(leaders) - 1)
        return leaders, row

    def start(self, seqs: list[Seq]) -> None:
        """``seqs`` were prefilled and their first token launched."""
        for q in seqs:
            self.running[q.slot] = q
            q.num_launched = 1

    def room(self, q: Seq) -> int:
        """Tokens ``q`` may still be launched: up to its max_tokens and the cache length."""
        return min(q.req.sampling.max_tokens, self.max_model_len - len(q.req.prompt_ids)) - q.num_launched

    def to_decode(self) -> list[Seq]:
        """Running sequences that can still need a token beyond those launched (as far as the host knows now)."""
        return [q for q in self.running.values() if not q.finished and self.room(q) > 0]

    def record(self, seqs: list[Seq], tokens: list[int], logprobs: list[float]) -> list[Completion]:
        """Append one sampled token (and its logprob) to each of ``seqs``; finish, release and return those that
        stop."""
        done = []
        self.num_generated_tokens += len(seqs)
        for q, tok, lp in zip(seqs, tokens, logprobs):
            q.tokens.append(tok)
            q.logprobs.append(lp)
            reason = self.finish_reason(q, tok)
            if reason is not None:
                q.finished = True
                del self.running[q.slot]
                self.release(q.slot)
                self.free.append(q.slot)
                done.append(self.completion(q, reason))
        return done

    def finish_reason(self, q: Seq, tok: int) -> str | None:
        s = q.req.sampling
        if tok in q.stop_ids:
            return "stop"
        if s.stop and self._hits_stop_string(q):
            return "stop"
        if len(q.tokens) >= s.max_tokens or q.length >= self.max_model_len:
            return "length"
        return None

    def _hits_stop_string(self, q: Seq) -> bool:
        """Does the text of the last token complete a stop string? Decodes a short tail window."""
        stops = q.req.sampling.stop
        window = max(len(x) for x in stops) + 8
        tail = q.tokens[-window:]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        prev = self.tokenizer.decode(tail[:-1], skip_special_tokens=False)
        # a stop string that the new token's text completes (earlier ones would have stopped already)
        return any(x in text and x not in prev for x in stops)

    def completion(self, q: Seq, reason: str) -> Completion:
        text = self.tokenizer.decode(q.tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        return Completion(
            request_id=q.req.request_id,
            prompt_ids=list(q.req.prompt_ids),
            token_ids=q.tokens,
            logprobs=q.logprobs,
            finish_reason=reason,  # type: ignore[arg-type]
            text=text,
        )


def _image_key(req) -> str | None:
    """The content key of a request's images (vision-language models), None without."""
    vision = getattr(req, "vision", None)
    return None if vision is None else vision.key
