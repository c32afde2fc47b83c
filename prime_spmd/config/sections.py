"""Leaf config sections shared by the `sft`, `rl` and `eval` subcommands.

Every field has a one-line docstring (tyro shows it in ``--help``); units are in the names.
Each section validates itself in ``__post_init__`` and names the flag to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


def _check(cond: bool, flag: str, value: object, rule: str) -> None:
    if not cond:
        raise ValueError(f"--{flag}={value!r} is invalid: {rule}")


LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank r of the adapters (0: off, train every weight); with r > 0 only the adapters train (docs/lora.md)."""
    alpha: float = 16.0
    """LoRA alpha: the adapter update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input during training (0: off; RL with dropout > 0 biases the importance ratio)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    """nn.Linear modules to adapt, by name suffix (q_proj matches model.layers.0.self_attn.q_proj); stacked MoE experts are never adapted."""

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "model.lora.rank", self.rank, "must be >= 0 (0: LoRA off)")
        _check(math.isfinite(self.alpha) and self.alpha > 0, "model.lora.alpha", self.alpha, "must be a number > 0")
        _check(0 <= self.dropout < 1, "model.lora.dropout", self.dropout, "must be in [0, 1)")
        targets = list(self.target_modules)
        _check(bool(targets), "model.lora.target_modules", targets, "name at least one linear module, e.g. q_proj")
        bad = [t for t in targets if not t or t != t.strip() or t.startswith(".") or t.endswith(".")]
        _check(
            not bad, "model.lora.target_modules", targets, f"{bad} are not module names (e.g. q_proj, self_attn.o_proj)"
        )
        dupes = sorted({t for t in targets if targets.count(t) > 1})
        _check(not dupes, "model.lora.target_modules", targets, f"{dupes} listed twice")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str = ""
    """Local model directory (HF format) or hub id; with --model.init_tiny set, where the random model is written. Required."""
    tokenizer_path: str = ""
    """Tokenizer directory or hub id; empty means the same as --model.path."""
    impl: Literal["auto", "hf", "custom"] = "auto"
    """Model code: transformers (hf), ours (custom), or custom where the config type is registered (auto)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype for compute: auto is bfloat16 on CUDA and float32 on CPU."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel of HF models."""
    init_tiny: Literal["none", "qwen3-nano", "qwen3-micro", "qwen3-1m", "qwen3-vl-nano"] = "none"
    """Build a random-init tiny Qwen3 + character tokenizer (qwen3-vl-nano: a Qwen3-VL + the Qwen3 tokenizer) at --model.path if it has no model yet."""
    trust_remote_code: bool = False
    """Allow model code from the model directory (transformers trust_remote_code)."""
    router_aux_loss_coef: float | None = None
    """MoE: weight of the router load-balance loss added to the training loss (None: the HF config's router_aux_loss_coef; 0: off)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (off unless --model.lora.rank > 0)."""
    exact: bool = False
    """Exact mode: the trainer's forward and the native engine's prefill/decode run batch-invariant Triton kernels, so each sampled token's logprob equals the trainer's bit for bit (dense Qwen3, --model.impl custom, one device, no LoRA; docs/algorithms.md)."""
    freeze_vision: bool = False
    """Vision-language models: keep the vision tower's weights fixed (only the language model trains)."""
    random_init: bool = False
    """Draw random weights at load instead of reading them (speed and memory runs at big shapes): --model.path holds config.json and the tokenizer, no weights; each weight depends only on --model.random_init_seed and its name, the same on every device and process (our Qwen3 / Qwen3-MoE code, native engine; docs/memory.md)."""
    random_init_seed: int = 0
    """Seed of the weights --model.random_init draws."""

    def __post_init__(self) -> None:
        if self.random_init:
            _check(self.init_tiny == "none", "model.random_init", True, "draws the weights: drop --model.init_tiny")
            _check(self.impl != "hf", "model.random_init", True, "needs our model code: --model.impl auto or custom")
        _check(self.random_init_seed >= 0, "model.random_init_seed", self.random_init_seed, "must be >= 0")
        coef = self.router_aux_loss_coef
        _check(
            coef is None or (math.isfinite(coef) and coef >= 0),
            "model.router_aux_loss_coef",
            coef,
            "must be a finite number >= 0 (0 disables the load-balance loss; unset uses the model config's value)",
        )


@dataclass(kw_only=True, slots=True)
class TopologyConfig:
    mode: Literal["auto", "colocated", "disjoint"] = "auto"
    """colocated: every rank trains and infers; disjoint: separate trainer and inference ranks; auto: colocated for one rank or when num_inference_ranks is 0."""
    num_inference_ranks: int = 0
    """Ranks that run inference engines in disjoint mode (the last ranks of the world); 0 with mode auto means colocated."""
    engine_tp: int = 1
    """Tensor-parallel ranks per inference engine (consecutive ranks, never spanning nodes)."""
    ep: int = 1
    """Expert-parallel degree of the trainer mesh (MoE models); must divide the trainer ranks."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: auto is nccl on CUDA, gloo on CPU."""
    timeout_s: int = 1800
    """Collective timeout: a rank stuck this long in a collective fails the job instead of hanging."""

    def __post_init__(self) -> None:
        _check(self.num_inference_ranks >= 0, "topology.num_inference_ranks", self.num_inference_ranks, "must be >= 0")
        _check(self.engine_tp >= 1, "topology.engine_tp", self.engine_tp, "must be >= 1")
        _check(self.ep >= 1, "topology.ep", self.ep, "must be >= 1")
        _check(self.timeout_s > 0, "topology.timeout_s", self.timeout_s, "must be > 0")
        if self.num_inference_ranks % self.engine_tp:
            raise ValueError(
                f"--topology.num_inference_ranks={self.num_inference_ranks} is not a multiple of "
                f"--topology.engine_tp={self.engine_tp}; use a multiple such as "
                f"{max(self.engine_tp, self.num_inference_ranks // self.engine_tp * self.engine_tp)}"
            )


@dataclass(kw_only=True, slots=True)
class RLTopologyConfig(TopologyConfig):
    bridge_timeout_s: int = 0
    """Timeout of the cross-role bridges (a controller waits there for a whole generation). 0: timeout_s + 1 s per --sampling.max_tokens."""

    def __post_init__(self) -> None:
        TopologyConfig.__post_init__(self)
        _check(self.bridge_timeout_s >= 0, "topology.bridge_timeout_s", self.bridge_timeout_s, "must be >= 0 (0: auto)")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float
    """Peak learning rate (AdamW); each subcommand sets its own default."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warmup from 0 to --optim.lr over this many optimizer steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate shape after warmup."""
    min_lr_ratio: float = 0.1
    """Cosine schedule floor as a fraction of --optim.lr."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        _check(0 <= self.beta1 < 1, "optim.beta1", self.beta1, "must be in [0, 1)")
        _check(0 <= self.beta2 < 1, "optim.beta2", self.beta2, "must be in [0, 1)")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _check(self.max_grad_norm >= 0, "optim.max_grad_norm", self.max_grad_norm, "must be >= 0")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    max_steps: int = 100
    """Optimizer steps to run."""
    micro_batch_tokens: int = 2048
    """Tokens packed into one micro-batch on one rank (forward/backward unit); gradients accumulate over micro-batches. With --trainer.share_prompts (RL) the tokens the model runs, a group's prompt once (and at most twice this many packed tokens)."""
    seq_len: int = 512
    """Longest sequence (prompt + completion) in tokens; longer samples are dropped and counted."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in the backward to save activation memory."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after the forward (ZeRO-3) instead of keeping them for the backward (more than one trainer rank: one rank has no per-block units)."""
    loss_impl: Literal["auto", "reference", "triton", "fused"] = "auto"
    """LM-head logprob/entropy + loss: auto is fused (Triton, gradients in the forward) on CUDA, reference on CPU."""
    seed: int = 0
    """Seed of model init, data order and sampling."""
    num_threads: int = 0
    """torch CPU threads per process (0: torch's default)."""
    max_skipped_steps: int = 5
    """Stop the run after this many optimizer steps in a row were skipped for a non-finite loss or gradient (0: never)."""
    share_prompts: bool = True
    """Forward a prompt shared by documents of a micro-batch (a GRPO group) once, via an attention mask; dense custom Qwen3 only; RL only (SFT packs no share groups and builds its trainer without it)."""
    offload: Literal["none", "optimizer", "master"] = "none"
    """optimizer: AdamW's moments (8 bytes a trained parameter) live in pinned host memory and stream through the device in chunks at each step. master (one trainer rank, full fine-tuning): the fp32 master weights too (12 bytes a parameter on the host); the trained parameters are the compute-dtype (bf16) weights, which a colocated native engine reads in place (no copy at weight sync), and gradients accumulate in fp32 only while the trainer steps (docs/memory.md)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile each transformer block's forward for training (inductor, dynamic shapes): fewer kernels per step. auto: on for our dense model code (--model.impl custom/auto) on CUDA; off on CPU (compiling costs more than it saves at CPU sizes), for MoE and for transformers models."""
    compile_warmup: bool = False
    """With compiled blocks: the first step also compiles every kind of block input a micro-batch can give (one document, several, a packed row under a mask, shared prompts), so no later step recompiles. Off (the default): each kind compiles in the step that first meets it, and a run pays only for the kinds it meets (docs/benchmarks.md, Start-up)."""

    def __post_init__(self) -> None:
        _check(self.max_steps >= 1, "trainer.max_steps", self.max_steps, "must be >= 1")
        _check(self.max_skipped_steps >= 0, "trainer.max_skipped_steps", self.max_skipped_steps, "must be >= 0")
        _check(self.micro_batch_tokens >= 1, "trainer.micro_batch_tokens", self.micro_batch_tokens, "must be >= 1")
        _check(self.seq_len >= 2, "trainer.seq_len", self.seq_len, "must be >= 2")
        _check(
            self.micro_batch_tokens >= self.seq_len,
            "trainer.micro_batch_tokens",
            self.micro_batch_tokens,
            f"must be >= --trainer.seq_len={self.seq_len} so that every sequence fits one micro-batch",
        )


@dataclass(kw_only=True, slots=True)
class SFTTrainerConfig(TrainerConfig):
    batch_size: int = 32
    """Sequences per optimizer step, summed over all trainer ranks."""

    def __post_init__(self) -> None:
        TrainerConfig.__post_init__(self)
        _check(self.batch_size >= 1, "trainer.batch_size", self.batch_size, "must be >= 1")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: Literal["reverse_text", "number_list", "visual", "jsonl", "parquet"] = "reverse_text"
    """reverse_text, number_list, visual (images, vision-language models): built-in seeded generators; jsonl/parquet:
    local file of prompt/completion or messages rows."""
    path: str = ""
    """Dataset file for jsonl/parquet sources."""
    min_chars: int = 5
    """reverse_text: shortest string to reverse."""
    max_chars: int = 10
    """reverse_text: longest string to reverse."""
    alphabet: str = "abcdefghijklmnopqrstuvwxyz"
    """reverse_text: characters the strings are drawn from."""
    args: dict[str, str] = field(default_factory=dict)
    """number_list, visual: the task's keys, as --env.args takes them (number_list: min_items, max_items,
    min_digits, max_digits, transform, sep; visual: envs/visual.py)."""
    bad_rows: Literal["skip", "error"] = "skip"
    """What to do with malformed rows: skip and count them (first few logged), or stop with the row index."""

    def __post_init__(self) -> None:
        if self.source in ("jsonl", "parquet"):
            _check(bool(self.path), "data.path", self.path, f"--data.source={self.source} needs a file path")
        _check(
            1 <= self.min_chars <= self.max_chars, "data.min_chars", self.min_chars, "need 1 <= min_chars <= max_chars"
        )
        _check(len(self.alphabet) >= 2, "data.alphabet", self.alphabet, "needs at least 2 characters")


@dataclass(kw_only=True, slots=True)
class CkptConfig:
    interval_steps: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    resume: bool = False
    """Resume from the latest complete checkpoint in <output_dir>/checkpoints."""
    keep_last: int = 2
    """Checkpoints to keep (older ones are deleted after a newer one is complete)."""
    save_hf: bool = True
    """Also write HF-format safetensors weights (loadable with AutoModelForCausalLM) at the end of the run."""
    save_final: bool = True
    """Save a checkpoint after the last step. --ckpt.no_save_final: none (a benchmark or sweep run that nothing
    resumes: a 4B full fine-tuning checkpoint with its AdamW moments is ~48 GB). A run stopped by a signal still saves."""

    def __post_init__(self) -> None:
        _check(self.interval_steps >= 0, "ckpt.interval_steps", self.interval_steps, "must be >= 0")
        _check(self.keep_last >= 1, "ckpt.keep_last", self.keep_last, "must be >= 1")


@dataclass(kw_only=True, slots=True)
class LogConfig:
    interval_steps: int = 1
    """Write a metrics line (JSONL and console) every this many steps."""
    progress: bool = True
    """Show a progress bar (plain lines when stderr is not a terminal)."""
    wandb: bool = False
    """Also log metrics to Weights & Biases."""
    wandb_project: str = "prime-spmd"
    """wandb project name."""
    wandb_mode: Literal["online", "offline"] = "offline"
    """wandb mode; offline works without network."""
    plots: bool = True
    """Write PNG plots of the metrics at the end of the run."""

    def __post_init__(self) -> None:
        _check(self.interval_steps >= 1, "log.interval_steps", self.interval_steps, "must be >= 1")


@dataclass(kw_only=True, slots=True)
class EvalLogConfig:
    progress: bool = True
    """Show a progress bar (plain lines when stderr is not a terminal)."""


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature (0 is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: off)."""
    min_p: float = 0.0
    """Drop tokens with probability below min_p times the top probability."""
    max_tokens: int = 64
    """Most tokens generated per completion (per turn for multi-turn environments)."""

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "sampling.temperature", self.temperature, "must be >= 0")
        _check(0 < self.top_p <= 1, "sampling.top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, "sampling.top_k", self.top_k, "must be >= 0")
        _check(0 <= self.min_p < 1, "sampling.min_p", self.min_p, "must be in [0, 1)")
        _check(self.max_tokens >= 1, "sampling.max_tokens", self.max_tokens, "must be >= 1")


@dataclass(kw_only=True, slots=True)
class NativeEngineConfig:
    """Settings only the native engine reads (``[inference.native]``; the vLLM engine never sees them)."""

    decode_attention: Literal["auto", "bmm", "triton", "triton_qkv"] = "auto"
    """Decode attention: auto (triton_qkv on CUDA, bmm elsewhere), bmm (batched matmuls over the length bucket), triton (flash-decoding kernel) or triton_qkv (that kernel taking the QKV projection: q/k norm, RoPE and KV-cache write folded in; dense models' layer function, else triton)."""
    decode_linear: Literal["auto", "torch", "triton"] = "auto"
    """Decode linears: auto (triton on CUDA for hidden size <= 1024, torch otherwise), torch (F.linear + separate norm/SiLU/residual ops) or triton (fused kernels of kernels/decode_linear for decode steps of <= 16 / 64 rows)."""
    sampler: Literal["auto", "torch", "triton", "triton_lm_head"] = "auto"
    """Token sampler: torch (compiled on CUDA), triton (split-vocabulary Gumbel-max kernels of kernels/gumbel_sample for plain sampling; top-k/top-p/min-p steps use torch), triton_lm_head (as triton, and decode steps of <= 64 rows compute the LM head inside the sampling kernel) or auto (triton_lm_head on CUDA, torch elsewhere)."""
    warmup: Literal["on", "off"] = "off"
    """on: compile and capture (CUDA graphs) or run once (elsewhere) the decode step of every (rows, length) bucket when the engine is built, so no generation pays for it; costs more the longer the cache. Off (the default): each bucket is compiled and captured by the first step that meets it, and a run pays only for the buckets it meets (docs/benchmarks.md, Start-up)."""
    kv_cache: Literal["slot", "paged"] = "slot"
    """KV cache: slot (one max_model_len slot per sequence) or paged (blocks of kv_block_size positions; a sequence holds its prompt + max_tokens, a GRPO group's samples share their prompt's blocks)."""
    kv_block_size: int = 16
    """Paged KV cache: positions per block."""
    kv_cache_tokens: int = 0
    """Paged KV cache: pool size in tokens (0: max_batch_size x max_model_len, the slot cache's memory); smaller bounds KV memory, admission then waits for free blocks."""
    pdl: bool = True
    """CUDA: launch the decode step's Triton kernels (decode linears, triton_qkv attention, the step's glue) with programmatic dependent launch, so each one's launch overlaps the previous one's tail (kernels/pdl; one-row GEMVs load their weights before the wait; measured in docs/benchmarks.md). Ignored elsewhere."""
    prefill: Literal["auto", "layer_fn", "modules"] = "auto"
    """Prefill path: layer_fn (one pure layer function over packed QKV and gate/up weights; compiled on CUDA, where the module path is ~50 kernels a layer; any device, ValueError for models other than dense Llama-style ones) or modules (the model's own modules). auto: layer_fn on CUDA for dense Llama-style models, else modules (faster at batch 1, the same mismatch KL: docs/benchmarks.md)."""
    release_kv_cache: bool = False
    """Colocated RL: free the KV cache's device memory while the trainer steps; it is allocated anew, zeroed, at the next generation, and the decode CUDA graphs that held its addresses are recaptured as their buckets come up (docs/memory.md)."""
    decode_steps_per_launch: int = 0
    """Decode steps one launch (CUDA-graph replay) runs for row buckets of <= 16 rows while no request waits for admission and every row has room for them; the host's per-launch work and the gap between replays are paid once for them. 0: auto (4 with CUDA graphs, else 1)."""

    def __post_init__(self) -> None:
        _check(
            self.decode_steps_per_launch >= 0,
            "inference.native.decode_steps_per_launch",
            self.decode_steps_per_launch,
            "must be >= 0 (0: auto)",
        )
        _check(self.kv_block_size >= 1, "inference.native.kv_block_size", self.kv_block_size, "must be >= 1")
        _check(self.kv_cache_tokens >= 0, "inference.native.kv_cache_tokens", self.kv_cache_tokens, "must be >= 0")
        _check(
            self.kv_cache == "paged" or self.kv_cache_tokens == 0,
            "inference.native.kv_cache_tokens",
            self.kv_cache_tokens,
            "sizes the paged cache only: set --inference.native.kv_cache=paged",
        )


@dataclass(kw_only=True, slots=True)
class InferenceConfig:
    engine: Literal["native", "vllm"] = "native"
    """Inference engine: our PyTorch engine (any device) or vLLM (CUDA, optional extra)."""
    quantization: Literal["none", "fp8"] = "none"
    """Generation weights: none (the model's dtype) or fp8 (decoder-layer linears in float8 e4m3 with a scale per output channel, quantized at load and at every weight sync; embeddings, norms and LM head stay bf16; native: dense Llama-style models on CPU or CUDA of compute capability >= 8.9; vllm: its quantization="fp8", on a GPU build with bf16 or fp16 weights; refused on vLLM's CPU build, which has no FP8 kernels). docs/inference.md."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """KV cache: auto (the model's dtype) or fp8 (K and V in float8 e4m3 with an fp32 scale per position and kv head, set when the position is written: about half the KV bytes, twice the tokens in the same memory; native: decode attention dequantizes in the kernel, prefill attends its fresh K/V; text Llama-style models on CPU or CUDA of compute capability >= 8.9; not with --model.exact; vllm: its kv_cache_dtype="fp8"). docs/inference.md."""
    max_batch_size: int = 64
    """Sequences decoded at once (KV-cache slots)."""
    max_model_len: int = 0
    """KV-cache length per sequence in tokens (0: --trainer.seq_len, or the model's limit for eval)."""
    cuda_graphs: bool = True
    """Capture the decode step in CUDA graphs (CUDA only)."""
    gpu_memory_utilization: float = 0.3
    """vLLM: fraction of GPU memory for the engine."""
    weight_bucket_mb: int = 256
    """Weight sync: largest bucket broadcast at once (bounds the extra memory of a sync)."""
    native: NativeEngineConfig = field(default_factory=NativeEngineConfig)
    """The native engine's own settings."""

    def __post_init__(self) -> None:
        _check(self.max_batch_size >= 1, "inference.max_batch_size", self.max_batch_size, "must be >= 1")
        _check(self.max_model_len >= 0, "inference.max_model_len", self.max_model_len, "must be >= 0")
        _check(self.weight_bucket_mb >= 1, "inference.weight_bucket_mb", self.weight_bucket_mb, "must be >= 1")
        _check(
            0 < self.gpu_memory_utilization <= 1,
            "inference.gpu_memory_utilization",
            self.gpu_memory_utilization,
            "must be in (0, 1]",
        )


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    name: str = "reverse_text"
    """Built-in name (reverse_text, number_list), or a verifiers env: installed id, pkg.module:function or path/to/env.py."""
    args: dict[str, str] = field(default_factory=dict)
    """Keyword arguments for the environment's loader."""
    num_eval_examples: int = 64
    """Examples in the eval split."""
    seed: int = 0
    """Seed of the environment's dataset."""
    reward_timeout_s: float = 60.0
    """verifiers envs: limit per reward-function call (past it: reward_timeouts, rollout failed). 0: none."""
    rollout_timeout_s: float = 0.0
    """verifiers envs without their own timeout_seconds: limit per rollout (past it: env_timeouts). 0: none."""
    train_on_eval_split: bool = False
    """verifiers envs with no train split: train on the eval split (a warning); otherwise that is an error."""
    label: str = ""
    """rl: the environment's name in metrics (env/<label>/...) and curriculum weights; "" derives it from name."""
    weight: float = 1.0
    """rl mixtures ([[envs]]): relative share of --rollout.prompts_per_step; 0 leaves it out until a curriculum raises it."""
    max_tokens: int = 0
    """rl: sampled tokens per turn for this environment (0: --sampling.max_tokens)."""
    group_timeout_s: float = 0.0
    """classic verifiers envs (multi-turn path): limit per group of rollouts; past it the group fails. 0: none."""

    def __post_init__(self) -> None:
        _check(self.weight >= 0, "env.weight", self.weight, "must be >= 0")
        _check(self.max_tokens >= 0, "env.max_tokens", self.max_tokens, "must be >= 0 (0: --sampling.max_tokens)")
        _check(self.group_timeout_s >= 0, "env.group_timeout_s", self.group_timeout_s, "must be >= 0 (0: none)")
        _check(self.reward_timeout_s >= 0, "env.reward_timeout_s", self.reward_timeout_s, "must be >= 0 (0: no limit)")
        _check(self.rollout_timeout_s >= 0, "env.rollout_timeout_s", self.rollout_timeout_s, "must be >= 0 (0: none)")


def env_label(cfg: EnvConfig) -> str:
    """``cfg.label``, else the stem of ``cfg.name``: ``reverse_text``, ``pkg/env.py`` -> ``env``,
    ``pkg.mod:load_environment`` -> ``mod``, an installed id as is."""
    if cfg.label:
        return cfg.label
    target = cfg.name.partition(":")[0]
    if target.endswith(".py"):
        target = target[:-3].replace("\\", "/").rsplit("/", 1)[-1]
    return target.rsplit(".", 1)[-1]
