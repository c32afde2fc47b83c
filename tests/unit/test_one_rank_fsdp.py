"""The one-rank trainer's gradient path (distributed/fsdp.py): FSDP2's reduce writes into the buffer it copies from
(``OneRankReduceScatter``), and the micro-batches of a step reduce once, after the last (``set_gradient_sync``),
with gradients bit-equal to FSDP2's default path (a reduce per micro-batch into a separate output). One rank, an
in-process gloo group, bf16 compute over fp32 masters as on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from prime_spmd.distributed import fsdp


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 8))


def _grads(model: nn.Module, lean: bool) -> list[torch.Tensor]:
    """Three micro-batches' backward as train_step runs them; the sharded gradients after."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(5 + i, 24, generator=g) for i in range(3)]
    for i, x in enumerate(batches):
        if lean:
            fsdp.set_gradient_sync(model, i == len(batches) - 1)
        model(x).square().sum().backward()
    return [p.grad.to_local().clone() for p in model.parameters()]


@pytest.fixture
def one_rank_mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def test_one_rank_reduces_once_into_its_own_buffer_with_the_default_paths_gradients(one_rank_mesh, monkeypatch):
    calls: list[torch.Tensor] = []
    allocate = fsdp.OneRankReduceScatter.allocate
    monkeypatch.setattr(fsdp.OneRankReduceScatter, "allocate",
                        lambda self, *a, **kw: calls.append(allocate(self, *a, **kw)) or calls[-1])  # fmt: skip
    lean = fsdp.apply_fsdp(_model(), [], one_rank_mesh, param_dtype=torch.bfloat16)
    assert lean in fsdp._ONE_RANK_ROOTS
    got = _grads(lean, lean=True)
    # one reduce for three micro-batches: an input buffer, then the output handed the same storage
    assert len(calls) == 2 and calls[0].data_ptr() == calls[1].data_ptr(), [c.shape for c in calls]
    start, end = calls[0].data_ptr(), calls[0].data_ptr() + calls[0].numel() * calls[0].element_size()
    assert all(start <= p.grad.to_local().data_ptr() < end for p in lean.parameters())  # views of that buffer
    # FSDP2's default: a reduce per micro-batch, each into an output of its own, added onto the gradients
    default = fully_shard(_model(), mesh=one_rank_mesh,
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))  # fmt: skip
    want = _grads(default, lean=False)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert default not in fsdp._ONE_RANK_ROOTS
    fsdp.set_gradient_sync(default, False)  # not a one-rank root of apply_fsdp's: nothing changes
    assert all(g.reduce_grads for g in default._get_fsdp_state()._fsdp_param_groups)


def test_allocate_pairs_an_output_only_with_the_input_just_made():
    comm = fsdp.OneRankReduceScatter()
    a = comm.allocate((12,), dtype=torch.float32, device=torch.device("cpu"))
    assert comm.allocate((12,), dtype=torch.float32, device=torch.device("cpu")) is not None
    b = comm.allocate((12,), dtype=torch.float32, device=torch.device("cpu"))  # a new input: a new buffer
    assert b.data_ptr() != a.data_ptr()
    c = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))  # another size: not the input
    assert c.data_ptr() != b.data_ptr()
    del c  # an input nobody holds any more is not kept alive, and never handed out again
    assert comm._input() is None
    assert comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu")) is not None and comm._input is not None
