"""The `sft` subcommand: FSDP2 supervised fine-tuning with packed sequences.

Every rank is a trainer. Each step: the global batch for the step (a pure function of seed and
step), packed into micro-batches dealt across ranks, one optimizer step, metrics, checkpoints.
At the end: final checkpoint, HF-format weights in <output_dir>/hf, and (reverse-text data) a
greedy exact-match evaluation of the exported model.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from prime_spmd.config import SFTJobConfig, write_resolved_config
from prime_spmd.data.sft import SFTDataset
from prime_spmd.distributed.groups import init_distributed
from prime_spmd.log import logger
from prime_spmd.progress import Progress
from prime_spmd.trainer.build import build_trainer, prepare_model_dir, set_threads
from prime_spmd.trainer.checkpoint import Checkpointer
from prime_spmd.trainer.job import close_run, export_hf, load_checkpoint, open_sink, run_steps
from prime_spmd.trainer.loss import TokenLoss
from prime_spmd.trainer.packing import pack
from prime_spmd.trainer.resolved import resolved_settings
from prime_spmd.trainer.sft_eval import eval_reverse_text
from prime_spmd.trainer.step import router_metrics, train_step
from prime_spmd.trainer.stop import SkipGuard, StopSignal


class SFTLoss(TokenLoss):
    """Negative log-likelihood of completion tokens."""

    def token_loss(self, lp: torch.Tensor, ent: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        return -lp * fields["loss_mask"]

    def stats(self, lp: torch.Tensor, ent: torch.Tensor, fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mask = fields["loss_mask"]
        return {"entropy_sum": (ent * mask).sum(), "tokens": mask.sum()}


sft_loss = SFTLoss()


def run_sft(cfg: SFTJobConfig) -> dict[str, float]:
    """Run SFT on every rank of the job; returns the final metrics (rank 0's view).

    SIGTERM/SIGINT: every rank finishes the current step, saves a checkpoint and returns (exit 0).
    """
    with StopSignal() as stop:
        return _run_sft(cfg, stop)


def _run_sft(cfg: SFTJobConfig, stop: StopSignal) -> dict[str, float]:
    set_threads(cfg.trainer.num_threads)
    ctx = init_distributed(cfg.topology)
    topo = ctx.topo
    out = Path(cfg.output_dir)
    prepare_model_dir(cfg.model, ctx, cfg.trainer.seed)
    # SFT packs without share groups (``pack`` below): built without prompt sharing, the compiled blocks' step-0
    # warm-up leaves out the shared-prompt kinds (one graph fewer: several masked rows)
    parts = build_trainer(cfg.model, dataclasses.replace(cfg.trainer, share_prompts=False), cfg.optim, ctx)
    if topo.rank == 0:
        settings = resolved_settings(cfg, ctx.device, topology=topo, backend=ctx.backend, policy=parts.policy)
        logger.info(f"resolved config written to {write_resolved_config(cfg, out, settings)}")
    data = SFTDataset(cfg.data, parts.tokenizer, cfg.trainer.seed, cfg.trainer.seq_len, processor=parts.processor)
    ckpt = Checkpointer(out, cfg.ckpt.keep_last, topo.rank)
    sink = open_sink(cfg, out, enabled=topo.rank == 0)
    start = 0
    latest = ckpt.latest() if cfg.ckpt.resume else None
    if latest is not None:
        state = load_checkpoint(ckpt, latest, parts)
        start = state["step"]
        data.num_bad_rows = state.get("num_bad_rows", 0)
    elif cfg.ckpt.resume:
        logger.warning(f"--ckpt.resume: no complete checkpoint in {ckpt.root}; starting from step 0")
    sink.truncate_from(start)
    world = topo.num_trainer_ranks
    bar = Progress(total=cfg.trainer.max_steps - start, desc="sft", enabled=topo.rank == 0 and cfg.log.progress)
    guard = SkipGuard(cfg.trainer.max_skipped_steps)

    def save(step: int) -> Path:
        state = {"step": step, "scheduler": parts.scheduler.state_dict(), "num_bad_rows": data.num_bad_rows}
        return ckpt.save(step, parts.policy, parts.optimizer, state)

    def step_fn(step: int) -> tuple[dict[str, float], bool]:
        t0 = time.perf_counter()
        samples = data.batch(step, cfg.trainer.batch_size)
        micro_batches = pack(samples, cfg.trainer.micro_batch_tokens, world)[topo.trainer_rank]
        stats = train_step(
            parts.policy,
            parts.optimizer,
            parts.scheduler,
            micro_batches,
            sft_loss,
            device=ctx.device,
            max_grad_norm=cfg.optim.max_grad_norm,
            stop_requested=stop.requested,
        )
        dt = time.perf_counter() - t0
        tokens = sum(len(s.input_ids) for s in samples)
        m = {
            "loss": stats["loss"],
            "entropy": stats["entropy_sum"] / max(stats["tokens"], 1.0),
            "grad_norm": stats["grad_norm"],
            "lr": stats["lr"],
            "skipped_steps": stats["skipped"],
            "nonfinite_steps": stats["nonfinite"],
            "samples": float(len(samples)),
            "bad_rows": float(data.num_bad_rows),
            "step_time_s": dt,
            "train_tokens_per_s": tokens / dt,
            "row_tokens": stats["row_tokens"],
            **router_metrics(stats),
        }
        if sink.should_log(step, last=step == cfg.trainer.max_steps - 1 or stats["stop"] > 0):
            sink.log(step, m, console_keys=["loss", "grad_norm", "lr", "train_tokens_per_s"])
        guard.update(step, stats["nonfinite"] > 0)
        return m, stats["stop"] > 0

    last, stopped_at = run_steps(
        start,
        cfg.trainer.max_steps,
        step_fn,
        save,
        interval_steps=cfg.ckpt.interval_steps,
        save_final=cfg.ckpt.save_final,
        stop=stop,
        bar=bar,
        bar_metric=("loss", "loss"),
    )
    if stopped_at is None:
        hf_dir = export_hf(cfg.ckpt.save_hf, parts, out, is_writer=topo.rank == 0)
        if hf_dir is not None and cfg.eval_examples and cfg.data.source == "reverse_text":
            scores = eval_reverse_text(hf_dir, cfg, ctx.device)
            last.update(scores)
            sink.log(cfg.trainer.max_steps, scores, console_keys=list(scores))
            (out / "eval.json").write_text(json.dumps(scores, indent=1))
    close_run(sink, out, cfg.log.plots and stopped_at is None, is_writer=topo.rank == 0)
    ctx.close()
    return last
