"""The MoE router load-balance loss in the trainer's loss: value against transformers'
``load_balancing_loss_func`` (computed independently), router gradients, micro-batch weighting in
``train_step``, both model impls, and the --model.router_aux_loss_coef flag."""

from __future__ import annotations

import math

import pytest
import torch

from prime_spmd.config.sections import ModelConfig
from prime_spmd.models.qwen3.hf import load_qwen3
from prime_spmd.models.registry import adapter_for
from prime_spmd.trainer.packing import Sample, pack
from prime_spmd.trainer.policy import PolicyModel, resolve_router_aux_coef
from prime_spmd.trainer.sft import sft_loss
from prime_spmd.trainer.step import router_metrics, train_step

COEF = 0.25
TOP_K, NUM_EXPERTS = 2, 6
# fp32 CPU, the same computation in another order (one-hot/histc sums vs bincount): measured max |diff| <= 2.4e-7
ATOL = 1e-5
ROUTER = "model.layers.0.mlp.gate.weight"


def _build_moe(path, coef: float = 0.001):
    """2 layers, one MoE layer (layer 0): transformers' loss over layers is then our per-layer loss times K."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, mlp_only_layers=[1], rope_theta=10000.0,
        router_aux_loss_coef=coef,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF's router init is near-uniform; make routing non-trivial
        model.model.layers[0].mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return _build_moe(tmp_path_factory.mktemp("moe"))


def _load(path, impl: str):
    if impl == "custom":
        return load_qwen3(path)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def _micro_batches(lengths=(9, 14, 6), micro_batch_tokens: int = 64):
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(input_ids=torch.randint(5, 100, (n,), generator=g).tolist(), loss_mask=[0, 0] + [1] * (n - 2))
        for n in lengths
    ]
    return pack(samples, micro_batch_tokens, 1)[0]


def _reference(path, mb) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(NLL summed over trained tokens, aux loss, grads of each) from transformers' model and its
    ``load_balancing_loss_func`` (divided by K: it sums over the K slots, ours averages them)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    out = hf(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, output_router_logits=True)
    lp = torch.log_softmax(out.logits[0].float(), -1).gather(-1, mb.targets[:, None])[:, 0]
    nll = -(lp * mb.loss_mask.float()).sum()
    aux = load_balancing_loss_func(out.router_logits, NUM_EXPERTS, TOP_K) / TOP_K
    grads = {}
    for name, t in (("nll", nll), ("aux", aux)):
        grads[name] = torch.autograd.grad(t, hf.get_parameter(ROUTER), retain_graph=True)[0]
    return nll.detach(), aux.detach(), grads


def _policy_loss(path, impl: str, coef: float, mb, loss_impl: str = "reference"):
    policy = PolicyModel(_load(path, impl), loss_impl, router_aux_coef=coef)
    fields = {**mb.fields, "loss_mask": mb.loss_mask.float()}
    out = policy(mb.input_ids, mb.position_ids, mb.targets, 1.0, sft_loss, fields)
    out.loss_sum.backward()
    router_grad = dict(policy.lm.named_parameters())[ROUTER].grad
    return out.loss_sum.detach(), out.router, router_grad


@pytest.mark.parametrize("impl,loss_impl", [("custom", "reference"), ("custom", "fused"), ("hf", "reference")])
def test_loss_and_router_grad_add_coef_times_aux(moe_dir, impl: str, loss_impl: str) -> None:
    mb = _micro_batches()[0]
    n = mb.loss_mask.float().sum()
    nll, aux, ref_grads = _reference(moe_dir, mb)
    assert 1.0 < float(aux) <= NUM_EXPERTS / TOP_K  # routing is unbalanced, so the check below is not vacuous

    loss0, router0, grad0 = _policy_loss(moe_dir, impl, 0.0, mb, loss_impl)
    loss1, router1, grad1 = _policy_loss(moe_dir, impl, COEF, mb, loss_impl)
    torch.testing.assert_close(loss0, nll, atol=ATOL, rtol=0)
    torch.testing.assert_close(loss1, nll + COEF * n * aux, atol=ATOL, rtol=0)
    for router in (router0, router1):  # stats are reported with coef 0 too
        torch.testing.assert_close(router.aux_loss, aux, atol=ATOL, rtol=0)
        assert router.tokens_per_expert_LE.shape == (1, NUM_EXPERTS)
        assert float(router.tokens_per_expert_LE.sum()) == mb.input_ids.numel() * TOP_K
    # coef 0: the router grad is the main loss's alone; coef > 0 adds coef * n * d aux / d router
    torch.testing.assert_close(grad0, ref_grads["nll"], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(grad1 - grad0, COEF * n * ref_grads["aux"], atol=ATOL, rtol=1e-4)
    assert (grad1 - grad0).abs().max() > 100 * ATOL


def _step(path, coef: float, micro_batches) -> tuple[dict[str, float], torch.Tensor]:
    policy = PolicyModel(load_qwen3(path), "reference", router_aux_coef=coef)
    before = {k: v.detach().clone() for k, v in policy.named_parameters()}
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    stats = train_step(policy, opt, sched, micro_batches, sft_loss, device=torch.device("cpu"), max_grad_norm=0.0)
    router_step = before[f"lm.{ROUTER}"] - dict(policy.named_parameters())[f"lm.{ROUTER}"].detach()
    return stats, router_step  # SGD with lr 1: the step is the gradient


def test_train_step_weights_micro_batches_by_trained_tokens(moe_dir) -> None:
    from prime_spmd.trainer.packing import dummy_microbatch

    # gradient accumulation over 3 micro-batches (one per sample) plus a dummy with no trained token
    mbs = _micro_batches((14, 9, 6), micro_batch_tokens=14) + [dummy_microbatch([])]
    assert len(mbs) == 4
    refs = [_reference(moe_dir, mb) for mb in mbs[:3]]
    ns = [float(mb.loss_mask.sum()) for mb in mbs[:3]]
    n = sum(ns)
    aux = sum(float(r[1]) * k for r, k in zip(refs, ns)) / n  # trained-token-weighted mean over micro-batches
    main = sum(float(r[0]) for r in refs) / n

    stats0, step0 = _step(moe_dir, 0.0, mbs)
    stats1, step1 = _step(moe_dir, COEF, mbs)
    assert math.isclose(stats0["loss"], main, abs_tol=ATOL)
    assert math.isclose(stats1["loss"], main + COEF * aux, abs_tol=ATOL)
    for stats in (stats0, stats1):
        assert math.isclose(stats["router_aux"], aux, abs_tol=ATOL)
        assert 1.0 < stats["max_expert_load"] <= NUM_EXPERTS / TOP_K
        assert set(router_metrics(stats)) == {"loss/router_aux", "moe/max_expert_load"}
    aux_grad = sum(r[2]["aux"] * k for r, k in zip(refs, ns)) / n
    torch.testing.assert_close(step1 - step0, COEF * aux_grad, atol=ATOL, rtol=1e-4)


def test_dense_model_has_no_router_metrics(tmp_path) -> None:
    from prime_spmd.models.tiny import build_tiny_model

    lm = load_qwen3(build_tiny_model(tmp_path, preset="qwen3-nano"))
    assert resolve_router_aux_coef(None, adapter_for(lm)) == 0.0
    assert resolve_router_aux_coef(0.5, adapter_for(lm)) == 0.0  # ignored with a warning: no MoE layers
    policy = PolicyModel(lm)
    mb = _micro_batches()[0]
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    fields = {**mb.fields, "loss_mask": mb.loss_mask.float()}
    assert policy(mb.input_ids, mb.position_ids, mb.targets, 1.0, sft_loss, fields).router is None
    stats = train_step(policy, opt, sched, [mb], sft_loss, device=torch.device("cpu"))
    assert "router_aux" not in stats and router_metrics(stats) == {}


def test_router_aux_coef_flag(tmp_path, moe_dir) -> None:
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"--model\.router_aux_loss_coef=.* is invalid"):
            ModelConfig(path="m", router_aux_loss_coef=bad)
    for ok in (None, 0.0, 0.01):
        assert ModelConfig(path="m", router_aux_loss_coef=ok).router_aux_loss_coef == ok
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=-1"):
        resolve_router_aux_coef(-1.0, adapter_for(load_qwen3(moe_dir)))

    path = _build_moe(tmp_path / "coef", coef=0.02)
    for impl in ("custom", "hf"):
        lm = _load(path, impl)
        assert resolve_router_aux_coef(None, adapter_for(lm)) == 0.02  # the HF config's value
        assert resolve_router_aux_coef(0.0, adapter_for(lm)) == 0.0
        assert resolve_router_aux_coef(0.3, adapter_for(lm)) == 0.3


def test_unsupported_hf_moe_type(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(
        vocab_size=101, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
    )  # fmt: skip
    lm = AutoModelForCausalLM.from_config(cfg)
    assert resolve_router_aux_coef(None, adapter_for(lm)) == 0.0  # config default: warned, not added
    assert resolve_router_aux_coef(0.0, adapter_for(lm)) == 0.0
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.1 is not supported .*'mixtral'"):
        resolve_router_aux_coef(0.1, adapter_for(lm))
