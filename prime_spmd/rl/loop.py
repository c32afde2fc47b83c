"""The `rl` subcommand: asynchronous RL in one SPMD job.

Every rank runs ``run_rl``; its role decides which loop it runs. The schedule (rl/schedule.py) is
the same on every rank, so each knows the next collective:

- trainer ranks (``_TrainerLoop``; trainer rank 0 is also the controller): initial weight sync,
  then per step j: [controller] take batch j (buffered or received over the data bridge),
  advantages, packing; scatter micro-batches over the trainer group; one optimizer step; if a
  later batch needs w_(j+1), send it (bucketed broadcast over the weight bridge);
- inference ranks (``InferenceLoop`` in rl/inference_loop.py, disjoint mode): receive weights, generate
  the batch the schedule says, send rollouts to the controller (asynchronously), repeat;
- colocated mode: every rank runs the trainer loop and generates its share of each batch itself
  (weights copied in-process, rollouts gathered to the controller over the default group).

The mode is a type, chosen once (rl/roles.py: ``Colocated`` or ``Disjoint``): the trainer loop asks its role
how weights reach the engines, who generates a batch and how the controller receives it.

Stopping on SIGTERM/SIGINT: trainer ranks agree at step j through train_step's all-reduce (an
inference rank's signal reaches the controller through a store key). In disjoint mode the controller
posts "go"/"stop" after every step that would send weights, and the inference ranks read it before
they wait for those weights: on "stop" they flush their rollouts and leave (rl/stop_go.py). The
trainer then saves w_(j+1) with batches j+1..j+k (already generated) and every rank returns; the
job exits 0.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from prime_spmd import memory
from prime_spmd.config import RLJobConfig, write_resolved_config
from prime_spmd.distributed.groups import DistContext, init_distributed
from prime_spmd.distributed.topology import CONTROLLER_RANK
from prime_spmd.inference.engine import InferenceEngine
from prime_spmd.log import logger
from prime_spmd.models.loading import resolve_dtype
from prime_spmd.progress import Progress
from prime_spmd.rl.env_metrics import batch_env_metrics, eval_env_metrics
from prime_spmd.rl.inference_loop import InferenceLoop
from prime_spmd.rl.loss import make_rl_loss
from prime_spmd.rl.mixture import EnvSlot, Mixture, load_envs
from prime_spmd.rl.roles import make_role
from prime_spmd.rl.samples import rollouts_to_samples
from prime_spmd.rl.schedule import (
    batch_after_step,
    eval_after_step,
    eval_at_start,
    pregenerated_batches,
    restored_batches,
    version_of_batch,
    weights_after_step,
)
from prime_spmd.rl.types import Batch
from prime_spmd.sync.weights import WeightSender
from prime_spmd.trainer.build import build_trainer, prepare_model_dir, set_threads
from prime_spmd.trainer.checkpoint import Checkpointer, latest_checkpoint
from prime_spmd.trainer.job import close_run, export_hf, load_checkpoint, open_sink, run_steps
from prime_spmd.trainer.packing import pack
from prime_spmd.trainer.resolved import resolved_settings, warn_unshared_prompts
from prime_spmd.trainer.step import router_metrics, train_step
from prime_spmd.trainer.stop import SkipGuard, StopSignal

BUFFER_FILE = "rollout_buffer.pkl"
MIXTURE_FILE = "mixture.pkl"


def bridge_timeout_s(cfg: RLJobConfig) -> float:
    """Watchdog of the cross-role bridges: --topology.bridge_timeout_s, or (0) --topology.timeout_s plus
    1 s per sampled token (the largest max_tokens of the run's environments), since a controller waits on the
    bridge for a whole generation."""
    return cfg.topology.bridge_timeout_s or cfg.topology.timeout_s + 1.0 * cfg.max_tokens()


def _start_step(ctx: DistContext, cfg: RLJobConfig) -> int:
    """Global rank 0 decides where the run starts; everyone reads it from the TCPStore."""
    key = "rl/start_step"
    if ctx.topo.rank == 0:
        latest = latest_checkpoint(cfg.output_dir) if cfg.ckpt.resume else None
        if cfg.ckpt.resume and latest is None:
            logger.warning(f"--ckpt.resume: no complete checkpoint in {cfg.output_dir}/checkpoints; starting at 0")
        ctx.store.set(key, str(json.loads((latest / "state.json").read_text())["step"] if latest else 0))
    return int(ctx.store.get(key).decode())


class _TrainerLoop:
    """Trainer rank (and, on global rank 0, the controller); its ``role`` (rl/roles.py) says how it reaches the
    engines: its own (colocated) or the inference ranks' (disjoint)."""

    def __init__(
        self,
        cfg: RLJobConfig,
        ctx: DistContext,
        envs: list[EnvSlot],
        engine: InferenceEngine | None,
        stop: StopSignal,
        plan: memory.MemoryPlan | None = None,
        engine_builder: Callable[[torch.nn.Module, Any], InferenceEngine] | None = None,
    ) -> None:
        """``engine_builder``: build this rank's engine from the trainer's LM once the trainer is built (colocated
        LoRA or ``--trainer.offload master``: the engine reads the trainer's bf16 weights in place,
        ``inference/shared_weights.py``); else ``engine``."""
        self.cfg, self.ctx, self.envs, self.engine, self.stop = cfg, ctx, envs, engine, stop
        self.plan = plan  # colocated on CUDA: named in an out-of-memory error (memory.phase)
        self.guard = SkipGuard(cfg.trainer.max_skipped_steps)
        self.stop_agreed = False
        self.topo = ctx.topo
        self.out = Path(cfg.output_dir)
        with memory.phase("the trainer's build (model load, LoRA, FSDP2)", plan):
            # colocated: the engine's tokenizer (both load --model's), so the process loads it once
            tokenizer = getattr(engine, "tokenizer", None)
            self.parts = build_trainer(cfg.model, cfg.trainer, cfg.optim, ctx, tokenizer=tokenizer)
        if engine_builder is not None:
            engine = self.engine = engine_builder(self.parts.policy.lm, self.parts.tokenizer)
        if self.topo.rank == 0:
            warn_unshared_prompts(cfg, self.parts.policy)
            settings = resolved_settings(
                cfg, ctx.device, topology=self.topo, backend=ctx.backend, policy=self.parts.policy, engine=engine,
                max_model_len=cfg.inference.max_model_len or cfg.trainer.seq_len, bridge_timeout_s=bridge_timeout_s(cfg),
            )  # fmt: skip
            write_resolved_config(cfg, self.out, settings)
        wire = resolve_dtype(cfg.model.dtype, ctx.device)
        self.sender = WeightSender(self.parts.policy.lm, wire, cfg.inference.weight_bucket_mb << 20, self.topo.rank)
        self.role = make_role(cfg, ctx, envs, engine, self.sender)
        # Controller: the batch planner (rl/mixture.py); batches produced and evals expected, so that the
        # controller receives everything the inference ranks send before it leaves.
        self.mixture = Mixture(cfg, envs) if self.topo.is_controller else None
        self.produced: set[int] = set()
        self.taken: set[int] = set()
        self.evals_expected: set[int] = set()
        self.evals_logged: set[int] = set()
        self.ckpt = Checkpointer(self.out, cfg.ckpt.keep_last, self.topo.trainer_rank)
        self.loss_fn = make_rl_loss(cfg.loss)
        self.buffer: dict[int, Batch] = {}
        self.sink = open_sink(cfg, self.out, enabled=True) if self.topo.is_controller else None

    # ---- batches ----------------------------------------------------------------------------
    def take_batch(self, j: int) -> tuple[Batch, float]:
        """Controller: batch j from the buffer, else received from every engine leader. Returns (batch, wait s)."""
        t0 = time.perf_counter()
        while j not in self.buffer:
            self.role.receive(self.buffer)
        self.taken.add(j)
        return self.buffer.pop(j), time.perf_counter() - t0

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, start: int) -> dict[str, float]:
        cfg, topo = self.cfg, self.topo
        k, n = cfg.rollout.max_async, cfg.trainer.max_steps
        if start:
            self._restore(start)
        if self.sink is not None:
            self.sink.truncate_from(start)
        self.role.start()
        self.role.sync_weights(start)  # w_start
        for b in pregenerated_batches(start, k, n):
            with memory.phase(f"generation of batch {b}", self.plan):
                self._produce(b, version_of_batch(b, k))
        if eval_at_start(start, cfg.eval.interval_steps):
            self.evals_expected.add(start)
            with memory.phase(f"the eval of weights {start}", self.plan):
                self.role.evaluate(start)  # the baseline, logged with step 0
        bar = Progress(total=n - start, desc="rl", enabled=topo.is_controller and cfg.log.progress)
        last, stopped_at = run_steps(
            start,
            n,
            lambda j: (self.step(j), self.stop_agreed),
            self.save,
            interval_steps=cfg.ckpt.interval_steps,
            save_final=cfg.ckpt.save_final,
            stop=self.stop,
            bar=bar,
            bar_metric=("reward", "reward_mean"),
        )
        self._drain()
        if self.sink is not None:  # the final weights' eval (and any that came after the last row): rows of step n
            for row in self._take_evals(below=n + 1):
                self.sink.log(n, row, console_keys=[k for k in row if k == "eval_step" or k.endswith("eval_reward")])
        if stopped_at is None:
            export_hf(cfg.ckpt.save_hf, self.parts, self.out, is_writer=topo.is_controller)
        close_run(self.sink, self.out, cfg.log.plots and stopped_at is None, is_writer=topo.is_controller)
        return last

    def step(self, j: int) -> dict[str, float]:
        """Training step j on every trainer rank, in four phases; returns the metrics (controller; {} elsewhere)."""
        t_step = time.perf_counter()
        mine, bm, wait_s, forward_tokens = self._take_batch_phase(j)
        stats, train_s = self._train_phase(j, mine)
        sync_wait_s, sync_s, gen_s = self._after_step_phase(j, stats)
        if not self.topo.is_controller:
            return {}
        timings = {
            "train_time_s": train_s,
            "weight_sync_s": sync_s,
            "weight_sync_wait_s": sync_wait_s,
            "wait_s": wait_s,
            "step_time_s": time.perf_counter() - t_step,
        }
        return self._metrics_phase(j, stats, bm, timings, forward_tokens, gen_s)

    def _take_batch_phase(self, j: int) -> tuple[list, dict[str, float], float, int]:
        """The controller takes batch j, computes advantages and packs it; every trainer rank gets its
        micro-batches (scatter over the trainer group). Returns (mine, batch metrics, wait s, forward tokens)."""
        cfg, topo = self.cfg, self.topo
        per_rank, bm, wait, forward_tokens = None, {}, 0.0, 0
        abort = None
        if topo.is_controller:
            assert self.mixture is not None
            batch, wait = self.take_batch(j)
            t_pack = time.perf_counter()
            mix_metrics, abort = self.mixture.observe(batch)
            env_metrics = {**batch_env_metrics(batch, self.mixture.labels), **mix_metrics}
            samples, bm = rollouts_to_samples(batch, cfg.rollout, cfg.sampling.max_tokens, cfg.trainer.seq_len)
            bm.update(env_metrics)
            bm["env_failed_groups"] = float(len(batch.failures))
            bm["policy_lag_mean"] = float(j) - sum(r.policy_version for g in batch.groups for r in g) / max(
                1, sum(len(g) for g in batch.groups)
            )
            bm["policy_lag_max"] = float(j) - bm.pop("policy_version_min")
            share = self.parts.policy.share_prompts  # micro-batches then hold model tokens, prompts once
            per_rank = pack(samples, cfg.trainer.micro_batch_tokens, topo.num_trainer_ranks, share_prompts=share)
            forward_tokens = sum(mb.num_tokens for mbs in per_rank for mb in mbs)
            bm["pack_time_s"] = time.perf_counter() - t_pack  # advantages, samples, packing (host)
            per_rank = [(mbs, abort) for mbs in per_rank]
        mine = [None]
        dist.scatter_object_list(mine, per_rank, src=CONTROLLER_RANK)
        micro_batches, abort = mine[0]  # type: ignore[misc]
        if abort is not None:
            self._abort(j, abort)
        return micro_batches, bm, wait, forward_tokens

    def _train_phase(self, j: int, micro_batches: list) -> tuple[dict[str, float], float]:
        """One optimizer step (all trainer ranks); its all-reduce also agrees on a stop. Returns (stats, s)."""
        n = self.cfg.trainer.max_steps
        stop_requested = self.stop.requested or self.role.stop_requested()
        self.role.before_train()
        t_train = time.perf_counter()
        with memory.phase("the train step", self.plan):
            stats = self._train_step(micro_batches, stop_requested)
        self.stop_agreed = stats["stop"] > 0 and j + 1 < n
        return stats, time.perf_counter() - t_train

    def _train_step(self, micro_batches: list, stop_requested: bool) -> dict[str, float]:
        cfg = self.cfg
        return train_step(
            self.parts.policy,
            self.parts.optimizer,
            self.parts.scheduler,
            micro_batches,
            self.loss_fn,
            device=self.ctx.device,
            temperature=max(cfg.sampling.temperature, 1e-6) if cfg.sampling.temperature > 0 else 1.0,
            max_grad_norm=cfg.optim.max_grad_norm,
            stop_requested=stop_requested,
        )

    def _after_step_phase(self, j: int, stats: dict[str, float]) -> tuple[float, float, float]:
        """After step j: the non-finite guard, the go/stop decision for the inference ranks (disjoint mode),
        then, when the schedule generates a batch with w_(j+1) and nobody stops, the weight sync and that batch's
        production (generated here in colocated mode). Returns (sync wait s, sync s, generation s here)."""
        cfg = self.cfg
        k, n = cfg.rollout.max_async, cfg.trainer.max_steps
        sync_wait_s, sync_s, gen_s = 0.0, 0.0, 0.0
        b = batch_after_step(j, k, n)
        evaluate = eval_after_step(j, cfg.eval.interval_steps, cfg.eval.final, n)
        send = weights_after_step(j, k, n, evaluate)
        try:
            self.guard.update(j, stats["nonfinite"] > 0)
        finally:  # on a guard failure too, the inference ranks leave instead of waiting for weights
            if send:
                failed = self.guard.max_skipped_steps and self.guard.in_a_row >= self.guard.max_skipped_steps
                self.role.post_go(j, go=not (self.stop_agreed or failed))
        if send and not self.stop_agreed:
            with memory.phase("the weight sync", self.plan):
                sync_wait_s, sync_s = self.role.sync_weights(j + 1)
            if b is not None:
                with memory.phase(f"generation of batch {b}", self.plan):
                    gen_s = self._produce(b, j + 1)
            if evaluate:
                self.evals_expected.add(j + 1)
                with memory.phase(f"the eval of weights {j + 1}", self.plan):
                    self.role.evaluate(j + 1)  # colocated: here, now; disjoint: the inference ranks, after batch b
        return sync_wait_s, sync_s, gen_s

    def _produce(self, b: int, version: int) -> float:
        """Batch b with w_version, on the prompts the controller plans (rl/mixture.py). Returns generation s here."""
        batch_plan = self.mixture.plan(b) if self.mixture is not None else None
        self.produced.add(b)
        return self.role.produce(b, version, self.buffer, batch_plan)

    def _take_evals(self, below: int) -> list[dict[str, float]]:
        """Controller: the metrics of each eval received so far of weights older than ``below``, oldest first;
        forgets them (the others stay for later)."""
        taken = sorted((ev for ev in self.role.evals if ev.version < below), key=lambda e: e.version)
        self.role.evals = [ev for ev in self.role.evals if ev.version >= below]
        self.evals_logged.update(ev.version for ev in taken)
        return [eval_env_metrics(ev) for ev in taken]

    def _receive_due_evals(self, j: int) -> None:
        """Controller, at step j's metrics: receive the evals the inference ranks have sent by now (disjoint), so
        that each lands in its own row: the eval of w_v follows batch v + k, or the weights when no batch does."""
        k, n = self.cfg.rollout.max_async, self.cfg.trainer.max_steps

        def due() -> bool:
            got = self.evals_logged | {e.version for e in self.role.evals}
            return any(v + k <= j or v + k >= n for v in self.evals_expected - got)

        while due():
            self.role.receive(self.buffer)

    def _drain(self) -> None:
        """Controller: receive what the inference ranks still send (batches produced, evals expected), so that
        their sends complete before anyone leaves (disjoint; colocated holds everything already)."""
        if not self.topo.is_controller:
            return

        def outstanding() -> bool:
            got = self.evals_logged | {e.version for e in self.role.evals}
            return bool(self.evals_expected - got) or any(
                b not in self.buffer and b not in self.taken for b in self.produced
            )

        while outstanding():
            self.role.receive(self.buffer)

    def _abort(self, j: int, message: str) -> None:
        """Every trainer rank at step j: an environment failed too often. The controller tells the inference
        ranks to leave and takes what they sent; then every trainer rank raises with ``message``."""
        k, n, e = self.cfg.rollout.max_async, self.cfg.trainer.max_steps, self.cfg.eval
        for jj in range(j, n):
            if weights_after_step(jj, k, n, eval_after_step(jj, e.interval_steps, e.final, n)):
                self.role.post_go(jj, go=False)
        self.evals_expected.clear()
        self._drain()
        raise RuntimeError(message)

    def _metrics_phase(
        self,
        j: int,
        stats: dict[str, float],
        bm: dict[str, float],
        timings: dict[str, float],
        forward_tokens: int,
        gen_s: float,
    ) -> dict[str, float]:
        """Controller: step j's metrics, logged to the sink when it is due; returns them."""
        n = self.cfg.trainer.max_steps
        tokens = max(stats.get("tokens", 0.0), 1.0)
        m = {
            **bm,
            "loss": stats["loss"],
            "grad_norm": stats["grad_norm"],
            "lr": stats["lr"],
            "mismatch_kl": stats.get("mismatch_kl_sum", 0.0) / tokens,
            "masked_frac": stats.get("masked_tokens", 0.0) / tokens,
            "entropy": stats.get("entropy_sum", 0.0) / tokens,
            "trained_tokens": stats["trained_tokens"],
            "train_fwd_bwd_s": stats["fwd_bwd_s"],
            "train_optim_s": stats["optim_s"],
            "forward_tokens": float(forward_tokens),
            "model_tokens": stats["model_tokens"],
            "row_tokens": stats["row_tokens"],
            "skipped_steps": stats["skipped"],
            "nonfinite_steps": stats["nonfinite"],
            "empty_batch": stats["empty_batch"],
            **timings,
            "gen_tokens_per_s": bm["generated_tokens"] / timings["step_time_s"],
            **router_metrics(stats),
        }
        m["gen_time_s"] = gen_s or bm["gen_time_s"]  # generated during this step (colocated), else the batch's own
        graph_stats = getattr(self.engine, "graph_stats", None)  # this rank's native engine: captures so far
        if graph_stats is not None:
            m.update(graph_stats())
        self._receive_due_evals(j)
        # A row holds one eval (w_v, eval_step v); an older one arriving with it (disjoint, last steps) is
        # written first as a row of its own. The final weights' eval waits for the row of step n.
        evals = self._take_evals(below=n)
        assert self.sink is not None
        for row in evals[:-1]:
            self.sink.log(j, row, console_keys=[k for k in row if k == "eval_step" or k.endswith("eval_reward")])
        if evals:
            m.update(evals[-1])
        if self.ctx.device.type == "cuda":  # this rank's peak since the job started (model, optimizer, engine)
            m["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.ctx.device) / 2**30
        if self.sink.should_log(j, last=j == n - 1 or self.stop_agreed or bool(evals)):
            keys = ["reward_mean", "policy_lag_mean", "mismatch_kl", "loss", "step_time_s"]
            self.sink.log(j, m, console_keys=keys)
        return m

    # ---- checkpoints ------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """Checkpoint after ``step`` optimizer steps. The controller first holds every batch that was
        generated with weights older than w_step (steps step..step+k-1), so a resume reproduces them."""
        blobs = None
        if self.topo.is_controller:
            need = restored_batches(step, self.cfg.rollout.max_async, self.cfg.trainer.max_steps)
            while not all(b in self.buffer for b in need):
                self.role.receive(self.buffer)
            assert self.mixture is not None
            blobs = {
                BUFFER_FILE: pickle.dumps({b: self.buffer[b] for b in need}),
                MIXTURE_FILE: pickle.dumps(self.mixture.state_dict()),
            }
        state = {"step": step, "scheduler": self.parts.scheduler.state_dict()}
        return self.ckpt.save(step, self.parts.policy, self.parts.optimizer, state, blobs)

    def _restore(self, start: int) -> None:
        path = self.ckpt.latest()
        assert path is not None and int(path.name[5:]) == start, (path, start)
        load_checkpoint(self.ckpt, path, self.parts)
        if self.topo.is_controller:
            assert self.mixture is not None
            self.buffer.update(pickle.loads((path / BUFFER_FILE).read_bytes()))
            self.produced.update(self.buffer)
            if (path / MIXTURE_FILE).is_file():  # a checkpoint without it (older runs) plans afresh
                self.mixture.load_state_dict(pickle.loads((path / MIXTURE_FILE).read_bytes()))


def check_colocated_memory(cfg: RLJobConfig, ctx: DistContext) -> memory.MemoryPlan | None:
    """Colocated on CUDA: the device-memory plan of this run (prime_spmd/memory.py), logged on rank 0; a plan that
    cannot fit the device stops the run here, before any weight is loaded, with the flags that make it fit."""
    if ctx.topo.mode != "colocated" or ctx.device.type != "cuda":
        return None
    plan = memory.plan_rl_job(cfg, ctx.topo.num_trainer_ranks)
    if ctx.topo.rank == 0:
        logger.info(f"device memory plan (colocated; docs/memory.md):\n{plan.describe()}")
    memory.check_fits(plan, torch.cuda.mem_get_info(ctx.device)[1])
    return plan


def resolve_max_async(max_async: int | None, mode: str) -> int:
    """``--rollout.max_async``, or where unset its default for the topology ``mode``: 0 colocated (generation and
    training take turns in one process, so a lag overlaps nothing), 1 disjoint (config/rl_sections.py)."""
    if max_async is not None:
        return max_async
    return 0 if mode == "colocated" else 1


def run_rl(cfg: RLJobConfig) -> dict[str, float]:
    """Run the RL job on every rank; returns the last step's metrics on the controller ({} elsewhere).

    SIGTERM/SIGINT: every rank finishes the current step, the trainer saves a checkpoint, all return.
    """
    with StopSignal() as stop:
        return _run_rl(cfg, stop)


def _run_rl(cfg: RLJobConfig, stop: StopSignal) -> dict[str, float]:
    set_threads(cfg.trainer.num_threads)
    ctx = init_distributed(cfg.topology, bridge_timeout_s=bridge_timeout_s(cfg))
    topo = ctx.topo
    cfg.rollout.max_async = resolve_max_async(cfg.rollout.max_async, topo.mode)
    out = Path(cfg.output_dir)
    if topo.rank == 0:
        write_resolved_config(cfg, out)
    prepare_model_dir(cfg.model, ctx, cfg.trainer.seed)
    plan = check_colocated_memory(cfg, ctx)
    envs = load_envs(cfg)
    engine, builder = None, None
    if topo.is_inference:
        from prime_spmd.inference.factory import build_engine

        if cfg.inference.engine == "native" and topo.engine_tp > 1:
            raise ValueError("--topology.engine_tp > 1 needs --inference.engine=vllm (the native engine runs tp 1)")

        # colocated with one trainer rank, LoRA or the masters on the host: the engine is built after the trainer and
        # reads its bf16 weights in place (the frozen base; with --trainer.offload master, the trained weights too)
        share = topo.mode == "colocated" and topo.num_trainer_ranks == 1 and cfg.inference.engine == "native"
        master = share and cfg.trainer.offload == "master"

        def builder(share_from: torch.nn.Module | None = None, tokenizer: Any | None = None) -> InferenceEngine:
            with memory.phase("the engine's build", plan):
                return build_engine(
                    cfg.inference, cfg.model, ctx.device, cfg.trainer.seq_len, tp=topo.engine_tp,
                    seed=cfg.trainer.seed, share_from=share_from, tokenizer=tokenizer, share_trained=master,
                )  # fmt: skip

        if not (share and (cfg.model.lora.rank or master)):
            engine, builder = builder(), None
    start = _start_step(ctx, cfg)
    result: dict[str, float] = {}
    if topo.is_trainer:
        result = _TrainerLoop(cfg, ctx, envs, engine, stop, plan, builder).run(start)
    else:
        assert engine is not None
        InferenceLoop(cfg, ctx, envs, engine, stop).run(start)
    if engine is not None and hasattr(engine, "close"):
        engine.close()  # vLLM: its teardown needs the process groups that ctx.close destroys
    ctx.close()
    return result
