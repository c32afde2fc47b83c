"""Device-memory plan of a colocated run (trainer and engine on one device), before anything is allocated.

``estimate`` adds up what each part of a run holds at its peak, from the model's config alone (a meta-device
instance counts the parameters): the trainer's weights, gradients and AdamW moments (host-resident under
``--trainer.offload optimizer``), the engine's copy of the weights (its fused QKV / gate-up tensors re-point the
modules' weights, no second copy) and, with ``--inference.quantization fp8``, its FP8 copies of the layer linears
(never shared with the trainer: ``fp8_weight_bytes``), the KV cache (``kv_bytes_per_token``: half
the bytes, plus fp32 scales, under ``--inference.kv_cache_dtype fp8``), and the trainer's activations. ``check_fits`` compares the plan with the device's memory and refuses a run
that cannot fit, printing the parts and the flags that would make it fit. ``phase`` names the phase (generate,
train, sync) of an out-of-memory error raised inside it, with the same flags, instead of a bare CUDA trace.

The activation term is an estimate (per trained token: the layer inputs kept for backward, or one block's
internals under activation checkpointing, with the fused LM-head loss never writing logits); docs/memory.md
compares the plan with measured peaks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotation only
    from prime_spmd.config import RLJobConfig

GIB = 1 << 30
FIT_FLAGS = (
    "--trainer.offload optimizer (AdamW moments in host memory: 8 bytes a trained parameter off the device)",
    "--trainer.offload master (one trainer rank, full fine-tuning: fp32 masters and moments in host memory, the engine "
    "reads the trainer's bf16 weights: 2 bytes a parameter held, plus 4 of fp32 gradients while the trainer steps)",
    "--model.lora.rank 16 (train adapters; the frozen base is held once, in bf16)",
    "--inference.native.kv_cache paged --inference.native.kv_cache_tokens N (a smaller KV pool; admission waits for blocks)",
    "--inference.max_batch_size N (fewer sequences decoding at once)",
    "--trainer.micro_batch_tokens N and --trainer.activation_checkpointing (fewer activations)",
)


OFFLOAD_STAGING_BYTES = 2 * (256 << 20)
"""Device staging of ``--trainer.offload optimizer`` / ``master``: two chunks of host state (moments, and masters)
(``trainer/offload.py`` ``HostOffloadAdamW``, ``chunk_bytes`` 256 MiB; a parameter larger than a chunk spans several),
kept between steps.
memory sits below the trainer: a test holds this equal to the optimizer's default."""

KV_SCALE_BYTES = 4
"""Bytes of one fp32 scale: one per (position, kv head) for K and one for V under ``fp8``."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, model_bytes: int, kv_dtype: str) -> int:
    """Bytes of K+V one token takes in every layer: ``model_bytes`` an element (``auto``) or one byte an element plus
    an fp32 scale per kv head (``fp8``). ``estimate`` and the caches' ``nbytes_per_token`` (``inference/kv_cache.py``) use
    it."""
    if kv_dtype == "fp8":
        return 2 * num_layers * num_kv_heads * (head_dim + KV_SCALE_BYTES)
    return 2 * num_layers * num_kv_heads * head_dim * model_bytes


@dataclass(kw_only=True, slots=True)
class ModelShape:
    """What the plan needs to know about the model (from its config; see ``model_shape``)."""

    num_params: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_heads: int = 0
    moe: bool = False
    """Stacked MoE experts in every layer (no dense MLP to adapt)."""
    vision: bool = False
    """A vision-language model (a vision tower beside the text model; transformers' model code)."""


VISION_ACTIVATION_FACTOR = 2
"""Activations of a vision-language model's train step over the text-layer count below: transformers' model code
keeps fp32 norm and rotary intermediates and the vision tower's activations. Measured once: a Qwen3-VL-2B RL step on
the H100 (8,192-token micro-batches, one 448px image a prompt, no activation checkpointing) ran out of memory at ~37
GiB of activations against the 21 GiB of the text-layer count (4604e6e, 2026-12-06)."""


def block_activation_elements(shape: ModelShape) -> int:
    """Elements one token leaves inside one block for the backward (compute dtype): 5 of the hidden size (norm outputs,
    attention output projection, residual sum), 4 of the query width (projection, normed, rotated, attention output),
    4 of the key/value width (k projection, normed, rotated, v) and 4 of the MLP width (gate, up, SiLU, product).
    Measured on the H100 (Qwen3-0.6B, compiled blocks, colocated RL, 2026-12-06): at 32,768-token micro-batches the
    first train step ran out of memory with ~49.9 GiB of activations allocated (002d098; this count: 52.5 GiB, the
    count before it, 4 of the hidden size and 3 of the MLP width: 24.5); at 8,192 the run's peak was 26.3 GiB
    (4e1f824; the whole plan with this count: ~25.7 GiB, check_fits' headroom covers the rest)."""
    q = query_heads(shape) * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    return 5 * shape.hidden_size + 4 * q + 4 * kv + 4 * shape.intermediate_size


ROW_PAD_ALLOWANCE = 0.25
"""Activations of masked rows past the micro-batch's tokens, as a share of the activation term: shared-prompt and
filled rows (``packing.fill_layout``) pad documents to a row's length. Measured in the learning benchmark's 0.6B RL
(16,384-token micro-batches, groups of 8): on the H100 at 4b65079 (completions of 500-1000 tokens) rows ran
1.01-1.16x the model's tokens; on the H200 at 090adcf (completions of 150-720 tokens) 1.24x at the step that set the
run's peak (62.5 GiB, against a plan of 57.5 with 0.10 here) and up to 1.36x later. 0.25, with the one-rank compute
weights, puts that plan at 62.5 GiB, and the H100 run's 5.4 GiB over its 57.1."""


LM_HEAD_CHUNK_TOKENS = 4096
LM_HEAD_CHUNK_ELEMENTS = 2**30
"""The fused LM-head loss's chunk bounds (``fused_lm_head_loss``'s default ``chunk_tokens`` and
``TRITON_LOGITS_BUFFER_ELEMENTS``; kernels sit above this module, so a test holds the two equal)."""


def lm_head_loss_bytes(shape: ModelShape, micro_batch_tokens: int, param_bytes: int) -> int:
    """The fused LM-head loss's bytes beyond the activations (``kernels/lm_logprob/fused_loss.py``, the Triton path
    CUDA runs): one chunk of up to 4,096 tokens' fp32 logits and compute-dtype d logits (6 B an element of C x V,
    C x V <= 2**30), and the d weight [V, D] and d hidden [T, D] it holds from the forward to the backward. The
    Qwen3-0.6B shape at 16,384 tokens: 3.5 + 0.3 + 0.03 GiB (4b65079, H100: the learning benchmark's plan was 51.1 GiB
    without it and the row padding, against a measured peak of 57.1)."""
    v, d = shape.vocab_size, shape.hidden_size
    chunk = min(LM_HEAD_CHUNK_TOKENS, LM_HEAD_CHUNK_ELEMENTS // v, micro_batch_tokens)  # the loss's chunk, at most
    return chunk * v * (4 + param_bytes) + (v + micro_batch_tokens) * d * param_bytes


def query_heads(shape: ModelShape) -> int:
    """Attention query heads (hidden size / head dim where the config does not say)."""
    return shape.num_heads or shape.hidden_size // shape.head_dim


def query_groups(shape: ModelShape) -> int:
    """Query heads a key/value head serves."""
    return query_heads(shape) // shape.num_kv_heads


@dataclass(kw_only=True, slots=True)
class MemoryPlan:
    parts: dict[str, int] = field(default_factory=dict)
    """Bytes on the device for the whole run, by part."""
    generate: dict[str, int] = field(default_factory=dict)
    """Bytes on the device only while the engine generates (the KV cache, when released while the trainer steps)."""
    train: dict[str, int] = field(default_factory=dict)
    """Bytes on the device only while the trainer steps (gradients, activations)."""
    host: dict[str, int] = field(default_factory=dict)
    """Bytes in host memory, by part (offloaded state)."""
    reduce: dict[str, int] = field(default_factory=dict)
    """Bytes on the device at the train step's gradient reduce, after the backward freed the activations (a
    one-rank trainer: ``estimate``'s ``one_rank``)."""

    @property
    def total(self) -> int:
        """The peak: what stays, plus the largest of the phases (generate, train, the gradient reduce)."""
        phases = (self.generate, self.train, self.reduce)
        return sum(self.parts.values()) + max(sum(d.values()) for d in phases)

    def describe(self) -> str:
        sections = (("", self.parts), (" (generate)", self.generate), (" (train)", self.train),
                    (" (reduce)", self.reduce), (" (host)", self.host))  # fmt: skip
        rows = [f"  {k + tag:<34} {v / GIB:8.2f} GiB" for tag, part in sections for k, v in part.items()]
        return "\n".join(rows + [f"  {'device peak':<34} {self.total / GIB:8.2f} GiB"])


def model_shape(path: str, trust_remote_code: bool = False) -> ModelShape:
    """Count the parameters of the model at ``path`` on the meta device (no weights read, no memory): our own model
    code where it has the type (what the run loads, with no transformers config object: for these types that imports
    transformers' model factory, 2-6 s of start-up on 5.17), else the transformers class."""
    from prime_spmd.models import registry  # here: the plan needs the models only to count their parameters
    from prime_spmd.models.common.meta import on_meta

    mtype = registry.model_type(path)
    if mtype in registry.REGISTRY:
        model = registry.REGISTRY[mtype](path, device="meta", random_init_seed=0)
        text, vision = model.args, False  # the shape our code read from config.json (HF's field names)
    else:
        import transformers

        cfg = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        text = getattr(cfg, "text_config", cfg)
        # a vision-language model (a vision tower beside the text model) has no causal-LM class in every
        # transformers release (5.17 refuses Qwen3-VL there): build it as image-text-to-text, as models/loading.py
        vision = hasattr(cfg, "vision_config")
        auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
        with on_meta():
            model = auto.from_config(cfg, trust_remote_code=trust_remote_code)
    num_params = sum(p.numel() for p in model.parameters())
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", heads)
    return ModelShape(
        num_params=num_params,
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=text.vocab_size,
        num_heads=heads,
        moe=bool(getattr(text, "num_experts", 0)),
        vision=vision,
    )


def estimate(
    shape: ModelShape,
    *,
    num_trainable: int,
    lora: bool,
    num_adapted: int = 0,
    offload: str,
    share_weights: bool,
    kv_cache_tokens: int,
    micro_batch_tokens: int,
    activation_checkpointing: bool,
    release_kv_cache: bool = False,
    param_bytes: int = 2,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    masked_row_tokens: int = 0,
    one_rank: bool = False,
) -> MemoryPlan:
    """Peak device bytes of a colocated run, by part.

    ``num_trainable``: parameters the optimizer updates (all of them for full fine-tuning, or the LoRA adapters). ``lora``: the frozen base is
    held once in the compute dtype (``param_bytes``) and shared with the engine when ``share_weights``, which then
    holds only the ``num_adapted`` weights of the adapted linears, merged.
    ``offload``: "none", "optimizer" (moments on the host) or "master" (masters and moments on the host: the trained
    weights are held once in the compute dtype, shared with the engine when ``share_weights``; fp32 gradients of the
    optimizer's own in the train phase, plus the largest parameter's compute-dtype gradient before its hook takes it;
    no compute copy, no reduce buffer). ``kv_cache_tokens``: tokens the engine's KV cache
    holds; ``release_kv_cache``: it is freed while the trainer steps (else it stays through both phases).
    Gradients exist only in the train phase (``zero_grad(set_to_none=True)`` after each step). ``quantization`` "fp8":
    the native engine also holds FP8 copies of the layer linears (``fp8_weight_bytes``), beside its bf16 weights.
    ``kv_cache_dtype`` "fp8": the KV cache holds one byte an element plus an fp32 scale per position and kv head.
    ``masked_row_tokens`` > 0: attention runs with a mask over rows of up to this many tokens (RL's shared prompts: a
    group's prompt and its samples in one row; filled rows: documents several to a row): one additive mask a
    micro-batch, its rows repeated for the query heads of a key/value head (``param_bytes`` x ``query_groups`` x its
    tokens x the row length; ``models/common/attention.py: additive_mask``), and the rows' padding
    (``ROW_PAD_ALLOWANCE``). Every plan counts the fused LM-head loss's chunk (``lm_head_loss_bytes``).
    ``one_rank``: one trainer rank, whose FSDP2 root holds every parameter (distributed/fsdp.py ``apply_fsdp``): its
    compute copy of the trained weights (``param_bytes`` each) lives through the forward and backward, and the
    step's one gradient reduce copies the fp32 gradients into a buffer of their size (``OneRankReduceScatter``: the
    output is that buffer), after the backward freed the activations: the ``reduce`` phase. (On an H200 at 090adcf,
    before both were counted and before the one buffer, an 8B run the plan put at 112 GiB ran out of memory at the
    reduce.)
    """
    plan = MemoryPlan()
    n, t = shape.num_params, num_trainable
    if lora:
        plan.parts["frozen base weights"] = (n - t) * param_bytes
    if offload == "master":
        _master_offload(plan, shape, t, share_weights, param_bytes)
    else:
        _device_masters(plan, shape, t, lora, offload, share_weights, one_rank, num_adapted, param_bytes)
    if quantization == "fp8":
        plan.parts["engine FP8 weights"] = fp8_weight_bytes(shape)
    kv = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, param_bytes, kv_cache_dtype)
    kv *= kv_cache_tokens
    (plan.generate if release_kv_cache else plan.parts)["KV cache"] = kv
    per_token = shape.num_layers * shape.hidden_size * param_bytes  # each layer's input, kept for backward
    internals = block_activation_elements(shape) * param_bytes
    per_token += internals if activation_checkpointing else shape.num_layers * internals  # one block's, or every one's
    if shape.vision:
        per_token *= VISION_ACTIVATION_FACTOR
    plan.train["activations"] = per_token * micro_batch_tokens
    plan.train["LM-head loss"] = lm_head_loss_bytes(shape, micro_batch_tokens, param_bytes)
    if masked_row_tokens:
        rows = min(masked_row_tokens, micro_batch_tokens)
        plan.train["attention mask"] = param_bytes * query_groups(shape) * micro_batch_tokens * rows
        plan.train["row padding"] = int(ROW_PAD_ALLOWANCE * plan.train["activations"])
    return plan


def _device_masters(
    plan: MemoryPlan,
    shape: ModelShape,
    t: int,
    lora: bool,
    offload: str,
    share_weights: bool,
    one_rank: bool,
    num_adapted: int,
    param_bytes: int,
) -> None:
    """``estimate``'s weights, gradients and optimizer state with fp32 masters on the device (the moments there too,
    or on the host with ``offload`` "optimizer")."""
    plan.parts["trained weights (fp32)"] = t * 4
    plan.train["gradients (fp32)"] = t * 4
    if one_rank:
        if not lora:
            plan.train["compute weights"] = t * param_bytes
        plan.reduce["gradients (fp32)"] = t * 4
        plan.reduce["gradient reduce buffer"] = t * 4
    (plan.host if offload == "optimizer" else plan.parts)["AdamW moments"] = t * 8
    if offload == "optimizer":
        plan.parts["AdamW moment staging"] = OFFLOAD_STAGING_BYTES
    if lora and share_weights:  # the engine reads the frozen base in place; it holds the adapted weights, merged
        plan.parts["engine weights (LoRA-merged)"] = num_adapted * param_bytes
    else:
        plan.parts["engine weights"] = shape.num_params * param_bytes


def _master_offload(plan: MemoryPlan, shape: ModelShape, t: int, share_weights: bool, param_bytes: int) -> None:
    """``estimate``'s weights, gradients and optimizer state under ``--trainer.offload master`` (full fine-tuning, one
    trainer rank: ``trainer/offload.py`` ``HostMasterAdamW``)."""
    plan.parts["trained weights (compute dtype)"] = t * param_bytes
    plan.parts["master + moment staging"] = OFFLOAD_STAGING_BYTES
    plan.train["gradients (fp32)"] = t * 4
    # autograd's compute-dtype gradient of one parameter before the hook adds it in: the embedding's is the largest
    plan.train["gradient before its hook"] = shape.vocab_size * shape.hidden_size * param_bytes
    plan.host["master weights (fp32)"] = t * 4
    plan.host["AdamW moments"] = t * 8
    if not share_weights:
        plan.parts["engine weights"] = shape.num_params * param_bytes


def fp8_weight_bytes(shape: ModelShape) -> int:
    """Bytes of the native engine's FP8 layer weights (inference/quant.py): one byte per weight of every layer's
    q/k/v, o, gate/up and down projections plus an fp32 scale per output row. Dense models only (FP8 refuses MoE)."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = query_heads(shape) * shape.head_dim, shape.num_kv_heads * shape.head_dim
    weights = h * (q + 2 * kv) + q * h + 3 * h * i
    rows = (q + 2 * kv) + h + 2 * i + h
    return shape.num_layers * (weights + 4 * rows)


def check_fits(plan: MemoryPlan, device_bytes: int, *, headroom: float = 0.92) -> None:
    """Raise ValueError when the plan passes ``headroom`` of ``device_bytes``, listing the parts and the flags
    that would make it fit. Called on every rank of a colocated run before the model is loaded."""
    if plan.total <= headroom * device_bytes:
        return
    raise ValueError(
        f"this run needs about {plan.total / GIB:.1f} GiB of device memory and the device has "
        f"{device_bytes / GIB:.1f} GiB ({headroom:.0%} usable):\n{plan.describe()}\n"
        "flags that make a run smaller:\n  " + "\n  ".join(FIT_FLAGS)
    )


@contextlib.contextmanager
def phase(name: str, plan: MemoryPlan | None = None) -> Iterator[None]:
    """Turn a device out-of-memory error raised inside the block into one that names ``name`` (the phase: generate,
    train, weight sync, eval), the plan and the flags that make a run smaller. The last checkpoint stays usable:
    checkpoints are written to a temporary path and renamed (trainer/checkpoint.py)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        used, hint = "", ""
        if torch.cuda.is_available():
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            used = f" (allocated {allocated / GIB:.1f} GiB, peak {torch.cuda.max_memory_allocated() / GIB:.1f} GiB)"
            hint = fragmentation_hint(reserved - allocated, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
        msg = f"out of device memory during {name}{used}"
        if plan is not None:
            msg += f"; the plan for this run:\n{plan.describe()}"
        raise RuntimeError(msg + hint + "\nflags that make a run smaller:\n  " + "\n  ".join(FIT_FLAGS)) from e


def fragmentation_hint(cached_free: int, alloc_conf: str) -> str:
    """A line for an out-of-memory message when the allocator holds ``cached_free`` bytes reserved but unallocated
    (1 GiB or more) and ``alloc_conf`` (PYTORCH_CUDA_ALLOC_CONF) does not enable expandable segments: the memory
    exists but in blocks too small for the request."""
    if cached_free < GIB or "expandable_segments:true" in alloc_conf.replace(" ", "").lower():
        return ""
    return (
        f"\n{cached_free / GIB:.1f} GiB are reserved by the allocator but free (fragmentation): try the environment "
        "variable PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )


def plan_colocated_run(
    model_path: str,
    *,
    trust_remote_code: bool,
    lora_rank: int,
    lora_targets: tuple[str, ...] | list[str] = (),
    offload: str,
    share_weights: bool,
    kv_cache_tokens: int,
    micro_batch_tokens: int,
    activation_checkpointing: bool,
    release_kv_cache: bool,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    masked_row_tokens: int = 0,
    one_rank: bool = False,
) -> MemoryPlan:
    """The plan of a colocated RL run from its settings (``estimate`` with the model's counts). With LoRA, the
    adapted linears are those of ``lora_targets`` among q/k/v/o and the dense MLP's gate/up/down (stacked MoE experts
    are never adapted); each holds rank x (in + out) trainable parameters."""
    shape = model_shape(model_path, trust_remote_code)
    trainable, adapted = shape.num_params, 0
    if lora_rank:
        h, q, kv, i = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, 0
        i = 0 if shape.moe else shape.intermediate_size
        dims = dict(q_proj=(h, q), k_proj=(h, kv), v_proj=(h, kv), o_proj=(q, h), gate_proj=(h, i), up_proj=(h, i),
                    down_proj=(i, h))  # fmt: skip
        chosen = [dims[t] for t in lora_targets if t in dims and min(dims[t]) > 0]
        trainable = lora_rank * sum(a + b for a, b in chosen) * shape.num_layers
        adapted = sum(a * b for a, b in chosen) * shape.num_layers
    return estimate(
        shape,
        num_trainable=trainable,
        lora=bool(lora_rank),
        num_adapted=adapted,
        offload=offload,
        share_weights=share_weights,
        kv_cache_tokens=kv_cache_tokens,
        micro_batch_tokens=micro_batch_tokens,
        activation_checkpointing=activation_checkpointing,
        release_kv_cache=release_kv_cache,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        masked_row_tokens=masked_row_tokens,
        one_rank=one_rank,
    )


def longest_masked_row(cfg: RLJobConfig, max_len: int) -> int:
    """The longest masked row an RL job's trainer may run (``estimate``'s ``masked_row_tokens``): with shared prompts
    a group's prompt and samples in one row; without, documents filled several to a row of the longest one's
    length (``policy.PolicyModel.hidden``); none in exact mode (its own kernels)."""
    if cfg.model.exact:
        return 0
    return cfg.rollout.group_size * max_len if cfg.trainer.share_prompts else max_len


def plan_rl_job(cfg: RLJobConfig, num_trainer_ranks: int) -> MemoryPlan:
    """``plan_colocated_run`` with the settings of a colocated ``rl`` job (``cfg``) of ``num_trainer_ranks``."""
    inf, nat = cfg.inference, cfg.inference.native
    max_len = inf.max_model_len or cfg.trainer.seq_len
    kv_tokens = nat.kv_cache_tokens if nat.kv_cache == "paged" and nat.kv_cache_tokens else inf.max_batch_size * max_len
    return plan_colocated_run(
        cfg.model.path,
        trust_remote_code=cfg.model.trust_remote_code,
        lora_rank=cfg.model.lora.rank,
        lora_targets=cfg.model.lora.target_modules,
        offload=cfg.trainer.offload,
        share_weights=num_trainer_ranks == 1 and inf.engine == "native",
        kv_cache_tokens=kv_tokens,
        micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        activation_checkpointing=cfg.trainer.activation_checkpointing,
        release_kv_cache=nat.release_kv_cache,
        quantization=inf.quantization if inf.engine == "native" else "none",
        kv_cache_dtype=inf.kv_cache_dtype,
        masked_row_tokens=longest_masked_row(cfg, max_len),
        one_rank=num_trainer_ranks == 1,
    )
