"""Per-role default process groups and the explicit cross-role bridges.

vLLM's ``external_launcher`` takes the whole default process group as its world, so each role gets
its own default group: trainer ranks init one over the trainer ranks, inference ranks one over the
inference ranks (both rendezvous through the torchrun master's TCPStore, under different
prefixes). Traffic between roles goes over two bridges, built as standalone backends on the same
store, never through the default group:

- the *weight bridge* (NCCL on CUDA, gloo on CPU): trainer rank 0 + every inference rank; new
  weights are broadcast from trainer rank 0 after each optimizer step;
- the *data bridge* (gloo, CPU tensors): the controller (global rank 0) + every engine leader;
  rollouts travel as pickled byte tensors, point to point.

Colocated mode has no bridges: every rank is in the one default group, weights are copied
in-process and rollouts are gathered over the default group.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from prime_spmd.config.sections import TopologyConfig
from prime_spmd.distributed.topology import CONTROLLER_RANK, Topology, plan_topology
from prime_spmd.log import logger

SENDS_PER_OBJECT = 2
"""``Bridge.isend_object`` posts two sends: the length, then the pickled bytes."""


class Bridge:
    """A standalone process group over ``members`` (global ranks), addressed by global rank.

    Built only on member ranks, at the same point in each member's program. Sends are
    asynchronous (the ``Work`` and its buffers are kept until ``wait_sends`` waits for them); receives and broadcasts block. Every op is collective among the members it names, so the schedule decides
    the order, and two bridges never wait on each other.
    """

    def __init__(self, name: str, store: dist.Store, members: list[int], rank: int, backend: str, timeout: timedelta):
        assert rank in members, f"rank {rank} is not a member of bridge {name} {members}"
        self.name, self.members, self.rank, self.backend = name, list(members), rank, backend
        prefixed = dist.PrefixStore(f"bridge/{name}", store)
        me, size = members.index(rank), len(members)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, me, size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, me, size, timeout)
        self._pending: list[tuple[Any, list[torch.Tensor]]] = []

    def _wait(self, work: Any, op: str, peer: int | None) -> None:
        """Wait for a bridge op; a failure names the bridge, the op and the peer (a hang on a bridge
        otherwise shows only gloo's "Timed out waiting ...", with no rank in it)."""
        try:
            work.wait()
        except RuntimeError as e:
            who = f"peer rank {peer}" if peer is not None else f"ranks {self.members}"
            raise RuntimeError(
                f"bridge {self.name!r} on rank {self.rank}: {op} with {who} failed (a peer died, or did not "
                "answer within --topology.bridge_timeout_s)"
            ) from e

    def _idx(self, global_rank: int) -> int:
        if global_rank not in self.members:
            raise AssertionError(f"rank {global_rank} is not in bridge {self.name} {self.members}")
        return self.members.index(global_rank)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Blocking broadcast of ``tensor`` (in place on receivers) from global rank ``src``; all members call it."""
        opts = dist.BroadcastOptions()
        opts.rootRank = self._idx(src)
        opts.rootTensor = 0
        self._wait(self.pg.broadcast([tensor], opts), f"broadcast from rank {src}", None)

    def isend(self, tensor: torch.Tensor, dst: int) -> None:
        """Asynchronous send; the tensor is kept alive until ``wait_sends`` waited for it."""
        work = self.pg.send([tensor], self._idx(dst), 0)
        self._pending.append((work, [tensor]))

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._wait(self.pg.recv([tensor], self._idx(src), 0), "recv", src)
        return tensor

    def isend_object(self, obj: Any, dst: int) -> None:
        """Pickle ``obj`` and send it (length, then bytes) to global rank ``dst`` without blocking."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.isend(torch.tensor([payload.numel()], dtype=torch.int64), dst)
        self.isend(payload, dst)

    def recv_object(self, src: int) -> Any:
        """Receive one object sent by ``isend_object`` from global rank ``src`` (blocks)."""
        size = self.recv(torch.zeros(1, dtype=torch.int64), src)
        payload = self.recv(torch.empty(int(size.item()), dtype=torch.uint8), src)
        return pickle.loads(payload.numpy().tobytes())

    def broadcast_object(self, obj: object, src: int, device: torch.device) -> object:
        """Broadcast a picklable object from global rank ``src`` (blocking; all members call it)."""
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=device)
        self.broadcast(size, src)
        if self.rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self.broadcast(payload, src)
        return obj if self.rank == src else pickle.loads(payload.cpu().numpy().tobytes())

    def num_pending_sends(self) -> int:
        """Sends whose buffers this bridge still holds (posted and not yet known to be finished)."""
        return len(self._pending)

    def pending_send_bytes(self) -> int:
        """Bytes of the buffers held for pending sends."""
        return sum(t.numel() * t.element_size() for _, ts in self._pending for t in ts)

    def wait_sends(self, keep_newest: int = 0) -> None:
        """Wait for every pending send but the newest ``keep_newest`` and release their buffers.

        A gloo send's ``Work`` reports completion only once waited on, so a sender that never waits
        holds every payload it ever sent: callers that send every step call this with a bound the
        schedule guarantees is already received (waiting on a send the peer has not yet posted a
        receive for blocks until it does). ``isend_object`` posts 2 sends per object.
        """
        assert keep_newest >= 0, keep_newest
        n = max(0, len(self._pending) - keep_newest)
        for work, _ in self._pending[:n]:
            self._wait(work, "send", None)
        del self._pending[:n]

    def close(self) -> None:
        self.wait_sends()


@dataclass
class DistContext:
    """What a rank knows about the job's process groups. Runtime object: never put in config."""

    topo: Topology
    device: torch.device
    backend: str
    store: dist.Store
    weight_bridge: Bridge | None = None
    data_bridge: Bridge | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        """End of a run, on every rank of the role: bridges, then the default group, all ranks together."""
        for b in (self.weight_bridge, self.data_bridge):
            if b is not None:
                b.close()
        if dist.is_initialized():
            # A rank that tore its group down and exited while another was still working (rank 0 writing the HF
            # folder, then its eval) died in gloo's teardown, "terminate called without an active exception",
            # in 2 of 3 CI runs of tests/distributed/test_lora_fsdp.py (2026-12-03): leave together.
            dist.barrier()
            dist.destroy_process_group()


def _device(backend_cfg: str) -> torch.device:
    if backend_cfg != "gloo" and torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return dist.HashStore()
    # env:// rendezvous connects to the torchrun agent's TCPStore (TORCHELASTIC_USE_AGENT_STORE) or,
    # without torchrun, makes rank 0 host it: the same logic init_process_group uses.
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    return store


def init_distributed(cfg: TopologyConfig, bridge_timeout_s: float | None = None) -> DistContext:
    """Plan roles from RANK/WORLD_SIZE and build this rank's default group and bridges.

    ``bridge_timeout_s`` (None: ``cfg.timeout_s``) is the bridges' watchdog: a rank waits there for the
    other role's whole step (the controller for a generation), which can outlast any collective.

    Every rank of the job calls it once, at start. Side effects: initializes the default process
    group (the role's world), sets the CUDA device.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
    topo = plan_topology(cfg, world_size, rank, local_world)
    device = _device(cfg.backend)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if cfg.backend == "nccl" and backend != "nccl":
        raise ValueError("--topology.backend=nccl needs CUDA, which is not available; use auto or gloo")
    timeout = timedelta(seconds=cfg.timeout_s)
    store = _store(rank, world_size, timeout)
    if topo.is_trainer:
        role, role_rank, role_size = "trainer", topo.trainer_rank, topo.num_trainer_ranks
    else:
        role, role_rank, role_size = "inference", topo.inference_rank, topo.num_inference_ranks
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"role/{role}", store), rank=role_rank, world_size=role_size, timeout=timeout
    )
    ctx = DistContext(topo=topo, device=device, backend=backend, store=store)
    if topo.mode == "disjoint":
        weight_members = [CONTROLLER_RANK] + topo.inference_ranks
        data_members = [CONTROLLER_RANK] + topo.engine_leaders
        bridge_timeout = timedelta(seconds=bridge_timeout_s or cfg.timeout_s)
        if rank in weight_members:
            ctx.weight_bridge = Bridge("weights", store, weight_members, rank, backend, bridge_timeout)
        if rank in data_members:
            ctx.data_bridge = Bridge("data", store, data_members, rank, "gloo", bridge_timeout)
    logger.info(
        f"topology: {topo.mode}, world {world_size}: trainer ranks {topo.trainer_ranks}, "
        f"inference ranks {topo.inference_ranks} ({topo.num_engines} engine(s) x tp {topo.engine_tp}), backend {backend}"
    )
    return ctx
