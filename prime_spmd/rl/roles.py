"""How a trainer rank's RL loop reaches the engines: ``Colocated`` or ``Disjoint``, chosen once by the topology.

Both answer the same questions for ``rl/loop.py``, so the loop has no mode branches:

- ``start``: what the engines need once before the first weight sync (the weight spec, disjoint);
- ``sync_weights``: how weights version ``v`` reaches the engine (an in-process copy into this rank's engine,
  or a bucketed broadcast over the weight bridge; ``sync/weights.py``);
- ``produce``: who generates batch b once the engines hold its weights (this rank generates its share and
  the controller gathers them over the default group, or the inference ranks generate it, ``rl/inference_loop.py``);
  the controller's plan of the batch (rl/mixture.py) goes to the generating ranks (a broadcast over the default
  group, or a store key the inference ranks read);
- ``evaluate``: every environment's eval split with weights ``v`` (here, gathered to the controller; or on the
  inference ranks, whose results arrive with the batches);
- ``receive``: how the controller gets a batch it does not hold yet (only disjoint: over the data bridge);
  eval results that come with it go to ``evals``;
- ``stop_requested`` / ``post_go``: the stop/go protocol with the inference ranks (only disjoint, ``rl/stop_go.py``);
- ``before_train``: what happens right before each optimizer step (colocated, with
  ``--inference.native.release_kv_cache``: the engine's KV cache is released for the trainer's activations).
"""

from __future__ import annotations

import json
import time

import torch.distributed as dist

from prime_spmd.config import RLJobConfig
from prime_spmd.distributed.groups import DistContext
from prime_spmd.distributed.topology import CONTROLLER_RANK
from prime_spmd.inference.engine import InferenceEngine
from prime_spmd.rl import stop_go
from prime_spmd.rl.generate import eval_share, generate_share, merge, merge_evals
from prime_spmd.rl.mixture import EnvSlot, Plan
from prime_spmd.rl.types import Batch, EvalShare
from prime_spmd.sync.weights import WeightSender


class _RoleState:
    """What both roles hold: the job config, the rank's dist context and topology, the environments, this
    rank's engine (colocated; None when disjoint), the weight sender, and the eval results not yet logged."""

    runs_engine: bool  # whether a trainer rank of this mode runs its own engine

    def __init__(
        self,
        cfg: RLJobConfig,
        ctx: DistContext,
        envs: list[EnvSlot],
        engine: InferenceEngine | None,
        sender: WeightSender,
    ) -> None:
        assert (engine is not None) == self.runs_engine, f"{ctx.topo.mode}: engine on a trainer rank is {engine}"
        self.cfg, self.ctx, self.envs, self.engine, self.sender, self.topo = cfg, ctx, envs, engine, sender, ctx.topo
        self.evals: list[EvalShare] = []


class Colocated(_RoleState):
    """Every rank trains and runs its own engine: weights are copied in-process, each rank generates its share
    of a batch and the controller gathers the shares over the default group. No bridges, no stop/go keys."""

    runs_engine = True
    engine: InferenceEngine

    def start(self) -> None:
        """Nothing to send before the first sync: the engine is in this process."""

    def sync_weights(self, version: int) -> tuple[float, float]:
        """Copy the trainer's weights into this rank's engine as ``version`` (collective over the trainer
        ranks). Returns (wait s, copy s); nothing waits here."""
        return 0.0, self.sender.copy_to(self.engine, version)

    def produce(self, b: int, version: int, buffer: dict[int, Batch], plan: Plan | None = None) -> float:
        """Every rank generates its share of batch b with ``version`` and the controller's ``plan`` (broadcast
        from it); the controller gathers the shares into ``buffer`` (collectives over the default group).
        Returns the seconds it took."""
        t0 = time.perf_counter()
        topo = self.topo
        box = [plan]
        dist.broadcast_object_list(box, src=CONTROLLER_RANK)
        share = generate_share(self.cfg, self.envs, self.engine, b, version, topo.rank, topo.world_size, box[0])
        parts = [None] * topo.world_size if topo.is_controller else None
        dist.gather_object(share, parts, dst=CONTROLLER_RANK)
        if topo.is_controller:
            buffer[b] = merge(parts)  # type: ignore[arg-type]
        return time.perf_counter() - t0

    def evaluate(self, version: int) -> float:
        """Every rank runs its share of the eval splits with w_version (copied in first when the engine holds
        older weights; collective over the trainer ranks); the controller appends the result to ``evals``.
        Returns the seconds it took."""
        t0 = time.perf_counter()
        topo = self.topo
        if self.engine.weights_version != version:
            self.sync_weights(version)
        share = eval_share(self.cfg, self.envs, self.engine, version, topo.rank, topo.world_size)
        parts = [None] * topo.world_size if topo.is_controller else None
        dist.gather_object(share, parts, dst=CONTROLLER_RANK)
        if topo.is_controller:
            self.evals.append(merge_evals(parts))  # type: ignore[arg-type]
        return time.perf_counter() - t0

    def receive(self, buffer: dict[int, Batch]) -> None:
        raise AssertionError("colocated: every batch is in the controller's buffer once produced")

    def before_train(self) -> None:
        """With ``--inference.native.release_kv_cache``: release the engine's KV cache (and the graphs holding its
        addresses) so the trainer's step can use that memory; the engine's next step allocates it again. Here, right
        before a step, and not after each generation: batches generated back to back (max_async's first ones, an eval
        after a batch) would release and recapture between them, and an eval's cache would stay through the step."""
        release = getattr(self.engine, "release_memory", None)
        if release is not None and self.cfg.inference.native.release_kv_cache:
            release()

    def stop_requested(self) -> bool:
        """No inference rank outside the trainer group can ask to stop."""
        return False

    def post_go(self, j: int, go: bool) -> None:
        """No inference rank waits for the go/stop key."""


class Disjoint(_RoleState):
    """Trainer ranks and inference ranks are different processes: weights go over the weight bridge, batches
    come from the engine leaders over the data bridge, and the controller runs the stop/go protocol."""

    runs_engine = False

    def start(self) -> None:
        """The controller sends the weight spec once; every inference rank builds its ``WeightReceiver`` from it."""
        if self.topo.is_controller:
            assert self.ctx.weight_bridge is not None
            self.ctx.weight_bridge.broadcast_object(self.sender.spec, src=CONTROLLER_RANK, device=self.ctx.device)

    def sync_weights(self, version: int) -> tuple[float, float]:
        """Broadcast weights ``version`` over the weight bridge (collective over the trainer ranks and the bridge).

        Returns (wait s, transfer s): the broadcast cannot complete before every inference rank finished the
        batch it is generating and posted its receive; the trainer idles for that wait (docs/architecture.md),
        which ``WeightSender.send`` times apart from the transfer."""
        return self.sender.send(self.ctx.weight_bridge, self.ctx.device, version)

    def produce(self, b: int, version: int, buffer: dict[int, Batch], plan: Plan | None = None) -> float:
        """The inference ranks generate batch b (``InferenceLoop``); the controller posts its ``plan`` under
        ``stop_go.plan_key(b)`` for them. 0 s."""
        if self.topo.is_controller and plan is not None:
            self.ctx.store.set(stop_go.plan_key(b), json.dumps(plan))
        return 0.0

    def evaluate(self, version: int) -> float:
        """The inference ranks evaluate w_version after generating that step's batch; the results arrive
        through ``receive``. 0 s."""
        return 0.0

    def before_train(self) -> None:
        """Nothing: the engines are in other processes."""

    def receive(self, buffer: dict[int, Batch]) -> None:
        """Controller: the next batch (or eval result, into ``evals``) from every engine leader's share (blocks on
        the data bridge)."""
        bridge = self.ctx.data_bridge
        assert bridge is not None
        parts = [bridge.recv_object(src) for src in self.topo.engine_leaders]
        if isinstance(parts[0], EvalShare):
            self.evals.append(merge_evals(parts))
            return
        batch = merge(parts)
        buffer[batch.index] = batch

    def stop_requested(self) -> bool:
        """Controller: whether an inference rank asked to stop (store key, does not block)."""
        return self.topo.is_controller and stop_go.stop_was_requested(self.ctx.store)

    def post_go(self, j: int, go: bool) -> None:
        """Controller, after step j: tell the inference ranks whether w_(j+1) follows."""
        if self.topo.is_controller:
            stop_go.post_go(self.ctx.store, j, go=go)


Role = Colocated | Disjoint


def make_role(
    cfg: RLJobConfig, ctx: DistContext, envs: list[EnvSlot], engine: InferenceEngine | None, sender: WeightSender
) -> Role:
    """The trainer rank's role for the topology's mode (``--topology.mode``, resolved by ``plan_topology``)."""
    return {"colocated": Colocated, "disjoint": Disjoint}[ctx.topo.mode](cfg, ctx, envs, engine, sender)
