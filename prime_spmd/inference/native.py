"""The native engine: continuous batching over a fixed-slot KV cache, pure PyTorch, any device.

One ``step()``:
  1. admit waiting requests into free slots (lowest slot first) and prefill them, batched and
     right-padded, in chunks of at most ``prefill_tokens`` padded tokens; sample their first token;
  2. one decode step for every running slot: rows 0..nb-1 of the cache (nb = the smallest batch
     bucket covering the highest running slot), attending cache positions [0, Lb) (Lb = the smallest
     length bucket covering the longest running sequence). On CUDA each (nb, Lb) decode is a
     captured CUDA graph, replayed with new inputs;
  3. sample (sampling.py), copy tokens + logprobs to the host once, apply stop rules, free slots.
Free slots inside [0, nb) decode a dummy token at position 0 of their own slot: harmless, the
next request admitted there overwrites it in prefill.

See docs/inference.md for the logprob contract and the seeding scheme.
"""

from __future__ import annotations

import collections
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from prime_spmd.inference.engine import Completion, InferenceEngine, Request
from prime_spmd.inference.kv_cache import bucket_sizes, pick_bucket
from prime_spmd.inference.runner import build_runner
from prime_spmd.inference.sampling import SamplingTensors, gumbel_noise, sample

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _expert_slice(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The view of a stacked expert parameter (gate_up_proj [E, 2I, D], down_proj [E, D, I]) an HF name maps to."""
    prefix, e, proj = _EXPERT.match(name).groups()  # type: ignore[union-attr]
    e = int(e)
    if proj == "down_proj":
        p = params.get(f"{prefix}.down_proj")
        return None if p is None or p.ndim != 3 else p[e]
    p = params.get(f"{prefix}.gate_up_proj")
    if p is None or p.ndim != 3:
        return None
    inter = p.shape[1] // 2
    return p[e, :inter] if proj == "gate_proj" else p[e, inter:]


@dataclass(slots=True)
class _Seq:
    req: Request
    slot: int
    seed: int
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.req.prompt_ids) + len(self.tokens)


class NativeEngine(InferenceEngine):
    """Continuous-batching engine over ``model`` (an HF causal LM or a model with its own runner).

    ``model`` is used in place (its parameters are read at every forward). ``dtype`` casts the
    model once at construction (None keeps it). Call every method from one thread.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        max_batch_size: int = 64,
        max_model_len: int = 2048,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        cuda_graphs: bool = True,
        prefill_tokens: int = 16384,
        seed: int = 0,
        compile_sampler: bool = True,
    ) -> None:
        device = torch.device(device) if device is not None else next(model.parameters()).device
        if dtype is not None:
            model.to(dtype=dtype)
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.prefill_tokens = max(prefill_tokens, max_model_len)
        self.runner = build_runner(self.model, max_batch_size, max_model_len, device)
        self.vocab_size = self.runner.vocab_size
        self.batch_buckets = bucket_sizes(max_batch_size, 1, "pow2")
        self.len_buckets = bucket_sizes(max_model_len, min(256, max_model_len), "linear")
        # MoE expert dispatch sizes its buffers on the host (data-dependent shapes): no graphs
        has_moe = any("MoE" in type(m).__name__ for m in self.model.modules())
        self.use_graphs = cuda_graphs and device.type == "cuda" and self.runner.cache is not None and not has_moe
        # the Gumbel noise is ~25 elementwise passes over [B, V]; compiled (CUDA only) it is one
        self._noise_fn = gumbel_noise
        if compile_sampler and device.type == "cuda":
            self._noise_fn = torch.compile(gumbel_noise, dynamic=True)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._ids_buf = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self._pos_buf = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, _Seq] = {}
        self._free = list(range(max_batch_size))
        self._rng = random.Random(seed)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.num_generated_tokens = 0

    # ---- interface -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError(f"request {request.request_id!r}: empty prompt_ids")
        if n >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {n} tokens does not fit --inference.max_model_len="
                f"{self.max_model_len} (need at least one free position to generate)"
            )
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"request {request.request_id!r}: token ids {bad[:5]} outside vocab [0, {self.vocab_size})"
            )
        self._waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[Completion]:
        done: list[Completion] = []
        self._admit(done)
        if self._running:
            self._decode(done)
        return done

    def reset_cache(self) -> None:
        """No prefix cache: K/V never outlive their request. Rebuilds the RoPE tables (buffers may have moved)."""
        self.runner.rebuild_rope()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names; per-expert MoE weights (``...mlp.experts.{e}.{gate,up,down}_proj.weight``) are
        copied into the slices of a model that stacks its experts (``prime_spmd.models.qwen3``)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, tensor in weights:
            p = params.get(name)
            if p is None and _EXPERT.match(name):
                p = _expert_slice(params, name)
            if p is None:
                close = [k for k in params if k.split(".")[-1] == name.split(".")[-1]][:3]
                raise ValueError(f"load_weights: unknown parameter {name!r} (similar names: {close})")
            if p.shape != tensor.shape:
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(p.shape)}"
                )
            p.copy_(tensor)
        self.reset_cache()

    # ---- scheduling ------------------------------------------------------------------------
    def _admit(self, done: list[Completion]) -> None:
        admitted: list[_Seq] = []
        while self._waiting and self._free:
            req = self._waiting.popleft()
            self._free.sort()
            slot = self._free.pop(0)
            s = req.sampling
            seed = s.seed if s.seed is not None else self._rng.getrandbits(63)
            stop = set(s.stop_token_ids) | (set() if s.ignore_eos else set(self._eos_ids))
            admitted.append(_Seq(req=req, slot=slot, seed=seed, stop_ids=frozenset(stop)))
        if not admitted:
            return
        admitted.sort(key=lambda q: len(q.req.prompt_ids))
        chunk: list[_Seq] = []
        for q in admitted:
            t = len(q.req.prompt_ids)
            if chunk and (len(chunk) + 1) * t > self.prefill_tokens:
                self._prefill(chunk, done)
                chunk = []
            chunk.append(q)
        self._prefill(chunk, done)

    def _prefill(self, seqs: list[_Seq], done: list[Completion]) -> None:
        t = max(len(q.req.prompt_ids) for q in seqs)
        ids = torch.zeros(len(seqs), t, dtype=torch.long)
        for i, q in enumerate(seqs):
            ids[i, : len(q.req.prompt_ids)] = torch.tensor(q.req.prompt_ids)
        slots = torch.tensor([q.slot for q in seqs])
        last = torch.tensor([len(q.req.prompt_ids) - 1 for q in seqs])
        logits = self.runner.prefill(ids.to(self.device), slots.to(self.device), last.to(self.device))
        for q in seqs:
            self._running[q.slot] = q
        self._sample_and_update(logits, seqs, done)

    def _decode(self, done: list[Completion]) -> None:
        seqs = list(self._running.values())
        nb = pick_bucket(self.batch_buckets, max(self._running) + 1)
        ids = [0] * nb
        pos = [0] * nb
        for q in seqs:
            ids[q.slot] = q.tokens[-1]
            pos[q.slot] = q.length - 1
        kv_len = pick_bucket(self.len_buckets, max(pos) + 1)
        self._ids_buf[:nb].copy_(torch.tensor(ids), non_blocking=True)
        self._pos_buf[:nb].copy_(torch.tensor(pos), non_blocking=True)
        logits = self._run_decode(nb, kv_len)
        rows = torch.tensor([q.slot for q in seqs], device=self.device)
        self._sample_and_update(logits[rows], seqs, done)

    def _run_decode(self, nb: int, kv_len: int) -> torch.Tensor:
        ids, pos = self._ids_buf[:nb], self._pos_buf[:nb]
        if not self.use_graphs:
            return self.runner.decode(ids, pos, kv_len)
        key = (nb, kv_len)
        if key not in self._graphs:
            self._graphs[key] = self._capture(nb, kv_len)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _capture(self, nb: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture one decode of (nb rows, kv_len positions); the graphs share one memory pool."""
        ids, pos = self._ids_buf[:nb], self._pos_buf[:nb]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocator, cuBLAS workspaces)
                self.runner.decode(ids, pos, kv_len)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.runner.decode(ids, pos, kv_len)
        return graph, out

    def _sampling_tensors(self, seqs: list[_Seq]) -> SamplingTensors:
        sp = [q.req.sampling for q in seqs]
        floats = torch.tensor([[s.temperature, s.top_p, s.min_p] for s in sp], dtype=torch.float32)
        ints = torch.tensor([[s.top_k, q.seed, len(q.tokens)] for s, q in zip(sp, seqs)], dtype=torch.int64)
        floats, ints = floats.to(self.device, non_blocking=True), ints.to(self.device, non_blocking=True)
        return SamplingTensors(
            temperature_B=floats[:, 0],
            top_p_B=floats[:, 1],
            min_p_B=floats[:, 2],
            top_k_B=ints[:, 0],
            seeds_B=ints[:, 1],
            steps_B=ints[:, 2],
            needs_sort=any(s.temperature > 0 and (s.top_k > 0 or s.top_p < 1.0) for s in sp),
            needs_min_p=any(s.temperature > 0 and s.min_p > 0 for s in sp),
        )

    def _sample_and_update(self, logits_BV: torch.Tensor, seqs: list[_Seq], done: list[Completion]) -> None:
        tokens, logprobs = sample(logits_BV, self._sampling_tensors(seqs), self._noise_fn)
        both = torch.stack([tokens.double(), logprobs.double()]).cpu()  # the step's one device->host sync
        tok_list, lp_list = both[0].long().tolist(), both[1].tolist()
        self.num_generated_tokens += len(seqs)
        for q, tok, lp in zip(seqs, tok_list, lp_list):
            q.tokens.append(tok)
            q.logprobs.append(lp)
            reason = self._finish_reason(q, tok)
            if reason is not None:
                del self._running[q.slot]
                self._free.append(q.slot)
                done.append(self._completion(q, reason))

    def _finish_reason(self, q: _Seq, tok: int) -> str | None:
        s = q.req.sampling
        if tok in q.stop_ids:
            return "stop"
        if s.stop and self._hits_stop_string(q):
            return "stop"
        if len(q.tokens) >= s.max_tokens or q.length >= self.max_model_len:
            return "length"
        return None

    def _hits_stop_string(self, q: _Seq) -> bool:
        """Does the text of the last token complete a stop string? Decodes a short tail window."""
        stops = q.req.sampling.stop
        window = max(len(x) for x in stops) + 8
        tail = q.tokens[-window:]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        prev = self.tokenizer.decode(tail[:-1], skip_special_tokens=False)
        # a stop string that the new token's text completes (earlier ones would have stopped already)
        return any(x in text and x not in prev for x in stops)

    def _completion(self, q: _Seq, reason: str) -> Completion:
        text = self.tokenizer.decode(q.tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
        return Completion(
            request_id=q.req.request_id,
            prompt_ids=list(q.req.prompt_ids),
            token_ids=q.tokens,
            logprobs=q.logprobs,
            finish_reason=reason,  # type: ignore[arg-type]
            text=text,
        )
