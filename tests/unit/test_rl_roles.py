"""The RL loop's roles (rl/roles.py): one type per topology mode, chosen once, with the same methods."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from prime_spmd.config import RLJobConfig
from prime_spmd.rl import stop_go
from prime_spmd.rl.roles import Colocated, Disjoint, make_role
from prime_spmd.sync.weights import WeightSender
from tests.fakes import WeightHoldingEngine


def _ctx(mode: str, is_controller: bool) -> SimpleNamespace:
    topo = SimpleNamespace(mode=mode, is_controller=is_controller, rank=0 if is_controller else 1, world_size=2)
    return SimpleNamespace(topo=topo, store=dist.HashStore(), device=torch.device("cpu"), weight_bridge=None)


def _sender() -> tuple[nn.Module, WeightSender]:
    torch.manual_seed(0)
    lm = nn.Linear(4, 3)
    return lm, WeightSender(lm, torch.float32, 1 << 20, rank=0)


def test_make_role_picks_the_type_of_the_topology_mode() -> None:
    cfg = RLJobConfig()
    _, sender = _sender()
    assert isinstance(make_role(cfg, _ctx("colocated", True), None, WeightHoldingEngine(), sender), Colocated)
    assert isinstance(make_role(cfg, _ctx("disjoint", True), None, None, sender), Disjoint)
    with pytest.raises(AssertionError):  # a disjoint trainer rank runs no engine, a colocated one always does
        make_role(cfg, _ctx("disjoint", True), None, WeightHoldingEngine(), sender)
    with pytest.raises(AssertionError):
        make_role(cfg, _ctx("colocated", True), None, None, sender)


def test_colocated_copies_weights_in_process_and_has_no_stop_go() -> None:
    lm, sender = _sender()
    engine, ctx = WeightHoldingEngine(), _ctx("colocated", True)
    role = Colocated(RLJobConfig(), ctx, None, engine, sender)
    role.start()
    wait_s, copy_s = role.sync_weights(4)
    assert wait_s == 0.0 and copy_s >= 0.0
    assert engine.weights_version == 4 and torch.equal(engine.loaded["weight"], lm.weight)
    assert not role.stop_requested()
    role.post_go(0, go=False)  # nobody waits for it: no key written
    assert not ctx.store.check([stop_go.go_key(0)])
    with pytest.raises(AssertionError):
        role.receive({})


@pytest.mark.parametrize("is_controller", [True, False])
def test_disjoint_runs_the_stop_go_protocol_on_the_controller_only(is_controller: bool) -> None:
    _, sender = _sender()
    ctx = _ctx("disjoint", is_controller)
    role = Disjoint(RLJobConfig(), ctx, None, None, sender)
    buffer: dict = {}
    assert role.produce(3, 2, buffer) == 0.0 and buffer == {}  # the inference ranks generate it
    assert not role.stop_requested()
    stop_go.request_stop(ctx.store)  # an inference rank got SIGTERM
    assert role.stop_requested() is is_controller
    role.post_go(5, go=False)
    assert ctx.store.check([stop_go.go_key(5)]) is is_controller
    if is_controller:
        assert not stop_go.wait_go(ctx.store, 5)


def test_max_async_default_follows_the_topology() -> None:
    """Unset, --rollout.max_async is 0 colocated (nothing overlaps a lag) and 1 disjoint; a set value stays."""
    from prime_spmd.rl.loop import resolve_max_async

    assert RLJobConfig().rollout.max_async is None
    assert resolve_max_async(None, "colocated") == 0
    assert resolve_max_async(None, "disjoint") == 1
    assert resolve_max_async(2, "colocated") == 2 and resolve_max_async(0, "disjoint") == 0
