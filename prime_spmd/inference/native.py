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

import math
from collections.abc import Iterable

import torch

from prime_spmd.inference import exact as exact_mode
from prime_spmd.inference.engine import Completion, InferenceEngine, Request
from prime_spmd.inference.graphs import PREFILL_GRAPH_MAX_TOKENS, GraphPool, PrefillGraphs
from prime_spmd.inference.kv_cache import PagedKVCache, bucket_sizes, pick_bucket
from prime_spmd.inference.runner import DecodeAttention, DecodeLinear, KVCacheKind, build_runner
from prime_spmd.inference.sampling import Sampler, SamplingTensors, make_sampler, resolve_sampler
from prime_spmd.inference.scheduler import Scheduler, Seq
from prime_spmd.kernels.decode_glue.reference import advance_reference as advance_decode_state
from prime_spmd.models.common.moe import moe_graph_safe
from prime_spmd.models.lora import LoraMerger, base_name
from prime_spmd.models.registry import adapter_for
from prime_spmd.models.vision import no_image_support

PREFILL_MIN_LEN = 16  # the shortest prefill length bucket (powers of two up to max_model_len)
MULTI_STEP_MAX_ROWS = 16
"""Row buckets up to this size may run several decode steps a launch (``decode_steps_per_launch``): there the gap
between two graph replays (~16 us on an H100, docs/inference.md) is >= 1% of a step; larger steps run one a launch
(fewer graphs to capture at warm-up)."""
AUTO_DECODE_STEPS = 4
"""``decode_steps_per_launch`` 0 (auto): this many with CUDA graphs, else 1."""


class NativeEngine(InferenceEngine):
    """Continuous-batching engine over ``model`` (an HF causal LM or a model with its own runner).

    ``model`` is used in place (its parameters are read at every forward). ``dtype`` casts the
    model once at construction (None keeps it). ``decode_attention``: "bmm" (batched matmuls over
    the length bucket), "triton" (the flash-decoding kernel, kernels/decode_attention), "triton_qkv"
    (that kernel with the q/k norm, RoPE and cache write folded in) or "auto" (triton_qkv on CUDA, bmm elsewhere); ``decode_linear``: "torch", "triton" (fused norm / GEMM / epilogue
    kernels, kernels/decode_linear) or "auto" (triton on CUDA for hidden size <= 1024, else torch); both
    used by the Llama-style runner. ``sampler``: "torch", "triton" (kernels/gumbel_sample for plain sampling),
    "triton_lm_head" (as triton, and decode steps of <= 64 rows sample inside the LM head) or "auto" (that on CUDA, torch
    elsewhere: ``sampling.resolve_sampler``). ``kv_cache``: "slot" (a whole ``max_model_len`` slot per sequence) or "paged"
    (blocks of ``kv_block_size`` positions from a pool of ``kv_cache_tokens`` tokens, 0: as many as the slots
    hold; a sequence takes the blocks of its prompt + max_tokens, a group's samples share their prompt's blocks,
    and admission waits while the pool is short). ``pdl``: launch the decode step's Triton kernels (decode linears,
    the triton_qkv attention) with programmatic dependent launch (kernels/pdl; CUDA, process-wide; ``self.pdl`` says
    whether it is on). ``prefill_layer_fn``: prefill through one pure layer function (packed QKV / gate-up weights, compiled
    on CUDA) instead of the model's modules (dense Llama-style models; None: on CUDA). ``quantization``: "fp8" decodes and
    prefills from FP8 copies of the layer weights, quantized again by each ``load_weights`` (quant.py).
    ``kv_cache_dtype``: "fp8" stores K/V in float8 e4m3 with a scale per (position, kv head) (kv_cache.py), "auto" in
    the model dtype. ``exact``
    (``--model.exact``): prefill, decode and the sampled tokens' logprobs run the batch-invariant kernels the trainer
    runs (inference/exact.py), bit-equal to its logprobs; unfiltered sampling only. Call every method from one thread.
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
        prefill_layer_fn: bool | None = None,
        decode_steps_per_launch: int = 0,
        quantization: str = "none",
        lora_base: dict[str, torch.Tensor] | None = None,
        exact: bool = False,
        kv_cache_dtype: str = "auto",
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
            prefill_layer_fn=prefill_layer_fn,
            quantization=quantization,
            exact=exact,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.exact = exact
        self.vocab_size = self.runner.vocab_size
        self.batch_buckets = bucket_sizes(max_batch_size, 1, "pow2")
        self.len_buckets = bucket_sizes(max_model_len, min(256, max_model_len), "linear")
        # MoE: graphs where every expert dispatch stays on the device (our MoEBlock on the triton kernel;
        # not transformers' expert loop, which reads the routed ids on the host)
        self.use_graphs = (
            cuda_graphs and device.type == "cuda" and self.runner.cache is not None and moe_graph_safe(self.model)
        )
        self._vision = hasattr(self.runner, "set_vision")  # images in prompts: eager prefill (vision_kv_runner.py)
        if self._vision:  # decode graphs where decode is the fused text layer (dense Qwen3-VL), not transformers' MoE
            self.use_graphs = self.use_graphs and self.runner.layer_args is not None
        # the torch sampler is ~30 elementwise/reduction passes over [B, V]; compiled (CUDA only) a few
        self.sampler = resolve_sampler(sampler, device)
        self._sample = make_sampler(self.sampler, compile_sampler and device.type == "cuda")
        if getattr(self.runner, "glue", False):  # the Triton decode path: one launch (kernels/decode_glue)
            from prime_spmd.kernels.decode_glue.kernel import advance

            self._advance = advance
        else:
            self._advance = torch.compile(advance_decode_state) if self.use_graphs else advance_decode_state
        # "triton_lm_head": decode steps of few rows sample inside the LM head (kernels/gumbel_sample), logits never written
        self._head_rows = 0
        if self.sampler == "triton_lm_head" and self.runner.cache is not None:
            from prime_spmd.kernels.gumbel_sample.kernel import LM_HEAD_MAX_ROWS

            self._head_rows = LM_HEAD_MAX_ROWS
        if exact:  # the sampler picks tokens; their logprobs come from the trainer's log-softmax kernel (exact.py)
            self._sample, self._head_rows = exact_mode.exact_sampler(self._sample), 0
        # decode steps one launch (graph replay) may run: each launch's host work and the gap between two replays
        # are paid once for k tokens; a launch takes k > 1 only while nothing waits for admission and every row has
        # room for k more tokens (a row that stops early discards the rest of its launch's tokens, as it does today
        # with the step launched before the host saw its stop)
        self.decode_steps = decode_steps_per_launch or (AUTO_DECODE_STEPS if self.use_graphs else 1)
        self._graphs: dict[tuple[int, int, bool, bool, int], torch.cuda.CUDAGraph] = {}
        self._graph_pool = GraphPool(device)
        self._prefill_graphs = PrefillGraphs(self._graph_pool, self.runner.prefill, max_batch_size, self.vocab_size)
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
        self._pending: tuple[list[Seq], torch.Tensor, torch.cuda.Event | None, int] | None = None
        self._paged = isinstance(self.runner.cache, PagedKVCache)
        # requests admitted together with identical prompts (a GRPO group) prefill once; the other
        # slots get a copy of the prompt's K/V (slot cache) or point at its blocks (paged cache)
        cache = self.runner.cache
        self.sched = Scheduler(
            num_slots=max_batch_size,
            max_model_len=max_model_len,
            prefill_tokens=self.prefill_tokens,
            share_prompts=share_prefill and cache is not None,
            tokenizer=tokenizer,
            seed=seed,
            blocks=cache if self._paged else None,
            release=cache.release if cache is not None else (lambda slot: None),
        )
        self.num_prefill_tokens = 0
        """Prompt tokens run through the model (shared prompts counted once)."""
        self.num_prompt_tokens = 0
        """Prompt tokens admitted."""
        self._lora: LoraMerger | None = None
        """LoRA weight updates: the base weights and pending adapters (``load_lora_weights``)."""
        self._lora_base = lora_base or {}
        """Colocated: the trainer's frozen W0 of each adapted weight, merged into in place of a clone of ours."""
        self._released = False
        """Whether the KV tensors' memory is released (``release_memory``) until the next ``step``."""

    # ---- interface -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if self.exact:
            exact_mode.check_sampling(request)
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError(f"request {request.request_id!r}: empty prompt_ids")
        if n >= self.max_model_len:
            images = (
                "" if request.vision is None else f", {sum(request.vision.tokens_per_image())} of them image tokens"
            )
            raise ValueError(
                f"request {request.request_id!r}: prompt of {n} tokens{images} does not fit --inference.max_model_len="
                f"{self.max_model_len} (need at least one free position to generate)"
            )
        if self._vision:  # vision-language models: image tokens and images must agree
            self.runner.check_request(request)
        elif request.vision is not None:
            raise no_image_support(f"request {request.request_id!r}", type(self.model).__name__)
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"request {request.request_id!r}: token ids {bad[:5]} outside vocab [0, {self.vocab_size})"
            )
        if self._paged:
            cache, n = self.runner.cache, self.sched.reserve_len(request)
            need = cache.blocks_for(n)
            if need > cache.num_blocks:
                raise ValueError(
                    f"request {request.request_id!r}: {n} positions (prompt + max_tokens) need {need} KV blocks, "
                    f"the pool has {cache.num_blocks}: raise --inference.native.kv_cache_tokens"
                )
        self.sched.waiting.append(request)

    @property
    def num_generated_tokens(self) -> int:
        return self.sched.num_generated_tokens

    def kv_cache_stats(self) -> dict[str, float]:
        """The KV cache's memory (``SlotKVCache.stats`` / ``PagedKVCache.stats``); empty without a cache."""
        return self.runner.cache.stats() if self.runner.cache is not None else {}

    def graph_stats(self) -> dict[str, float]:
        """CUDA graphs captured so far and the host seconds their captures took (warm-ups and their compiles
        included): the share of a first generation that a warm compile cache cannot save. Zeros without graphs."""
        pool = self._graph_pool
        return {"engine_graphs_captured": float(pool.captures), "engine_capture_s": pool.capture_s}

    def has_unfinished(self) -> bool:
        return bool(self.sched.waiting or self.sched.running or self._pending)

    def release_memory(self) -> int:
        """Free the KV cache's device memory until the next generation (colocated, ``--inference.native.
        release_kv_cache``: while the trainer steps, it can use it). Only between generations (nothing admitted or
        running). The cache's tensors are dropped with the CUDA graphs that hold their addresses; the next ``step``
        allocates them anew, zeroed, and graphs are recaptured as buckets come up. Returns the bytes released."""
        cache = self.runner.cache
        if cache is None or self._released:
            return 0
        assert not self.has_unfinished(), "release_memory with requests in flight"
        freed = cache.nbytes_allocated()
        self._released = True
        cache.free()
        self._graphs.clear()
        self._graph_pool.new_pool()
        self._prefill_graphs = PrefillGraphs(
            self._graph_pool, self.runner.prefill, self.max_batch_size, self.vocab_size
        )
        return freed

    def _restore_memory(self) -> None:
        # zeroed as built: positions past a row's length are read (and masked) by the bucketed attention
        self.runner.cache.allocate()
        self._released = False

    @torch.no_grad()  # a caller may have grad on (a new thread, the async driver): no autograd graph, none captured
    def step(self) -> list[Completion]:
        if self._released:
            self._restore_memory()
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
        # rows outer, lengths inner: the compiled layer (automatic dynamic shapes) sees the length change before the
        # rows do, so every row range (1 / the fused kernels' bounds) compiles once with the length dynamic. Lengths
        # outer compiled each row range at the first length, then again at the second: 8 decode graphs in a 43 s
        # cold warm-up on the H100 (0.6B, 65 variants, 002d098) where 5 serve
        keys = [(nb, kv, False, False, 1) for nb in self.batch_buckets for kv in self.len_buckets if kv <= top]
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
        MoE weights into the slices of a model that stacks its experts, ``prime_spmd.models.qwen3``). With
        ``--inference.quantization fp8`` the FP8 copies of the weights written are quantized again (quant.py)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        adapter = adapter_for(self.model)
        written = []
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
            written.append(p)
        fp8 = getattr(self.runner, "fp8", None)
        if fp8 is not None:
            fp8.requantize(written)
        self.reset_cache()

    @torch.no_grad()
    def load_lora_weights(self, adapters: Iterable[tuple[str, torch.Tensor]], scale: float) -> None:
        """Merge each (A, B) pair into its base weight, W0 + scale * B @ A, and load it (``load_weights``). W0 is the
        weight the model held when its adapters first arrived (the one it loaded from disk), kept for every later
        update; colocated with a LoRA trainer, the trainer's frozen W0 itself (``lora_base``: no copy)."""
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
                    shared = self._lora_base.get(w)
                    merger.w0[w] = shared if shared is not None else params[w].detach().clone()
                yield name, t

        self.load_weights(merger.merge(with_base_read(adapters)))

    def finish_weight_update(self) -> None:
        """Assert every adapter of a LoRA update found its pair."""
        if self._lora is not None:
            self._lora.check_done()

    # ---- scheduling ------------------------------------------------------------------------
    def _admit(self, done: list[Completion]) -> None:
        for chunk in self.sched.admit():
            self._prefill(chunk, done)

    def _prefill(self, seqs: list[Seq], done: list[Completion]) -> None:
        """Prefill ``seqs`` (sorted so that identical prompts are adjacent), sample their first tokens."""
        leaders, row = self.sched.leaders(seqs)  # one per distinct prompt; seqs[i]'s row among them
        t = max(len(q.req.prompt_ids) for q in leaders)
        ids = torch.zeros(len(leaders), t, dtype=torch.long)
        for i, q in enumerate(leaders):
            ids[i, : len(q.req.prompt_ids)] = torch.tensor(q.req.prompt_ids)
        cache = self.runner.cache
        if cache is not None:
            for q, r in zip(seqs, row):  # a leader precedes the seqs that share its prompt
                shared = 0 if q is leaders[r] else len(q.req.prompt_ids)
                cache.reserve(q.slot, self.sched.reserve_len(q.req), leaders[r].slot, shared)
            cache.sync()
        self.num_prefill_tokens += sum(len(q.req.prompt_ids) for q in leaders)
        self.num_prompt_tokens += sum(len(q.req.prompt_ids) for q in seqs)
        if self._vision:  # vision-language models: each prompt's images (vision_kv_runner.py)
            for q in leaders:
                self.runner.set_vision(q.slot, q.req.vision)
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
        self.sched.start(seqs)
        done += self.sched.record(seqs, both[0].long().tolist(), both[1].tolist())

    def _run_prefill(self, ids_BT: torch.Tensor, slots: list[int], last: list[int]) -> torch.Tensor:
        """``runner.prefill`` of CPU ids [B, T] into ``slots``: logits [B, V] at ``last``. On CUDA with graphs (slot
        cache: the paged cache's prefill graphs have not run on a GPU yet; not with images), a batch of up to
        ``PREFILL_GRAPH_MAX_TOKENS`` padded tokens replays the graph of its (row, length) bucket (``PrefillGraphs``);
        the logits are then valid until the next prefill (the caller samples from them at once)."""
        b, t = ids_BT.shape
        if self.use_graphs and not self._paged and not self._vision:
            rows, length = pick_bucket(self.batch_buckets, b), pick_bucket(self.prefill_len_buckets, t)
            if rows * length <= PREFILL_GRAPH_MAX_TOKENS:
                return self._prefill_graphs.run(ids_BT, slots, last, rows, length)
        dev = self.device
        return self.runner.prefill(ids_BT.to(dev), torch.tensor(slots).to(dev), torch.tensor(last).to(dev))

    def _copy_shared_prompts(self, seqs: list[Seq], leader_of: list[Seq]) -> None:
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

    def _steps_for(self, seqs: list[Seq], nb: int) -> int:
        """Decode steps the next launch runs: ``self.decode_steps`` while nothing waits for admission, the row bucket
        is small (``MULTI_STEP_MAX_ROWS``) and every row may take that many more tokens (max_tokens, the cache
        length), else 1."""
        k = self.decode_steps
        if k == 1 or nb > MULTI_STEP_MAX_ROWS or self.sched.waiting:
            return 1
        return k if min(self.sched.room(q) for q in seqs) >= k else 1

    def _launch_decode(self) -> tuple[list[Seq], torch.Tensor, torch.cuda.Event | None, int] | None:
        """Launch the next decode step (or ``_steps_for`` steps) for the running sequences that may need a token; no
        host sync."""
        seqs = self.sched.to_decode()
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
        graph = self._graph_pool.capture(lambda: self._decode_step(nb, kv_len, needs_sort, needs_min_p, k), warmups=2)
        for t, v in zip((self._ids, self._pos, self._steps), saved):  # (the capture itself ran nothing)
            t.copy_(v)
        return graph

    def _collect(
        self, pending: tuple[list[Seq], torch.Tensor, torch.cuda.Event | None, int], done: list[Completion]
    ) -> None:
        seqs, host, event, k = pending
        if event is not None:
            event.synchronize()  # the launch's one wait, a launch after it
        # one tolist per launch, not two tensor indexings per row: 482 -> 49 us a step at 64 rows on
        # the 2-core dev VM (1.79 ms -> 31 us at 256), host time that must stay under the GPU's step
        for tok_S, lp_S in host[:k].tolist():
            live = [q for q in seqs if not q.finished]  # a row that stopped drops the launch's later tokens
            done += self.sched.record(live, [int(tok_S[q.slot]) for q in live], [lp_S[q.slot] for q in live])

    def _sampling_tensors(self, seqs: list[Seq]) -> SamplingTensors:
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
