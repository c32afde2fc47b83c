"""The native engine: continuous batching over a fixed-slot KV cache, pure PyTorch, any device.

One ``step()``:
  1. admit waiting requests into free slots (lowest slot first) and prefill them, batched and
     right-padded, in chunks of at most ``prefill_tokens`` padded tokens; sample their first token
     and write each slot's decode state (next input token, position, sampling params) on the device;
  2. launch one decode step for every running slot that may need another token: rows 0..nb-1 of
     the cache (nb = the smallest batch bucket covering the highest such slot), attending cache
     positions [0, Lb) (Lb = the smallest length bucket covering the longest sequence). The step
     (forward, sampling, logprobs, advancing the device state) reads and writes only device
     buffers; on CUDA it is one captured CUDA graph per (nb, Lb, sampler flags);
  3. collect the previous step's tokens + logprobs (copied to pinned host memory behind it), apply
     stop rules, free slots. The host thus works one step behind the device and never waits for
     the step it just launched; a sequence that stops on a token wastes one decoded row.
Free or finished slots inside [0, nb) decode a dummy token in their own slot: harmless, the next
request admitted there overwrites it in prefill.

See docs/inference.md for the logprob contract and the seeding scheme.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from prime_spmd.inference.engine import Completion, InferenceEngine, Request
from prime_spmd.inference.kv_cache import PagedKVCache, bucket_sizes, pick_bucket
from prime_spmd.inference.runner import DecodeAttention, DecodeLinear, KVCacheKind, build_runner
from prime_spmd.inference.sampling import Sampler, SamplingTensors, make_sampler, resolve_sampler
from prime_spmd.kernels.decode_glue.reference import advance_reference as advance_decode_state
from prime_spmd.models.lora import LoraMerger, base_name
from prime_spmd.models.registry import adapter_for

# Prefills of up to this many padded tokens (row bucket x length bucket) run as captured CUDA graphs (CUDA, the slot
# cache, no MoE): an eager prefill launches ~50 kernels a layer from Python, which for a small model costs far
# more host time than GPU time (Qwen3-0.6B, one 128-token prompt, H200: a generate's first step 61.6 ms eager, 6.8 ms
# with the graph; docs/benchmarks.md).
PREFILL_GRAPH_MAX_TOKENS = 8192
PREFILL_MIN_LEN = 16  # the shortest prefill length bucket (powers of two up to max_model_len)
MULTI_STEP_MAX_ROWS = 16
"""Row buckets up to this size may run several decode steps a launch (``decode_steps_per_launch``): there the gap
between two graph replays (~16 us on an H100, docs/inference.md) is >= 1% of a step; larger steps run one a launch
(fewer graphs to capture at warm-up)."""
AUTO_DECODE_STEPS = 4
"""``decode_steps_per_launch`` 0 (auto): this many with CUDA graphs, else 1."""


def pad_prefill(ids_BT: torch.Tensor, slots: list[int], last: list[int], rows: int, length: int):
    """A prefill batch padded to ``rows`` x ``length`` for a captured graph: ids right-padded with 0 (after each
    prompt, as in any batched prefill: causal attention keeps the real positions exact, and the K/V written past a
    prompt are overwritten by decode before they are attended); the extra rows repeat row 0 (its ids, slot and last
    position), so they write the same K/V into the same slot and touch no other slot. Returns CPU tensors
    (ids [rows, length], slots [rows], last [rows])."""
    b, t = ids_BT.shape
    if not (b <= rows and t <= length):
        raise ValueError(f"pad_prefill: batch {b} x {t} does not fit {rows} x {length}")
    ids = torch.zeros(rows, length, dtype=torch.long)
    ids[:b, :t] = ids_BT
    ids[b:] = ids[0]
    return ids, torch.tensor(slots + slots[:1] * (rows - b)), torch.tensor(last + last[:1] * (rows - b))


@dataclass(slots=True)
class _Seq:
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


class NativeEngine(InferenceEngine):
    """Continuous-batching engine over ``model`` (an HF causal LM or a model with its own runner).

    ``model`` is used in place (its parameters are read at every forward). ``dtype`` casts the
    model once at construction (None keeps it). ``decode_attention``: "bmm" (batched matmuls over
    the length bucket), "triton" (the flash-decoding kernel, kernels/decode_attention), "fused"
    (that kernel with the q/k norm, RoPE and cache write folded in) or "auto" (fused on CUDA, bmm elsewhere); ``decode_linear``: "torch", "triton" (fused norm / GEMM / epilogue
    kernels, kernels/decode_linear) or "auto" (triton on CUDA for hidden size <= 1024, else torch); both
    used by the Llama-style runner. ``sampler``: "torch", "triton" (kernels/gumbel_sample for plain sampling),
    "fused" (as triton, and decode steps of <= 64 rows sample inside the LM head) or "auto" (fused on CUDA, torch
    elsewhere: ``sampling.resolve_sampler``). ``kv_cache``: "slot" (a whole ``max_model_len`` slot per sequence) or "paged"
    (blocks of ``kv_block_size`` positions from a pool of ``kv_cache_tokens`` tokens, 0: as many as the slots
    hold; a sequence takes the blocks of its prompt + max_tokens, a group's samples share their prompt's blocks,
    and admission waits while the pool is short). ``pdl``: launch the decode step's Triton kernels (decode linears,
    the fused attention) with programmatic dependent launch (kernels/pdl; CUDA, process-wide; ``self.pdl`` says
    whether it is on). ``fused_prefill``: prefill through one pure layer function (fused QKV / gate-up weights, compiled
    on CUDA) instead of the model's modules (dense Llama-style models; None: on CUDA). Call every method from one thread.
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
        share_prefill: bool = True,
        decode_attention: DecodeAttention = "auto",
        decode_linear: DecodeLinear = "auto",
        sampler: Sampler = "auto",
        kv_cache: KVCacheKind = "slot",
        kv_block_size: int = 16,
        kv_cache_tokens: int = 0,
        pdl: bool = True,
        fused_prefill: bool | None = None,
        decode_steps_per_launch: int = 0,
    ) -> None:
        device = torch.device(device) if device is not None else next(model.parameters()).device
        if decode_steps_per_launch < 0:
            raise ValueError(f"decode_steps_per_launch must be >= 0 (0: auto), got {decode_steps_per_launch}")
        from prime_spmd.kernels.pdl import launch as pdl_launch

        # process-wide: the last engine built decides (one engine per process in rl / eval)
        self.pdl = pdl_launch.set_enabled(pdl and device.type == "cuda")
        if dtype is not None:
            model.to(dtype=dtype)
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.prefill_tokens = max(prefill_tokens, max_model_len)
        self.runner = build_runner(
            self.model,
            max_batch_size,
            max_model_len,
            device,
            compile_decode=cuda_graphs,
            attention=decode_attention,
            linear=decode_linear,
            kv_cache=kv_cache,
            kv_block_size=kv_block_size,
            kv_cache_tokens=kv_cache_tokens,
            fused_prefill=fused_prefill,
        )
        self.vocab_size = self.runner.vocab_size
        self.batch_buckets = bucket_sizes(max_batch_size, 1, "pow2")
        self.len_buckets = bucket_sizes(max_model_len, min(256, max_model_len), "linear")
        # MoE expert dispatch sizes its buffers on the host (data-dependent shapes): no graphs
        has_moe = any("MoE" in type(m).__name__ for m in self.model.modules())
        self.use_graphs = cuda_graphs and device.type == "cuda" and self.runner.cache is not None and not has_moe
        # the torch sampler is ~30 elementwise/reduction passes over [B, V]; compiled (CUDA only) a few
        self.sampler = resolve_sampler(sampler, device)
        self._sample = make_sampler(self.sampler, compile_sampler and device.type == "cuda")
        if getattr(self.runner, "glue", False):  # the Triton decode path: one launch (kernels/decode_glue)
            from prime_spmd.kernels.decode_glue.kernel import advance

            self._advance = advance
        else:
            self._advance = torch.compile(advance_decode_state) if self.use_graphs else advance_decode_state
        # "fused": decode steps of few rows sample inside the LM head (kernels/gumbel_sample), logits never written
        self._head_rows = 0
        if self.sampler == "fused" and self.runner.cache is not None:
            from prime_spmd.kernels.gumbel_sample.kernel import LM_HEAD_MAX_ROWS

            self._head_rows = LM_HEAD_MAX_ROWS
        # decode steps one launch (graph replay) may run: each launch's host work and the gap between two replays
        # are paid once for k tokens; a launch takes k > 1 only while nothing waits for admission and every row has
        # room for k more tokens (a row that stops early discards the rest of its launch's tokens, as it does today
        # with the step launched before the host saw its stop)
        self.decode_steps = decode_steps_per_launch or (AUTO_DECODE_STEPS if self.use_graphs else 1)
        self._graphs: dict[tuple[int, int, bool, bool, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        # prefill graphs by (row bucket, length bucket): the graph and its static inputs (ids, slots, last); all of
        # them write their logits into one buffer [max_batch_size, V] (allocated at the first capture)
        self._prefill_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._prefill_logits: torch.Tensor | None = None
        self.prefill_len_buckets = bucket_sizes(max_model_len, min(PREFILL_MIN_LEN, max_model_len), "pow2")
        # per-slot decode state on the device, written at admission and advanced by each decode step
        s_ = max_batch_size
        self._ids = torch.zeros(s_, dtype=torch.long, device=device)
        self._pos = torch.zeros(s_, dtype=torch.long, device=device)
        self._steps = torch.zeros(s_, dtype=torch.long, device=device)
        self._seeds = torch.zeros(s_, dtype=torch.long, device=device)
        self._top_k = torch.zeros(s_, dtype=torch.long, device=device)
        self._floats = torch.ones(3, s_, dtype=torch.float32, device=device)  # temperature, top_p, min_p
        k_ = self.decode_steps
        self._out = torch.zeros(k_, 2, s_, dtype=torch.float64, device=device)  # per step of a launch: token, logprob
        pin = device.type == "cuda"
        self._host_out = [torch.zeros(k_, 2, s_, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self._num_launches = 0
        self._pending: tuple[list[_Seq], torch.Tensor, torch.cuda.Event | None, int] | None = None
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, _Seq] = {}
        self._free = list(range(max_batch_size))
        self._rng = random.Random(seed)
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.num_generated_tokens = 0
        # requests admitted together with identical prompts (a GRPO group) prefill once; the other
        # slots get a copy of the prompt's K/V (slot cache) or point at its blocks (paged cache)
        self.share_prefill = share_prefill and self.runner.cache is not None
        self._paged = isinstance(self.runner.cache, PagedKVCache)
        self.num_prefill_tokens = 0
        """Prompt tokens run through the model (shared prompts counted once)."""
        self.num_prompt_tokens = 0
        """Prompt tokens admitted."""
        self._lora: LoraMerger | None = None
        """LoRA weight updates: the base weights and pending adapters (``load_lora_weights``)."""

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
        if self._paged:
            cache, n = self.runner.cache, self._reserve_len(request)
            need = cache.blocks_for(n)
            if need > cache.num_blocks:
                raise ValueError(
                    f"request {request.request_id!r}: {n} positions (prompt + max_tokens) need {need} KV blocks, "
                    f"the pool has {cache.num_blocks}: raise --inference.kv_cache_tokens"
                )
        self._waiting.append(request)

    def _reserve_len(self, req: Request) -> int:
        """Cache positions a request can fill: its prompt and max_tokens, within the cache length."""
        return min(len(req.prompt_ids) + req.sampling.max_tokens, self.max_model_len)

    def kv_cache_stats(self) -> dict[str, float]:
        """The KV cache's memory (``SlotKVCache.stats`` / ``PagedKVCache.stats``); empty without a cache."""
        return self.runner.cache.stats() if self.runner.cache is not None else {}

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._pending)

    def step(self) -> list[Completion]:
        done: list[Completion] = []
        self._admit(done)
        launched = self._launch_decode()
        if self._pending is not None:
            self._collect(self._pending, done)
        self._pending = launched
        return done

    @torch.no_grad()
    def warmup(self, max_len: int | None = None) -> int:
        """Run every decode variant a job can meet before it serves a request, so that compiling (the fused
        layer, the sampler, the decode-attention kernel's per-shape specializations) and CUDA-graph capture
        happen here rather than inside the first steps that meet each shape.

        One prefill of one-token prompts (first cuBLAS and sampler use), then the decode step of every row
        bucket at every length bucket up to ``max_len`` tokens (default: the cache length), plain sampling
        (no top-k/top-p/min-p, what RL uses; filtered sampling is still captured on first use). On CUDA each
        step is compiled and captured (``_capture``); elsewhere it runs once. Its cost grows with the number
        of buckets (rows x lengths). With no request in flight every slot is free: the device state and the
        K/V the steps write are overwritten at admission. Returns the number of decode variants run.
        """
        if self.has_unfinished():
            raise ValueError("NativeEngine.warmup: requests are in flight; warm up before adding requests")
        if self.runner.cache is None:  # the generic runner re-runs whole sequences: nothing to compile or capture
            return 0
        # two rows: the compiled sampler (dynamic shapes) specializes a size of 1, which prefill rarely has
        rows = min(2, self.max_batch_size)
        ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        slots = torch.arange(rows, device=self.device)
        zeros, ones = torch.zeros(rows, dtype=torch.long, device=self.device), torch.ones(rows, device=self.device)
        logits = self.runner.prefill(ids, slots, zeros)
        self._sample(logits, ones, zeros, ones, 0 * ones, zeros, zeros, False, False)
        top = pick_bucket(self.len_buckets, min(max_len or self.max_model_len, self.max_model_len))
        keys = [(nb, kv, False, False, 1) for kv in self.len_buckets if kv <= top for nb in self.batch_buckets]
        if self.decode_steps > 1:
            keys += [(nb, kv, s, m, self.decode_steps) for nb, kv, s, m, _ in keys if nb <= MULTI_STEP_MAX_ROWS]
        for key in keys:
            if not self.use_graphs:
                self._decode_step(*key)
            elif key not in self._graphs:
                self._graphs[key] = self._capture(*key)
        return len(keys)

    def reset_cache(self) -> None:
        """No prefix cache: K/V never outlive their request. Rebuilds the RoPE tables (buffers may have moved)."""
        self.runner.rebuild_rope()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names, mapped to the model's parameters by its adapter (``param_for_hf_name``: e.g. per-expert
        MoE weights into the slices of a model that stacks its experts, ``prime_spmd.models.qwen3``)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        adapter = adapter_for(self.model)
        for name, tensor in weights:
            p = adapter.param_for_hf_name(params, name)
            if p is None:
                close = [k for k in params if k.split(".")[-1] == name.split(".")[-1]][:3]
                raise ValueError(f"load_weights: unknown parameter {name!r} (similar names: {close})")
            if p.shape != tensor.shape:
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(p.shape)}"
                )
            p.copy_(tensor)
        self.reset_cache()

    @torch.no_grad()
    def load_lora_weights(self, adapters: Iterable[tuple[str, torch.Tensor]], scale: float) -> None:
        """Merge each (A, B) pair into its base weight, W0 + scale * B @ A, and load it (``load_weights``). W0 is the
        weight the model held when its adapters first arrived (the one it loaded from disk), kept for every later
        update."""
        if self._lora is None:
            self._lora = LoraMerger({}, [], scale)
        elif not math.isclose(scale, self._lora.scale):
            raise ValueError(f"LoRA weight sync: adapters scale by {scale}, earlier updates by {self._lora.scale}")
        merger, params = self._lora, dict(self.model.named_parameters(remove_duplicate=False))

        def with_base_read(items):  # lazily: the sender's bucket views are valid only until the next bucket
            for name, t in items:
                w = base_name(name)  # W0 is read at its first adapter, before a merged weight is written over it
                if w not in merger.w0:
                    if w not in params:
                        raise ValueError(f"LoRA weight sync: the engine's model has no base weight {w!r}")
                    merger.w0[w] = params[w].detach().clone()
                yield name, t

        self.load_weights(merger.merge(with_base_read(adapters)))

    def finish_weight_update(self) -> None:
        """Assert every adapter of a LoRA update found its pair."""
        if self._lora is not None:
            self._lora.check_done()

    # ---- scheduling ------------------------------------------------------------------------
    def _admit(self, done: list[Completion]) -> None:
        admitted: list[_Seq] = []
        budget = self.runner.cache.num_free_blocks if self._paged else 0
        prompts: set[tuple[int, ...]] = set()  # admitted this round: a repeat shares their whole prompt blocks
        while self._waiting and self._free:
            req = self._waiting[0]
            if self._paged:  # wait (FIFO) while the pool is short of this request's blocks
                key = tuple(req.prompt_ids)
                shared = len(key) if self.share_prefill and key in prompts else 0
                need = self.runner.cache.blocks_for(self._reserve_len(req), shared)
                if need > budget:
                    break
                budget -= need
                prompts.add(key)
            self._waiting.popleft()
            self._free.sort()
            slot = self._free.pop(0)
            s = req.sampling
            seed = s.seed if s.seed is not None else self._rng.getrandbits(63)
            stop = set(s.stop_token_ids) | (set() if s.ignore_eos else set(self._eos_ids))
            admitted.append(_Seq(req=req, slot=slot, seed=seed, stop_ids=frozenset(stop)))
        if not admitted:
            return
        # identical prompts end up adjacent, so a group shares one chunk (and one prefill)
        admitted.sort(key=lambda q: (len(q.req.prompt_ids), tuple(q.req.prompt_ids)))
        chunk: list[_Seq] = []
        num_unique = 0
        for q in admitted:
            t = len(q.req.prompt_ids)
            new = not (self.share_prefill and chunk and chunk[-1].req.prompt_ids == q.req.prompt_ids)
            if new and chunk and (num_unique + 1) * t > self.prefill_tokens:
                self._prefill(chunk, done)
                chunk, num_unique = [], 0
            chunk.append(q)
            num_unique += new
        self._prefill(chunk, done)

    def _prefill(self, seqs: list[_Seq], done: list[Completion]) -> None:
        """Prefill ``seqs`` (sorted so that identical prompts are adjacent), sample their first tokens."""
        leaders: list[_Seq] = []  # one per distinct prompt
        row = []  # seqs[i]'s row among the leaders
        for q in seqs:
            if not (self.share_prefill and leaders and leaders[-1].req.prompt_ids == q.req.prompt_ids):
                leaders.append(q)
            row.append(len(leaders) - 1)
        t = max(len(q.req.prompt_ids) for q in leaders)
        ids = torch.zeros(len(leaders), t, dtype=torch.long)
        for i, q in enumerate(leaders):
            ids[i, : len(q.req.prompt_ids)] = torch.tensor(q.req.prompt_ids)
        cache = self.runner.cache
        if cache is not None:
            for q, r in zip(seqs, row):  # a leader precedes the seqs that share its prompt
                shared = 0 if q is leaders[r] else len(q.req.prompt_ids)
                cache.reserve(q.slot, self._reserve_len(q.req), leaders[r].slot, shared)
            cache.sync()
        self.num_prefill_tokens += sum(len(q.req.prompt_ids) for q in leaders)
        self.num_prompt_tokens += sum(len(q.req.prompt_ids) for q in seqs)
        logits = self._run_prefill(ids, [q.slot for q in leaders], [len(q.req.prompt_ids) - 1 for q in leaders])
        if len(leaders) < len(seqs):
            self._copy_shared_prompts(seqs, [leaders[r] for r in row])
            logits = logits[torch.tensor(row, device=self.device)]
        slots = torch.tensor([q.slot for q in seqs]).to(self.device)
        lens = torch.tensor([len(q.req.prompt_ids) for q in seqs]).to(self.device)
        st = self._sampling_tensors(seqs)
        tokens, logprobs = self._sample(logits, *self._flat(st))
        # the slots' decode state: next input token, its position, sampling params, next step index
        self._ids[slots] = tokens
        self._pos[slots] = lens
        self._steps[slots] = 1
        self._seeds[slots], self._top_k[slots] = st.seeds_B, st.top_k_B
        self._floats[:, slots] = torch.stack([st.temperature_B, st.top_p_B, st.min_p_B])
        both = torch.stack([tokens.double(), logprobs.double()]).cpu()  # prefill's one device->host sync
        for q in seqs:
            self._running[q.slot] = q
            q.num_launched = 1
        self._record(seqs, both[0].long().tolist(), both[1].tolist(), done)

    def _run_prefill(self, ids_BT: torch.Tensor, slots: list[int], last: list[int]) -> torch.Tensor:
        """``runner.prefill`` of CPU ids [B, T] into ``slots``: logits [B, V] at ``last``. On CUDA with graphs (slot
        cache: the paged cache's prefill graphs have not run on a GPU yet), a batch of up to
        ``PREFILL_GRAPH_MAX_TOKENS`` padded tokens replays the graph of its (row, length) bucket, captured on first
        use (``pad_prefill`` states the padding); the logits are then a view of the graphs' shared output buffer,
        valid until the next prefill (the caller samples from them at once)."""
        b, t = ids_BT.shape
        if self.use_graphs and not self._paged:
            rows, length = pick_bucket(self.batch_buckets, b), pick_bucket(self.prefill_len_buckets, t)
            if rows * length <= PREFILL_GRAPH_MAX_TOKENS:
                padded = pad_prefill(ids_BT, slots, last, rows, length)
                if (rows, length) not in self._prefill_graphs:
                    self._prefill_graphs[(rows, length)] = self._capture_prefill(padded)
                graph, static = self._prefill_graphs[(rows, length)]
                for dst, src in zip(static, padded, strict=True):
                    dst.copy_(src, non_blocking=True)
                graph.replay()
                return self._prefill_logits[:b]
        dev = self.device
        return self.runner.prefill(ids_BT.to(dev), torch.tensor(slots).to(dev), torch.tensor(last).to(dev))

    def _capture_prefill(self, padded: tuple) -> tuple[torch.cuda.CUDAGraph, tuple]:
        """Capture ``runner.prefill`` at ``padded``'s shapes, writing its logits into the shared buffer. Its static
        inputs hold this batch's real values first, so the eager warm-up run writes only the slots being prefilled."""
        static = tuple(t.to(self.device) for t in padded)
        if self._prefill_logits is None:  # the runner's logits are fp32 (runner._lm_head)
            self._prefill_logits = torch.empty(
                self.max_batch_size, self.vocab_size, device=self.device, dtype=torch.float32
            )
        out = self._prefill_logits[: len(static[1])]
        return self._capture_graph(lambda: out.copy_(self.runner.prefill(*static)), warmups=1), static

    def _capture_graph(self, fn, warmups: int) -> torch.cuda.CUDAGraph:
        """Run ``fn`` ``warmups`` times on a side stream (compiles, cuBLAS / SDPA workspaces, allocator first use),
        then capture it into a CUDA graph in the engine's one memory pool (decode and prefill graphs share it: they
        never run at the same time, and what outlives a replay lives in buffers allocated outside the pool)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        return graph

    def _copy_shared_prompts(self, seqs: list[_Seq], leader_of: list[_Seq]) -> None:
        """Copy each leader's prompt K/V (all layers) into the slots of the seqs that share it (paged: only the
        prompt's partial last block; the whole ones are already the leader's)."""
        by_len: dict[int, tuple[list[int], list[int]]] = {}
        for q, lead in zip(seqs, leader_of):
            if q is not lead:
                src, dst = by_len.setdefault(len(q.req.prompt_ids), ([], []))
                src.append(lead.slot)
                dst.append(q.slot)
        for t, (src, dst) in by_len.items():
            self.runner.cache.copy_prefix(src, dst, t)

    @staticmethod
    def _flat(st: SamplingTensors) -> tuple:
        return (
            st.temperature_B,
            st.top_k_B,
            st.top_p_B,
            st.min_p_B,
            st.seeds_B,
            st.steps_B,
            st.needs_sort,
            st.needs_min_p,
        )

    def _room(self, q: _Seq) -> int:
        """Tokens ``q`` may still be launched: up to its max_tokens and the cache length."""
        return min(q.req.sampling.max_tokens, self.max_model_len - len(q.req.prompt_ids)) - q.num_launched

    def _needs_more(self, q: _Seq) -> bool:
        """Can ``q`` still need a token beyond those launched (as far as the host knows now)?"""
        return not q.finished and self._room(q) > 0

    def _steps_for(self, seqs: list[_Seq], nb: int) -> int:
        """Decode steps the next launch runs: ``self.decode_steps`` while nothing waits for admission, the row bucket
        is small (``MULTI_STEP_MAX_ROWS``) and every row may take that many more tokens (max_tokens, the cache
        length), else 1."""
        k = self.decode_steps
        if k == 1 or nb > MULTI_STEP_MAX_ROWS or self._waiting:
            return 1
        return k if min(self._room(q) for q in seqs) >= k else 1

    def _launch_decode(self) -> tuple[list[_Seq], torch.Tensor, torch.cuda.Event | None, int] | None:
        """Launch the next decode step (or ``_steps_for`` steps) for the running sequences that may need a token; no
        host sync."""
        seqs = [q for q in self._running.values() if self._needs_more(q)]
        if not seqs:
            return None
        if self.runner.cache is not None:
            self.runner.cache.sync()  # released slots' table rows back to scratch before their rows decode again
        nb = pick_bucket(self.batch_buckets, max(q.slot for q in seqs) + 1)
        max_pos = max(len(q.req.prompt_ids) + q.num_launched - 1 for q in seqs)
        k = self._steps_for(seqs, nb)
        kv_len = pick_bucket(self.len_buckets, max_pos + k)  # the launch's last step attends max_pos + k positions
        sp = [q.req.sampling for q in seqs]
        needs_sort = any(s.temperature > 0 and (s.top_k > 0 or s.top_p < 1.0) for s in sp)
        needs_min_p = any(s.temperature > 0 and s.min_p > 0 for s in sp)
        key = (nb, kv_len, needs_sort, needs_min_p, k)
        if not self.use_graphs:
            self._decode_step(*key)
        else:
            if key not in self._graphs:
                self._graphs[key] = self._capture(*key)
            self._graphs[key].replay()
        for q in seqs:
            q.num_launched += k
        host = self._host_out[self._num_launches % 2]
        self._num_launches += 1
        host[:k, :, :nb].copy_(self._out[:k, :, :nb], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return seqs, host, event, k

    def _decode_step(self, nb: int, kv_len: int, needs_sort: bool, needs_min_p: bool, k: int = 1) -> None:
        """``k`` decodes of slots 0..nb-1 from and into the device state, step i's output in ``self._out[i]``;
        graph-capturable (no host sync)."""
        for i in range(k):
            self._decode_one(nb, kv_len, needs_sort, needs_min_p, self._out[i, :, :nb])

    def _decode_one(self, nb: int, kv_len: int, needs_sort: bool, needs_min_p: bool, out_2B: torch.Tensor) -> None:
        ids, pos = self._ids[:nb], self._pos[:nb]
        f = self._floats[:, :nb]
        if nb <= self._head_rows and not (needs_sort or needs_min_p):
            h = self.runner.decode(ids, pos, kv_len, head=False)
            w = self.runner.adapter.lm_head_weight()
            tokens, logprobs = torch.ops.prime_spmd.gumbel_sample_lm_head(
                h, w, f[0], self._seeds[:nb], self._steps[:nb]
            )
        else:
            logits = self.runner.decode(ids, pos, kv_len)
            tokens, logprobs = self._sample(
                logits, f[0], self._top_k[:nb], f[1], f[2], self._seeds[:nb], self._steps[:nb], needs_sort, needs_min_p
            )
        self._advance(ids, pos, self._steps[:nb], out_2B, tokens, logprobs, self.max_model_len - 1)

    def _capture(self, nb: int, kv_len: int, needs_sort: bool, needs_min_p: bool, k: int) -> torch.cuda.CUDAGraph:
        """Capture one launch (``k`` decode steps); the graphs share one memory pool. Warm-up runs (compiles,
        allocator, cuBLAS workspaces) advance the device state, so it is saved and restored; the
        K/V they write past each sequence's position are overwritten before they are attended."""
        saved = [t.clone() for t in (self._ids, self._pos, self._steps)]
        graph = self._capture_graph(lambda: self._decode_step(nb, kv_len, needs_sort, needs_min_p, k), warmups=2)
        for t, v in zip((self._ids, self._pos, self._steps), saved):  # (the capture itself ran nothing)
            t.copy_(v)
        return graph

    def _collect(
        self, pending: tuple[list[_Seq], torch.Tensor, torch.cuda.Event | None, int], done: list[Completion]
    ) -> None:
        seqs, host, event, k = pending
        if event is not None:
            event.synchronize()  # the launch's one wait, a launch after it
        # one tolist per launch, not two tensor indexings per row: 482 -> 49 us a step at 64 rows on
        # the 2-core dev VM (1.79 ms -> 31 us at 256), host time that must stay under the GPU's step
        for tok_S, lp_S in host[:k].tolist():
            live = [q for q in seqs if not q.finished]  # a row that stopped drops the launch's later tokens
            self._record(live, [int(tok_S[q.slot]) for q in live], [lp_S[q.slot] for q in live], done)

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

    def _record(self, seqs: list[_Seq], tok_list: list[int], lp_list: list[float], done: list[Completion]) -> None:
        self.num_generated_tokens += len(seqs)
        for q, tok, lp in zip(seqs, tok_list, lp_list):
            q.tokens.append(tok)
            q.logprobs.append(lp)
            reason = self._finish_reason(q, tok)
            if reason is not None:
                q.finished = True
                del self._running[q.slot]
                if self.runner.cache is not None:
                    self.runner.cache.release(q.slot)
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
