"""Which MoE models the native engine may decode through CUDA graphs (``moe_graph_safe``), and the sync-free expert
counts that make our MoE block capturable (``expert_counts``). The capture itself:
tests/gpu/test_moe_engine_graphs_gpu.py."""

from __future__ import annotations

import pytest
import torch
from prime_spmd.kernels.moe.reference import expert_counts, sort_by_expert

from prime_spmd.models.common.moe import moe_graph_safe
from prime_spmd.models.qwen3.hf import load_qwen3
from prime_spmd.models.qwen3.model import set_moe_impl
from prime_spmd.models.tiny import build_tiny_model
from tests.unit.test_custom_models import _build_moe, _hf


def test_expert_counts_equal_bincount_with_idle_experts():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (13, 3), generator=g)  # experts 5..8 never chosen
    assert torch.equal(expert_counts(ids, 9), torch.bincount(ids.flatten(), minlength=9))
    perm, offs = sort_by_expert(ids, 9)
    assert offs.tolist() == torch.bincount(ids.flatten(), minlength=9).cumsum(0).tolist()
    assert torch.equal(ids.flatten()[perm], ids.flatten().sort(stable=True).values)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return _build_moe(tmp_path_factory.mktemp("moe"))


@pytest.mark.parametrize("impl, safe", [("triton", True), ("grouped_mm", False), ("reference", False)])
def test_our_moe_block_is_graph_safe_on_a_sync_free_kernel(moe_dir, impl, safe):
    model = load_qwen3(moe_dir)
    set_moe_impl(model, impl)
    assert moe_graph_safe(model) is safe


def test_transformers_moe_and_dense_models(moe_dir, tmp_path):
    assert not moe_graph_safe(_hf(moe_dir))  # transformers' expert loop reads the routed ids on the host
    assert moe_graph_safe(load_qwen3(build_tiny_model(tmp_path / "dense", preset="qwen3-nano")))
