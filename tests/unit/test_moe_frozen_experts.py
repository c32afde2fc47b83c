"""LoRA on our MoE model: the stacked experts stay frozen, the Triton experts backward skips their weight grads
(kernels/moe/op.py) and the adapters' grads still match the reference experts loop; a few steps still learn.

Triton runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py), so the model is tiny.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from prime_spmd.config.sections import LoraConfig
from prime_spmd.models.lora import apply_lora
from prime_spmd.models.qwen3.hf import build_model
from prime_spmd.models.qwen3.model import Qwen3Args, set_moe_impl

MOE = dict(
    model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=16,
)  # fmt: skip
# fp32, Triton (interpreter) vs the reference loop: measured max rel. error 8.3e-7 over all adapter grads
GRAD_RTOL = 1e-5


def _lora_moe(seed: int = 0) -> torch.nn.Module:
    """Tiny Qwen3-MoE (ours) with rank-4 adapters on the attention projections and random (non-zero) B."""
    lm = build_model(Qwen3Args.from_hf_config(MOE), "cpu", torch.float32)
    lm.init_weights(std=0.2, seed=seed)  # larger than the default so the router does not route uniformly
    apply_lora(lm, LoraConfig(rank=4, alpha=8.0), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # B = 0 at init would leave A without a grad
        for n, p in lm.named_parameters():
            if n.endswith(".lora_B.weight"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return lm


def _loss(lm: torch.nn.Module, ids_BT: torch.Tensor) -> torch.Tensor:
    out = lm(ids_BT[:, :-1])
    ce = F.cross_entropy(out.logits.flatten(0, 1), ids_BT[:, 1:].flatten())
    return ce + 0.01 * out.aux_loss


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / (b.abs().max() + 1e-12)).item()


def test_lora_moe_adapter_grads_match_reference_without_expert_weight_grads(monkeypatch) -> None:
    from prime_spmd.kernels.moe import kernel

    ref = _lora_moe()
    ours = copy.deepcopy(ref)
    set_moe_impl(ref, "reference")
    set_moe_impl(ours, "triton")
    ids_BT = torch.randint(0, MOE["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(3))
    _loss(ref, ids_BT).backward()
    launches: list[str] = []
    launch = kernel._launch
    monkeypatch.setattr(kernel, "_launch", lambda name, *a, **kw: (launches.append(name), launch(name, *a, **kw)))
    loss = _loss(ours, ids_BT)
    launches.clear()
    loss.backward()
    L = MOE["num_hidden_layers"]
    assert sorted(launches) == sorted(["dz_swiglu_bwd", "grouped_gemm"] * L), launches  # no grouped_wgrad
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable), trainable
    ref_params = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, n
            continue
        assert p.grad.abs().max() > 0, n
        assert _rel(p.grad, ref_params[n].grad) < GRAD_RTOL, (n, _rel(p.grad, ref_params[n].grad))


@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
def test_lora_moe_learns_with_frozen_experts(impl: str) -> None:
    """AdamW on the adapters only: the loss on one batch falls and the experts do not move."""
    lm = _lora_moe(seed=1)
    set_moe_impl(lm, impl)
    experts = {n: p.detach().clone() for n, p in lm.named_parameters() if ".experts." in n}
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=1e-2)
    ids_BT = torch.randint(0, MOE["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(4))
    losses = []
    for _ in range(8):
        loss = _loss(lm, ids_BT)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    for n, p in lm.named_parameters():
        if n in experts:
            assert torch.equal(p, experts[n]), n


def test_ep_keeps_experts_frozen_and_skips_their_weight_grads(tmp_path, monkeypatch) -> None:
    """``apply_ep`` (after ``apply_lora``, as the trainer builds) re-wraps the expert weights as DTensor parameters;
    they stay frozen and the EP path's backward launches no weight-grad kernel. One rank, in-process gloo group."""
    import torch.distributed as dist
    from prime_spmd.kernels.moe import kernel
    from torch.distributed.device_mesh import init_device_mesh

    from prime_spmd.distributed.ep import apply_ep

    lm = _lora_moe()
    set_moe_impl(lm, "triton")
    ids_BT = torch.randint(0, MOE["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(3))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        for block in lm.model.layers:
            apply_ep(block.mlp.experts, mesh)
        frozen = [n for n, p in lm.named_parameters() if ".experts." in n]
        assert frozen and not any(p.requires_grad for n, p in lm.named_parameters() if n in frozen)
        launches: list[str] = []
        launch = kernel._launch
        monkeypatch.setattr(kernel, "_launch", lambda name, *a, **kw: (launches.append(name), launch(name, *a, **kw)))
        loss = _loss(lm, ids_BT)
        launches.clear()
        loss.backward()
    finally:
        dist.destroy_process_group()
    assert "grouped_wgrad" not in launches and launches.count("grouped_gemm") == MOE["num_hidden_layers"], launches
    assert all(p.grad is None for n, p in lm.named_parameters() if n in frozen)
