"""The engine reports the weights version it holds; the schedule's version is checked against it (issue 15.7).

Also: weight-sync time includes the device work (CUDA sync), and the bridge watchdog scales with the
generation length (or is set by --topology.bridge_timeout_s).
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from prime_spmd.config import RLJobConfig
from prime_spmd.config.sections import RLTopologyConfig, SamplingConfig
from prime_spmd.distributed.groups import Bridge
from prime_spmd.envs.rollout import Rollout
from prime_spmd.rl import loop as rl_loop
from prime_spmd.rl.generate import generate_share
from prime_spmd.sync.weights import WeightReceiver, WeightSender
from tests.fakes import WeightHoldingEngine


def _lm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))


def test_copy_and_broadcast_set_the_engine_version() -> None:
    lm, engine = _lm(), WeightHoldingEngine()
    sender = WeightSender(lm, torch.float32, 64, rank=0)  # 64-byte buckets: several per sync
    assert len(sender.buckets) > 1
    sender.copy_to(engine, version=3)
    assert engine.weights_version == 3 and torch.equal(engine.loaded["1.weight"], lm[1].weight)

    store, errors, receiver_engine = dist.HashStore(), [], WeightHoldingEngine()

    def member(rank: int) -> None:
        try:
            bridge = Bridge("weights", store, [0, 1], rank, "gloo", timedelta(seconds=60))
            if rank == 0:
                sender.send(bridge, torch.device("cpu"), version=7)
            else:
                receiver = WeightReceiver(sender.spec, 64, receiver_engine, torch.device("cpu"))
                receiver.recv(bridge)
        except Exception as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert receiver_engine.weights_version == 7  # the version the trainer sent, not a local count
    assert torch.equal(receiver_engine.loaded["0.bias"], lm[0].bias)


class _Env:
    def num_examples(self, split: str) -> int:
        return 4

    def run_groups(self, engine, split, ids, group_size, sampling, seed) -> list[list[Rollout]]:
        return [
            [
                Rollout(
                    example_id=i,
                    sample_idx=0,
                    prompt_ids=[1],
                    completion_ids=[2],
                    completion_mask=[1],
                    inference_logprobs=[-1.0],
                    reward=1.0,
                )
            ]
            for i in ids
        ]


def test_generation_checks_the_engine_version_against_the_schedule() -> None:
    cfg = RLJobConfig()
    cfg.rollout.prompts_per_step, cfg.rollout.max_async, cfg.rollout.group_size = 2, 1, 1
    engine = WeightHoldingEngine()
    engine.weights_version = 2
    batch = generate_share(cfg, _Env(), engine, b=3, version=2, engine_index=0, num_engines=1)
    assert {r.policy_version for g in batch.groups for r in g} == {2}
    engine.weights_version = 1  # e.g. a weight update that never arrived
    with pytest.raises(RuntimeError, match=r"batch 3.*weights version 1.*schedule.*2"):
        generate_share(cfg, _Env(), engine, b=3, version=2, engine_index=0, num_engines=1)


def test_sync_time_waits_for_the_device(monkeypatch) -> None:
    from prime_spmd.sync import weights

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    weights.elapsed_s(0.0, torch.device("cpu"))
    assert synced == []
    weights.elapsed_s(0.0, torch.device("cuda", 1))
    assert synced == [torch.device("cuda", 1)]


def test_bridge_timeout_scales_with_generation_length() -> None:
    short = RLJobConfig(sampling=SamplingConfig(max_tokens=64))
    long = RLJobConfig(sampling=SamplingConfig(max_tokens=32768))
    assert rl_loop.bridge_timeout_s(short) >= short.topology.timeout_s
    assert rl_loop.bridge_timeout_s(long) >= long.topology.timeout_s + 32768 * 0.5
    fixed = RLJobConfig(topology=RLTopologyConfig(bridge_timeout_s=90000), sampling=SamplingConfig(max_tokens=32768))
    assert rl_loop.bridge_timeout_s(fixed) == 90000
    with pytest.raises(ValueError, match="topology.bridge_timeout_s"):
        RLTopologyConfig(bridge_timeout_s=-1)
