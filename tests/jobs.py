"""Job configs, rank entry points and run-directory helpers shared by the distributed, integration and
vllm_venv tests.

``sft_rank`` / ``rl_rank`` are module-level so that ``tests.dist_utils.run_ranks`` can pickle them.
No verifiers import: tests/vllm_venv (verifiers 0.4) imports this module too.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from prime_spmd.config import EvalJobConfig, RLJobConfig, SFTJobConfig, load_toml, parse_cli
from prime_spmd.config.rl_sections import RolloutConfig
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
    TrainerConfig,
)

ROOT = Path(__file__).resolve().parents[1]
TIMING_KEYS = {
    "gen_time_s", "train_time_s", "weight_sync_s", "wait_s", "step_time_s", "gen_tokens_per_s", "train_tokens_per_s",
    "train_fwd_bwd_s", "train_optim_s", "pack_time_s", "engine_capture_s", "engine_graphs_captured",
}  # fmt: skip
"""RL/SFT metrics that are wall-clock times or rates, or counts of this process's CUDA graphs: they differ between
runs that are otherwise identical (a resumed process captures its graphs again)."""


def read_metrics(run: Path) -> list[dict]:
    """The rows of ``run``/metrics.jsonl, one dict a line."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def sft_rank(rank: int, world: int, cfg: SFTJobConfig) -> None:
    """``run_ranks`` entry: every rank runs the SFT job."""
    from prime_spmd.trainer.sft import run_sft

    run_sft(cfg)


def rl_rank(rank: int, world: int, cfg: RLJobConfig) -> None:
    """``run_ranks`` entry: every rank runs the RL job (its topology gives each rank its role)."""
    from prime_spmd.rl.loop import run_rl

    run_rl(cfg)


def copy_for_resume(run: Path, dst: Path, step: int) -> None:
    """Make ``dst`` a fresh run dir to resume at ``step``: ``run``'s step-``step`` checkpoint and its first
    ``step`` metrics rows."""
    (dst / "checkpoints").mkdir(parents=True)
    name = f"step_{step:06d}"
    shutil.copytree(run / "checkpoints" / name, dst / "checkpoints" / name)
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_metrics(run)[:step]))


def assert_metrics_close(ref: list[dict], got: list[dict], *, loss_rtol: float, grad_norm_rtol: float) -> None:
    """Step by step (``zip``): ``got``'s loss and grad norm within ``rtol * max(1, |ref's|)`` of ``ref``'s."""
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) < loss_rtol * max(1.0, abs(a["loss"])), (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) < grad_norm_rtol * max(1.0, a["grad_norm"])


def tiny_sft_cfg(out: Path, model: ModelConfig, *, lr: float, max_steps: int = 6, resume: bool = False) -> SFTJobConfig:
    """Reverse-text SFT of the 2-ranks == 1-rank tests: 12 samples a step (64 tokens, 128-token micro
    batches), ``lr`` with 2 warmup steps then cosine, a checkpoint every 3 steps (2 kept), no final eval."""
    return SFTJobConfig(
        output_dir=str(out),
        model=model,
        trainer=SFTTrainerConfig(max_steps=max_steps, batch_size=12, micro_batch_tokens=128, seq_len=64, seed=3),
        optim=OptimConfig(lr=lr, warmup_steps=2, schedule="cosine"),
        data=DataConfig(min_chars=3, max_chars=8),
        ckpt=CkptConfig(interval_steps=3, resume=resume, keep_last=2),
        log=LogConfig(progress=False, plots=False),
        eval_examples=0,
    )


def tiny_rl_cfg(
    out: Path,
    model: ModelConfig,
    *,
    steps: int,
    lr: float,
    max_async: int,
    num_inference: int,
    resume: bool = False,
    keep_last: int = 2,
) -> RLJobConfig:
    """Reverse-text RL of the multi-rank tests: 4 prompts x 4 samples a step, 12 new tokens, weights in
    1 MiB buckets, a checkpoint every 2 steps; ``num_inference`` inference ranks (0: colocated)."""
    return RLJobConfig(
        output_dir=str(out),
        model=model,
        topology=RLTopologyConfig(num_inference_ranks=num_inference, timeout_s=120),
        trainer=TrainerConfig(max_steps=steps, micro_batch_tokens=256, seq_len=48, seed=1),
        optim=OptimConfig(lr=lr),
        rollout=RolloutConfig(prompts_per_step=4, group_size=4, max_async=max_async),
        sampling=SamplingConfig(max_tokens=12),
        inference=InferenceConfig(max_batch_size=16, weight_bucket_mb=1),
        ckpt=CkptConfig(interval_steps=2, resume=resume, keep_last=keep_last),
        log=LogConfig(progress=False, plots=False),
    )


def vf_rl_flags(model: Path, out: Path, env: str, *, seq_len: int, micro_batch_tokens: int) -> list[str]:
    """``prime_spmd rl`` flags of the verifiers-env RL tests: ``env`` with 8 examples, 3 steps of 2 prompts
    x 4 samples, max_async 1, 8 new tokens, lr 1e-3, one thread, quiet, checkpoint only at the end."""
    return [
        "--model.path", str(model), "--env.name", env, "--env.args", "num_examples", "8", "--output_dir", str(out),
        "--trainer.max_steps", "3", "--trainer.seq_len", str(seq_len),
        "--trainer.micro_batch_tokens", str(micro_batch_tokens), "--trainer.seed", "1", "--trainer.num_threads", "1",
        "--rollout.prompts_per_step", "2", "--rollout.group_size", "4", "--rollout.max_async", "1",
        "--sampling.max_tokens", "8", "--inference.max_batch_size", "8", "--optim.lr", "1e-3",
        "--log.no_progress", "--log.no_plots", "--ckpt.interval_steps", "0",
    ]  # fmt: skip


def vf_rl_disjoint_cfg(model: Path, out: Path, env: str, *, seq_len: int, micro_batch_tokens: int) -> RLJobConfig:
    """The ``vf_rl_flags`` run on 1 trainer rank + 1 inference rank (weights in 1 MiB buckets), no HF export."""
    disjoint = ["--topology.num_inference_ranks", "1", "--topology.timeout_s", "120"]
    disjoint += ["--inference.weight_bucket_mb", "1", "--ckpt.no_save_hf"]
    flags = vf_rl_flags(model, out, env, seq_len=seq_len, micro_batch_tokens=micro_batch_tokens)
    return parse_cli(RLJobConfig, flags + disjoint, prog="rl")


def vf_eval_cfg(model: Path, out: Path, env: EnvConfig, max_model_len: int = 0) -> EvalJobConfig:
    """Eval of the verifiers-env tests: 2 samples per example of ``env``'s eval split, 6 new tokens."""
    return EvalJobConfig(
        output_dir=str(out),
        model=ModelConfig(path=str(model)),
        env=env,
        sampling=SamplingConfig(max_tokens=6),
        inference=InferenceConfig(max_batch_size=8, max_model_len=max_model_len),
        log=EvalLogConfig(progress=False),
        samples_per_example=2,
    )


def reverse_text_cfg(
    cls: type[SFTJobConfig] | type[RLJobConfig], out: Path, model: Path, *, plots: bool = False
) -> SFTJobConfig | RLJobConfig:
    """The demo recipe configs/reverse_text/{sft,rl}.toml writing to ``out`` from ``model``, with no
    checkpoint before the end and no progress bar."""
    name = "sft" if cls is SFTJobConfig else "rl"
    cfg = load_toml(cls, ROOT / f"configs/reverse_text/{name}.toml")
    cfg.output_dir, cfg.model.path = str(out), str(model)
    cfg.ckpt.interval_steps, cfg.log.progress, cfg.log.plots = 0, False, plots
    return cfg


def eval_reverse_text(model: Path, out: Path, engine: str = "native") -> dict[str, float]:
    """The demo's eval recipe (configs/reverse_text/eval.toml) of ``model`` on ``engine``: its summary."""
    from prime_spmd.eval import run_eval

    cfg = load_toml(EvalJobConfig, ROOT / "configs/reverse_text/eval.toml")
    cfg.model.path, cfg.output_dir, cfg.log.progress = str(model), str(out), False
    cfg.inference.engine = engine
    return run_eval(cfg)


def reward_trend(rows: list[dict], before: dict, after: dict, tag: str = "") -> tuple[float, float, list[float]]:
    """(mean training reward of the first 10 steps, of the last 10, per-step mismatch KL) of an RL run's
    metrics rows; prints them with the eval reward ``before`` -> ``after`` the run."""
    first = statistics.fmean(r["reward_mean"] for r in rows[:10])
    last = statistics.fmean(r["reward_mean"] for r in rows[-10:])
    kl = [r["mismatch_kl"] for r in rows]
    print(
        f"{tag + ': ' if tag else ''}train reward first10 {first:.4f} last10 {last:.4f}; eval reward "
        f"{before['reward_mean']:.4f} -> {after['reward_mean']:.4f}; "
        f"kl median {statistics.median(kl):.2e} max {max(kl):.2e}"
    )
    return first, last, kl
