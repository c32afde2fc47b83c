"""The disjoint-mode inference rank's loop: receive weights, generate the batch the schedule says, send
its rollouts to the controller (engine leader, asynchronously), repeat.

Before each wait for weights it reads the controller's go/stop decision (rl/stop_go.py), and it
passes its own SIGTERM/SIGINT on to the controller the same way.
"""

from __future__ import annotations

from prime_spmd.config import RLJobConfig
from prime_spmd.distributed.groups import SENDS_PER_OBJECT, DistContext
from prime_spmd.distributed.topology import CONTROLLER_RANK
from prime_spmd.envs.base import Environment
from prime_spmd.inference.engine import InferenceEngine
from prime_spmd.log import logger
from prime_spmd.rl import stop_go
from prime_spmd.rl.generate import generate_share
from prime_spmd.rl.schedule import batch_after_step, pregenerated_batches, unreceived_batches_bound, version_of_batch
from prime_spmd.sync.weights import WeightReceiver
from prime_spmd.trainer.stop import StopSignal


class InferenceLoop:
    """Disjoint-mode inference rank: receive weights, generate, send rollouts (engine leader)."""

    def __init__(
        self, cfg: RLJobConfig, ctx: DistContext, env: Environment, engine: InferenceEngine, stop: StopSignal
    ) -> None:
        self.cfg, self.ctx, self.env, self.engine, self.stop = cfg, ctx, env, engine, stop
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
        for j in range(start, n):
            b = batch_after_step(j, k, n)
            if b is None:
                continue
            if self.stop.requested and not self.stop_posted:
                stop_go.request_stop(ctx.store)
                self.stop_posted = True
            if not stop_go.wait_go(ctx.store, j):  # blocks until the controller finished step j
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
