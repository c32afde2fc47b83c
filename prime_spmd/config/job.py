"""The root configs of the three subcommands.

Each is a dataclass of sections; ``validate()`` holds the rules that span sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prime_spmd.config.rl_sections import LossConfig, RLEvalConfig, RolloutConfig
from prime_spmd.config.sections import (
    CkptConfig,
    DataConfig,
    EnvConfig,
    EvalLogConfig,
    InferenceConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RLTopologyConfig,
    SamplingConfig,
    SFTTrainerConfig,
    TopologyConfig,
    TrainerConfig,
    env_label,
)

# Default peak learning rates of full fine-tuning of a pretrained model; LoRA and the tiny random models of
# the recipes in configs/ train well at larger rates, so the recipes set --optim.lr themselves.
SFT_DEFAULT_LR = 2e-5
RL_DEFAULT_LR = 1e-6


def check_model_path(model: ModelConfig) -> None:
    if not model.path:
        raise ValueError(
            "--model.path is required: a local model directory (HF format) or hub id, or with --model.init_tiny "
            "the directory the tiny model is written to"
        )


@dataclass(kw_only=True, slots=True)
class SFTJobConfig:
    config: str = ""
    """TOML file whose values become the defaults (CLI flags override them)."""
    output_dir: str = "outputs/sft"
    """Run directory: resolved config, metrics, checkpoints and final weights."""
    dry_run: bool = False
    """Print the resolved config and exit."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train."""
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    """How ranks split into roles."""
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    """Training loop."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=SFT_DEFAULT_LR))
    """Optimizer and schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """SFT dataset."""
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    """Checkpoints."""
    log: LogConfig = field(default_factory=LogConfig)
    """Metrics, progress and plots."""
    eval_examples: int = 128
    """Reverse-text examples greedily decoded at the end to report exact match (0: skip)."""

    def validate(self) -> None:
        check_model_path(self.model)
        if self.topology.mode == "disjoint" or self.topology.num_inference_ranks:
            raise ValueError(
                "sft trains on every rank: drop --topology.num_inference_ranks / --topology.mode=disjoint "
                f"(got mode={self.topology.mode!r}, num_inference_ranks={self.topology.num_inference_ranks})"
            )


@dataclass(kw_only=True, slots=True)
class RLJobConfig:
    config: str = ""
    """TOML file whose values become the defaults (CLI flags override them)."""
    output_dir: str = "outputs/rl"
    """Run directory: resolved config, metrics, checkpoints and final weights."""
    dry_run: bool = False
    """Print the resolved config and exit."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy to train."""
    topology: RLTopologyConfig = field(default_factory=RLTopologyConfig)
    """How ranks split into trainer and inference roles."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Training loop (a step's batch is --rollout.prompts_per_step x --rollout.group_size samples)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=RL_DEFAULT_LR))
    """Optimizer and schedule."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollouts, groups, advantages and the async bound."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy-gradient loss."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters of the rollouts."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """Inference engine."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Environment (rollout logic and rubric)."""
    envs: list[EnvConfig] = field(default_factory=list)
    """Several environments in one run: [[envs]] tables in the TOML, each an [env] with its weight (empty: the one --env)."""
    eval: RLEvalConfig = field(default_factory=RLEvalConfig)
    """Evaluation of every environment's eval split during training."""
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    """Checkpoints."""
    log: LogConfig = field(default_factory=LogConfig)
    """Metrics, progress and plots."""

    def environments(self) -> list[EnvConfig]:
        """The run's environments: the [[envs]] list, else the single [env]."""
        return list(self.envs) or [self.env]

    def max_tokens(self) -> int:
        """The most tokens any environment samples per turn (its max_tokens, else --sampling.max_tokens)."""
        return max(e.max_tokens or self.sampling.max_tokens for e in self.environments())

    def validate(self) -> None:
        check_model_path(self.model)
        if self.envs and self.env != EnvConfig():
            raise ValueError("set either [env] (one environment) or [[envs]] (a mixture), not both")
        labels = [env_label(e) for e in self.environments()]
        if len(set(labels)) != len(labels):
            raise ValueError(f'[[envs]]: environment labels must differ, got {labels}; set label = "..." per env')
        if not self.rollout.curriculum and not any(e.weight > 0 for e in self.environments()):
            raise ValueError(f"[[envs]]: every weight is 0 ({labels}); give one environment weight > 0")
        s = self.sampling
        for flag, value, off in (("top_k", s.top_k, 0), ("top_p", s.top_p, 1.0), ("min_p", s.min_p, 0.0)):
            if value != off:
                # The engine's logprobs are of the filtered distribution; the trainer's are of
                # softmax(logits / T) over the whole vocabulary: the importance ratio would be biased.
                raise ValueError(
                    f"--sampling.{flag}={value}: rl samples without top-k/top-p/min-p filtering, because the "
                    "trainer computes logprobs of the unfiltered tempered distribution (the importance ratio "
                    f"would be biased); set --sampling.{flag} {off} (eval may filter)"
                )
        if self.model.exact:
            self._check_exact()
        if self.model.lora.rank > 512 and self.inference.engine == "vllm":
            # vLLM 0.32's largest max_lora_rank (vllm/config/lora.py; inference/vllm_lora.py)
            raise ValueError(
                f"--model.lora.rank={self.model.lora.rank}: vLLM 0.32's LoRA layers hold ranks up to 512; lower "
                "--model.lora.rank or use --inference.engine=native"
            )
        if self.inference.max_model_len and self.inference.max_model_len < self.trainer.seq_len:
            raise ValueError(
                f"--inference.max_model_len={self.inference.max_model_len} is shorter than "
                f"--trainer.seq_len={self.trainer.seq_len}; raise it or set 0 to follow seq_len"
            )

    def _check_exact(self) -> None:
        """--model.exact's limits (docs/algorithms.md, "Exact mode"): the native engine's slot cache, full weights."""
        native = self.inference.native
        for bad, fix in (
            (self.inference.engine != "native", "--inference.engine native"),
            (self.model.lora.rank > 0, "--model.lora.rank 0 (LoRA is not covered)"),
            (native.kv_cache != "slot", "--inference.native.kv_cache slot"),
            (getattr(self.inference, "quantization", "none") != "none", "--inference.quantization none"),
            (getattr(self.inference, "kv_cache_dtype", "auto") != "auto", "--inference.kv_cache_dtype auto"),
            (self.model.impl == "hf", "--model.impl custom"),
        ):
            if bad:
                raise ValueError(f"--model.exact needs {fix}")


@dataclass(kw_only=True, slots=True)
class EvalJobConfig:
    config: str = ""
    """TOML file whose values become the defaults (CLI flags override them)."""
    output_dir: str = "outputs/eval"
    """Run directory: resolved config, samples.jsonl and the summary."""
    dry_run: bool = False
    """Print the resolved config and exit."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to evaluate."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """Inference engine."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Environment whose eval split is run."""
    log: EvalLogConfig = field(default_factory=EvalLogConfig)
    """Progress."""
    samples_per_example: int = 1
    """Completions per example; pass@k is reported for k up to this."""
    seed: int = 0
    """Sampling seed."""

    def validate(self) -> None:
        check_model_path(self.model)
        if self.model.lora.rank:
            raise ValueError(
                f"--model.lora.rank={self.model.lora.rank}: eval runs a plain model; evaluate the merged export of "
                "a LoRA run (<output_dir>/hf) with --model.lora.rank=0"
            )
        if self.samples_per_example < 1:
            raise ValueError(f"--samples_per_example={self.samples_per_example} is invalid: must be >= 1")


JobConfig = SFTJobConfig | RLJobConfig | EvalJobConfig
