"""The disjoint-mode inference rank's loop: receive weights, generate the batch the schedule says, send
its rollouts to the controller (engine leader, asynchronously), repeat. The batch's prompts are the
controller's plan (a store key, rl/mixture.py); after the steps ``eval_after_step`` names it also runs the
eval splits with the weights it just received and sends the result the same way.

Before each wait for weights it reads the controller's go/stop decision (rl/stop_go.py), and it
passes its own SIGTERM/SIGINT on to the controller the same way.
"""

from __future__ import annotations

import json

from prime_spmd.config import RLJobConfig
from prime_spmd.distributed.groups import SENDS_PER_OBJECT, DistContext
from prime_spmd.distributed.topology import CONTROLLER_RANK
from prime_spmd.inference.engine import InferenceEngine
from prime_spmd.log import logger
from prime_spmd.rl import stop_go
from prime_spmd.rl.generate import eval_share, generate_share
from prime_spmd.rl.mixture import EnvSlot
from prime_spmd.rl.schedule import (
    batch_after_step,
    eval_after_step,
    eval_at_start,
    pregenerated_batches,
    unreceived_batches_bound,
    version_of_batch,
    weights_after_step,
)
from prime_spmd.sync.weights import WeightReceiver
from prime_spmd.trainer.stop import StopSignal


class InferenceLoop:
    """Disjoint-mode inference rank: receive weights, generate, send rollouts (engine leader)."""

    def __init__(
        self, cfg: RLJobConfig, ctx: DistContext, envs: list[EnvSlot], engine: InferenceEngine, stop: StopSignal
    ) -> None:
        self.cfg, self.ctx, self.envs, self.engine, self.stop = cfg, ctx, envs, engine, stop
        self.stop_posted = False

    def run(self, start: int) -> None:
        """Every inference rank calls this; collective over the weight bridge, sends over the data bridge."""
        cfg, ctx, topo = self.cfg, self.ctx, self.ctx.topo
        k, n = cfg.rollout.max_async, cfg.trainer.max_steps
        bridge = ctx.weight_bridge
        assert bridge is not None
        spec = bridge.broadcast_object(None, src=CONTROLLER_RANK, device=ctx.device)
        receiver = WeightReceiver(spec, cfg.inference.weight_bucket_mb << 20, self.engine, ctx.device)
        receiver.recv(bridge)  # w_start
        for b in pregenerated_batches(start, k, n):
            self._generate_and_send(b, version_of_batch(b, k))
        if eval_at_start(start, cfg.eval.interval_steps):
            self._send(eval_share(cfg, self.envs, self.engine, start, topo.engine_index, topo.num_engines))
        for j in range(start, n):
            b = batch_after_step(j, k, n)
            evaluate = eval_after_step(j, cfg.eval.interval_steps, cfg.eval.final, n)
            if not weights_after_step(j, k, n, evaluate):
                continue
            if self.stop.requested and not self.stop_posted:
                stop_go.request_stop(ctx.store)
                self.stop_posted = True
            if not stop_go.wait_go(ctx.store, j):  # blocks until the controller finished step j
                logger.info(f"[rank {topo.rank}] the controller stopped the run after step {j}; leaving")
                break
            receiver.recv(bridge)  # w_(j+1)
            if b is not None:
                self._generate_and_send(b, j + 1)
            if evaluate:
                self._send(eval_share(cfg, self.envs, self.engine, j + 1, topo.engine_index, topo.num_engines))
        if ctx.data_bridge is not None:
            ctx.data_bridge.wait_sends()

    def _generate_and_send(self, b: int, version: int) -> None:
        topo = self.ctx.topo
        plan = json.loads(self.ctx.store.get(stop_go.plan_key(b)).decode())
        self._send(
            generate_share(self.cfg, self.envs, self.engine, b, version, topo.engine_index, topo.num_engines, plan)
        )

    def _send(self, batch: object) -> None:
        """Engine leader: send a batch or an eval share to the controller (asynchronously)."""
        topo = self.ctx.topo
        if topo.is_engine_leader:
            bridge = self.ctx.data_bridge
            assert bridge is not None
            bridge.isend_object(batch, dst=CONTROLLER_RANK)
            # Release the batches the controller has certainly received (waiting on them returns at
            # once), so host memory stays flat over the run instead of holding every batch sent.
            bridge.wait_sends(keep_newest=SENDS_PER_OBJECT * unreceived_batches_bound(self.cfg.rollout.max_async))
