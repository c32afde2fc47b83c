"""The `rl` subcommand: asynchronous RL in one SPMD job.

Every rank runs ``run_rl``; its role decides which loop it runs. The schedule (rl/schedule.py) is
the same on every rank, so each knows the next collective:

- trainer ranks (``_TrainerLoop``; trainer rank 0 is also the controller): initial weight sync,
  then per step j: [controller] take batch j (buffered or received over the data bridge),
  advantages, packing; scatter micro-batches over the trainer group; one optimizer step; if a
  later batch needs w_(j+1), send it (bucketed broadcast over the weight bridge);
- inference ranks (``_InferenceLoop``, disjoint mode): receive weights, generate the batch the
  schedule says, send rollouts to the controller (asynchronously), repeat;
- colocated mode: every rank runs the trainer loop and generates its share of each batch itself
  (weights copied in-process, rollouts gathered to the controller over the default group).

Stopping on SIGTERM/SIGINT: trainer ranks agree at step j through train_step's all-reduce (an
inference rank's signal reaches the controller through the store key ``_stop_request_key``). In
disjoint mode the controller writes ``_go_key(j)`` ("go"/"stop") after every step that would send
weights, and the inference ranks read it before they wait for those weights: on "stop" they flush
their rollouts and leave. The trainer then saves w_(j+1) with batches j+1..j+k (already generated)
and every rank returns; the job exits 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from pathlib import Path

import torch
import torch.distributed as dist

from prime_spmd.config import RLJobConfig, to_json, write_resolved_config
from prime_spmd.distributed.groups import SENDS_PER_OBJECT, DistContext, init_distributed
from prime_spmd.distributed.topology import CONTROLLER_RANK
from prime_spmd.distributed.weights import WeightReceiver, WeightSender
from prime_spmd.envs.base import Environment
from prime_spmd.envs.loader import load_environment
from prime_spmd.inference.engine import InferenceEngine, SamplingParams
from prime_spmd.log import logger
from prime_spmd.models.loading import resolve_dtype
from prime_spmd.rl.loss import make_rl_loss
from prime_spmd.rl.schedule import (
    batch_after_step,
    pregenerated_batches,
    restored_batches,
    unreceived_batches_bound,
    version_of_batch,
)
from prime_spmd.trainer.build import build_trainer, prepare_model_dir, set_threads, strip_prefix
from prime_spmd.trainer.checkpoint import Checkpointer, full_state_dict, latest_checkpoint, save_hf
from prime_spmd.trainer.packing import pack
from prime_spmd.trainer.rl_data import Batch, rollouts_to_samples
from prime_spmd.trainer.step import router_metrics, train_step
from prime_spmd.trainer.stop import SkipGuard, StopSignal

BUFFER_FILE = "rollout_buffer.pkl"


def sampling_params(cfg: RLJobConfig) -> SamplingParams:
    s = cfg.sampling
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, max_tokens=s.max_tokens
    )


def batch_example_ids(cfg: RLJobConfig, env: Environment, b: int, engine_index: int, num_engines: int) -> list[int]:
    """Prompts of batch b served by one engine: a contiguous share of the batch's prompt ids."""
    p = cfg.rollout.prompts_per_step
    n = env.num_examples("train")
    ids = [(b * p + i) % n for i in range(p)]
    return ids[engine_index * p // num_engines : (engine_index + 1) * p // num_engines]


def batch_seed(seed: int, b: int) -> int:
    """The seed batch b's requests derive from: (run seed, batch), so a prompt revisited in a later batch
    (the dataset wrapped around) gets new sampling noise, and a resumed run regenerates batch b exactly."""
    digest = hashlib.blake2b(f"rl/{seed}/batch/{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generate_share(
    cfg: RLJobConfig,
    env: Environment,
    engine: InferenceEngine,
    b: int,
    version: int,
    engine_index: int,
    num_engines: int,
) -> Batch:
    """Generate and score this engine's share of batch b with weights version ``version`` (the schedule's).

    Raises ``RuntimeError`` when the engine holds another version (a weight update that did not arrive,
    or arrived twice); every rollout carries the version the engine reported.
    """
    assert version == version_of_batch(b, cfg.rollout.max_async), (b, version)
    if engine.weights_version != version:
        raise RuntimeError(
            f"batch {b}: the engine holds weights version {engine.weights_version}, but the schedule generates "
            f"it with version {version} (max_async {cfg.rollout.max_async})"
        )
    t0 = time.perf_counter()
    ids = batch_example_ids(cfg, env, b, engine_index, num_engines)
    seed = batch_seed(cfg.trainer.seed, b)
    groups = env.run_groups(engine, "train", ids, cfg.rollout.group_size, sampling_params(cfg), seed)
    assert engine.weights_version == version, "weights changed during generation"
    for g in groups:
        for r in g:
            r.policy_version = engine.weights_version
    return Batch(index=b, groups=groups, gen_time_s=time.perf_counter() - t0)


def merge(parts: list[Batch]) -> Batch:
    assert len({p.index for p in parts}) == 1, [p.index for p in parts]
    return Batch(
        index=parts[0].index,
        groups=[g for p in parts for g in p.groups],
        gen_time_s=max(p.gen_time_s for p in parts),
    )


def _attempt() -> str:
    # torchrun's agent store outlives a worker restart: key the per-run flags by attempt
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _go_key(j: int) -> str:
    """Store key the controller sets after step j in disjoint mode: b"go" or b"stop"."""
    return f"rl/{_attempt()}/go/{j}"


def bridge_timeout_s(cfg: RLJobConfig) -> float:
    """Watchdog of the cross-role bridges: --topology.bridge_timeout_s, or (0) --topology.timeout_s plus
    1 s per --sampling.max_tokens token, since a controller waits on the bridge for a whole generation."""
    return cfg.topology.bridge_timeout_s or cfg.topology.timeout_s + 1.0 * cfg.sampling.max_tokens


def _stop_request_key() -> str:
    """Store key an inference rank sets when it got SIGTERM/SIGINT (the controller checks it each step)."""
    return f"rl/{_attempt()}/stop_request"


def _start_step(ctx: DistContext, cfg: RLJobConfig) -> int:
    """Global rank 0 decides where the run starts; everyone reads it from the TCPStore."""
    key = "rl/start_step"
    if ctx.topo.rank == 0:
        latest = latest_checkpoint(cfg.output_dir) if cfg.ckpt.resume else None
        if cfg.ckpt.resume and latest is None:
            logger.warning(f"--ckpt.resume: no complete checkpoint in {cfg.output_dir}/checkpoints; starting at 0")
        ctx.store.set(key, str(json.loads((latest / "state.json").read_text())["step"] if latest else 0))
    return int(ctx.store.get(key).decode())


class _InferenceLoop:
    """Disjoint-mode inference rank: receive weights, generate, send rollouts (engine leader)."""

    def __init__(
        self, cfg: RLJobConfig, ctx: DistContext, env: Environment, engine: InferenceEngine, stop: StopSignal
    ) -> None:
        self.cfg, self.ctx, self.env, self.engine, self.stop = cfg, ctx, env, engine, stop
        self.stop_posted = False

    def run(self, start: int) -> None:
        cfg, ctx, topo = self.cfg, self.ctx, self.ctx.topo
        k, n = cfg.rollout.max_async, cfg.trainer.max_steps
        bridge = ctx.weight_bridge
        assert bridge is not None
        spec = bridge.broadcast_object(None, src=CONTROLLER_RANK, device=ctx.device)
        receiver = WeightReceiver(spec, cfg.inference.weight_bucket_mb << 20, self.engine, ctx.device)
        receiver.recv(bridge)  # w_start
        for b in pregenerated_batches(start, k, n):
            self._generate_and_send(b, version_of_batch(b, k))
        for j in range(start, n):
            b = batch_after_step(j, k, n)
            if b is None:
                continue
            if self.stop.requested and not self.stop_posted:
                ctx.store.set(_stop_request_key(), "1")
                self.stop_posted = True
            if ctx.store.get(_go_key(j)) == b"stop":  # blocks until the controller finished step j
                logger.info(f"[rank {topo.rank}] the controller stopped the run after step {j}; leaving")
                break
            receiver.recv(bridge)  # w_(j+1)
            self._generate_and_send(b, j + 1)
        if ctx.data_bridge is not None:
            ctx.data_bridge.wait_sends()

    def _generate_and_send(self, b: int, version: int) -> None:
        topo = self.ctx.topo
        batch = generate_share(self.cfg, self.env, self.engine, b, version, topo.engine_index, topo.num_engines)
        if topo.is_engine_leader:
            bridge = self.ctx.data_bridge
            assert bridge is not None
            bridge.isend_object(batch, dst=CONTROLLER_RANK)
            # Release the batches the controller has certainly received (waiting on them returns at
            # once), so host memory stays flat over the run instead of holding every batch sent.
            bridge.wait_sends(keep_newest=SENDS_PER_OBJECT * unreceived_batches_bound(self.cfg.rollout.max_async))


class _TrainerLoop:
    """Trainer rank (and, on global rank 0, the controller); in colocated mode also an inference rank."""

    def __init__(
        self, cfg: RLJobConfig, ctx: DistContext, env: Environment, engine: InferenceEngine | None, stop: StopSignal
    ) -> None:
        self.cfg, self.ctx, self.env, self.engine, self.stop = cfg, ctx, env, engine, stop
        self.guard = SkipGuard(cfg.trainer.max_skipped_steps)
        self.stop_agreed = False
        self.topo = ctx.topo
        self.colocated = self.topo.mode == "colocated"
        self.out = Path(cfg.output_dir)
        self.parts = build_trainer(cfg.model, cfg.trainer, cfg.optim, ctx)
        wire = resolve_dtype(cfg.model.dtype, ctx.device)
        self.sender = WeightSender(self.parts.policy.lm, wire, cfg.inference.weight_bucket_mb << 20, self.topo.rank)
        self.ckpt = Checkpointer(self.out, cfg.ckpt.keep_last, self.topo.trainer_rank)
        self.loss_fn = make_rl_loss(cfg.loss)
        self.buffer: dict[int, Batch] = {}
        self.sink = None
        if self.topo.is_controller:
            from prime_spmd.metrics import MetricsSink

            self.sink = MetricsSink(
                self.out, cfg.log, enabled=True, run_name=self.out.name, config=json.loads(to_json(cfg))
            )

    # ---- weights and batches ----------------------------------------------------------------
    def sync_weights(self, version: int) -> tuple[float, float]:
        """Send weights ``version``; collective over trainer ranks (+ the weight bridge in disjoint mode).

        Returns (wait s, transfer s): in disjoint mode the broadcast cannot complete before every inference
        rank finished the batch it is generating and posted its receive; the trainer idles for that wait
        (docs/architecture.md), which ``WeightSender.send`` times apart from the transfer.
        """
        if self.colocated:
            assert self.engine is not None
            return 0.0, self.sender.copy_to(self.engine, version)
        return self.sender.send(self.ctx.weight_bridge, self.ctx.device, version)

    def generate_colocated(self, b: int, version: int) -> None:
        """Every rank generates its share of batch b; the controller gathers them (default group)."""
        assert self.engine is not None
        share = generate_share(self.cfg, self.env, self.engine, b, version, self.topo.rank, self.topo.world_size)
        parts = [None] * self.topo.world_size if self.topo.is_controller else None
        dist.gather_object(share, parts, dst=CONTROLLER_RANK)
        if self.topo.is_controller:
            self.buffer[b] = merge(parts)  # type: ignore[arg-type]

    def take_batch(self, j: int) -> tuple[Batch, float]:
        """Controller: batch j from the buffer, else received from every engine leader. Returns (batch, wait s)."""
        t0 = time.perf_counter()
        while j not in self.buffer:
            self._receive_next()
        return self.buffer.pop(j), time.perf_counter() - t0

    def _receive_next(self) -> None:
        bridge = self.ctx.data_bridge
        assert bridge is not None and not self.colocated
        parts = [bridge.recv_object(src) for src in self.topo.engine_leaders]
        batch = merge(parts)
        self.buffer[batch.index] = batch

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, start: int) -> dict[str, float]:
        cfg, topo = self.cfg, self.topo
        k, n = cfg.rollout.max_async, cfg.trainer.max_steps
        if start:
            self._restore(start)
        if self.sink is not None:
            self.sink.truncate_from(start)
        if not self.colocated and topo.is_controller:
            assert self.ctx.weight_bridge is not None
            self.ctx.weight_bridge.broadcast_object(self.sender.spec, src=CONTROLLER_RANK, device=self.ctx.device)
        self.sync_weights(start)  # w_start
        if self.colocated:
            for b in pregenerated_batches(start, k, n):
                self.generate_colocated(b, version_of_batch(b, k))
        from prime_spmd.progress import Progress

        bar = Progress(total=n - start, desc="rl", enabled=topo.is_controller and cfg.log.progress)
        last: dict[str, float] = {}
        for j in range(start, n):
            last = self.step(j)
            bar.update(1, reward=last.get("reward_mean", 0.0))
            done = j + 1
            if self.stop_agreed and done < n:
                path = self.save(done)
                bar.close()
                logger.info(
                    f"stopped by {self.stop.signal_name or 'a signal on another rank'} after {done} steps: "
                    f"checkpoint saved to {path}; continue with --ckpt.resume"
                )
                if self.sink is not None:
                    self.sink.close()
                return last
            if cfg.ckpt.interval_steps and done % cfg.ckpt.interval_steps == 0 and done < n:
                self.save(done)
        bar.close()
        if start < n:
            self.save(n)
        self.finish()
        return last

    def step(self, j: int) -> dict[str, float]:
        cfg, topo = self.cfg, self.topo
        k, n = cfg.rollout.max_async, cfg.trainer.max_steps
        t_step = time.perf_counter()
        per_rank, bm, wait, forward_tokens = None, {}, 0.0, 0
        if topo.is_controller:
            batch, wait = self.take_batch(j)
            samples, bm = rollouts_to_samples(batch, cfg.rollout, cfg.sampling.max_tokens, cfg.trainer.seq_len)
            bm["policy_lag_mean"] = float(j) - sum(r.policy_version for g in batch.groups for r in g) / max(
                1, sum(len(g) for g in batch.groups)
            )
            bm["policy_lag_max"] = float(j) - bm.pop("policy_version_min")
            per_rank = pack(samples, cfg.trainer.micro_batch_tokens, topo.num_trainer_ranks)
            forward_tokens = sum(mb.num_tokens for mbs in per_rank for mb in mbs)
        mine = [None]
        dist.scatter_object_list(mine, per_rank, src=CONTROLLER_RANK)
        stop_requested = self.stop.requested
        if topo.is_controller and not self.colocated:
            stop_requested = stop_requested or self.ctx.store.check([_stop_request_key()])
        t_train = time.perf_counter()
        stats = train_step(
            self.parts.policy,
            self.parts.optimizer,
            self.parts.scheduler,
            mine[0],
            self.loss_fn,
            device=self.ctx.device,
            temperature=max(cfg.sampling.temperature, 1e-6) if cfg.sampling.temperature > 0 else 1.0,
            max_grad_norm=cfg.optim.max_grad_norm,
            stop_requested=stop_requested,
        )
        self.stop_agreed = stats["stop"] > 0 and j + 1 < n
        train_s = time.perf_counter() - t_train
        sync_wait_s, sync_s, gen_s = 0.0, 0.0, 0.0
        b = batch_after_step(j, k, n)
        try:
            self.guard.update(j, stats["nonfinite"] > 0)
        finally:  # on a guard failure too, the inference ranks leave instead of waiting for weights
            if b is not None and topo.is_controller and not self.colocated:
                failed = self.guard.max_skipped_steps and self.guard.in_a_row >= self.guard.max_skipped_steps
                self.ctx.store.set(_go_key(j), "stop" if self.stop_agreed or failed else "go")
        if b is not None and not self.stop_agreed:
            sync_wait_s, sync_s = self.sync_weights(j + 1)
            if self.colocated:
                t0 = time.perf_counter()
                self.generate_colocated(b, j + 1)
                gen_s = time.perf_counter() - t0
        if not topo.is_controller:
            return {}
        step_s = time.perf_counter() - t_step
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
            "forward_tokens": float(forward_tokens),
            "skipped_steps": stats["skipped"],
            "nonfinite_steps": stats["nonfinite"],
            "empty_batch": stats["empty_batch"],
            "train_time_s": train_s,
            "weight_sync_s": sync_s,
            "weight_sync_wait_s": sync_wait_s,
            "wait_s": wait,
            "step_time_s": step_s,
            "gen_tokens_per_s": bm["generated_tokens"] / step_s,
            **router_metrics(stats),
        }
        if self.colocated:
            m["gen_time_s"] = gen_s or bm["gen_time_s"]
        if self.ctx.device.type == "cuda":  # this rank's peak since the job started (model, optimizer, engine)
            m["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.ctx.device) / 2**30
        assert self.sink is not None
        if self.sink.should_log(j, last=j == n - 1 or self.stop_agreed):
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
                self._receive_next()
            blobs = {BUFFER_FILE: pickle.dumps({b: self.buffer[b] for b in need})}
        state = {"step": step, "scheduler": self.parts.scheduler.state_dict()}
        return self.ckpt.save(step, self.parts.policy, self.parts.optimizer, state, blobs)

    def _restore(self, start: int) -> None:
        path = self.ckpt.latest()
        assert path is not None and int(path.name[5:]) == start, (path, start)
        state = self.ckpt.load(path, self.parts.policy, self.parts.optimizer)
        self.parts.scheduler.load_state_dict(state["scheduler"])
        if self.topo.is_controller:
            self.buffer.update(pickle.loads((path / BUFFER_FILE).read_bytes()))

    def finish(self) -> None:
        if self.cfg.ckpt.save_hf:
            sd = strip_prefix(full_state_dict(self.parts.policy))
            if self.topo.is_controller:
                hf = save_hf(self.parts.policy.lm, sd, self.out / "hf", self.parts.tokenizer)
                logger.info(f"HF-format weights written to {hf}")
        if self.sink is not None:
            self.sink.close()
            if self.cfg.log.plots:
                from prime_spmd.plots import plot_run

                plot_run(self.out)


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
    out = Path(cfg.output_dir)
    if topo.rank == 0:
        write_resolved_config(cfg, out)
    prepare_model_dir(cfg.model, ctx, cfg.trainer.seed)
    env = load_environment(cfg.env)
    engine = None
    if topo.is_inference:
        from prime_spmd.inference.factory import build_engine

        if cfg.inference.engine == "native" and topo.engine_tp > 1:
            raise ValueError("--topology.engine_tp > 1 needs --inference.engine=vllm (the native engine runs tp 1)")
        engine = build_engine(
            cfg.inference, cfg.model, ctx.device, cfg.trainer.seq_len, tp=topo.engine_tp, seed=cfg.trainer.seed
        )
    start = _start_step(ctx, cfg)
    result: dict[str, float] = {}
    if topo.is_trainer:
        result = _TrainerLoop(cfg, ctx, env, engine, stop).run(start)
    else:
        assert engine is not None
        _InferenceLoop(cfg, ctx, env, engine, stop).run(start)
    if engine is not None and hasattr(engine, "close"):
        engine.close()  # vLLM: its teardown needs the process groups that ctx.close destroys
    ctx.close()
    return result
