"""An RL step's loss and gradients are the same with every logprob/loss implementation
(reference, Triton, loss-fused) on a tiny model: on CPU with Triton under the interpreter,
with a GPU on CUDA (the `device` fixture), kernels compiled.

Every impl calls the same ``RLLoss.token_loss``, so this cannot catch a wrong formula: that is
tests/unit/test_loss_formula.py (hand-computed values) and tests/distributed/test_loss_normalization.py."""

from __future__ import annotations

import copy

import pytest
import torch

from prime_spmd.config.rl_sections import LossConfig
from prime_spmd.rl.loss import RLLoss
from prime_spmd.trainer.packing import Sample, pack
from prime_spmd.trainer.policy import PolicyModel


def _loss_and_grads(lm, impl: str, mb, loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    policy = PolicyModel(copy.deepcopy(lm), impl)
    fields = {**mb.fields, "loss_mask": mb.loss_mask.float()}
    loss_sum = policy(mb.input_ids, mb.position_ids, mb.targets, 0.8, loss, fields).loss_sum
    loss_sum.backward()
    return loss_sum.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}


@pytest.mark.parametrize("impl", ["triton", "fused"])
def test_rl_step_matches_reference(tmp_path, impl: str, device, monkeypatch, request) -> None:
    from prime_spmd.kernels.lm_logprob import fused_kernel, kernel
    from transformers import AutoModelForCausalLM

    from tests.kernels._helpers import lm_head_config_fits, pin_one_config

    # On CUDA one config per autotuned kernel (as in tests/kernels): with all six fp32 configs of both
    # LM-head kernels autotuned, the triton case was still running when the H200 run's 210 s step limit
    # killed it. The checks below hold for every config.
    pin_one_config(monkeypatch, (kernel._fwd_tuned, kernel._grad_tuned), request.node.nodeid, lm_head_config_fits)
    pin_one_config(monkeypatch, (fused_kernel._stats_tuned, fused_kernel._grad_tuned), request.node.nodeid)

    from prime_spmd.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path, "qwen3-nano", initializer_range=0.3)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in (9, 14, 6):
        ids = torch.randint(5, 100, (n,), generator=g).tolist()
        samples.append(
            Sample(
                input_ids=ids,
                loss_mask=[0, 0] + [1] * (n - 2),
                fields={
                    "advantages": [float(torch.randn(1, generator=g))] * n,
                    "inference_logprobs": (-torch.rand(n, generator=g) * 4).tolist(),
                },
            )
        )
    (mb,) = pack(samples, 64, 1)[0]
    mb = mb.to(device)
    loss = RLLoss(LossConfig())
    ref_loss, ref_grads = _loss_and_grads(lm, "reference", mb, loss)
    # not vacuous: both advantage signs, and the fused path sees masked and kept trained tokens
    adv = mb.fields["advantages"][mb.loss_mask]
    assert (adv > 0).any() and (adv < 0).any()
    lp, _ = PolicyModel(copy.deepcopy(lm)).logprobs(mb.input_ids, mb.position_ids, mb.targets, 0.8)
    fields = {**mb.fields, "loss_mask": mb.loss_mask.float()}
    masked = loss.stats(lp.detach(), torch.zeros_like(lp), fields)["masked_tokens"]
    assert 0 < masked < mb.loss_mask.sum(), masked
    got_loss, got_grads = _loss_and_grads(lm, impl, mb, loss)
    # fp32 everywhere: measured max relative error (loss and grads) 6.7e-7 (2026-12-02); 1e-4 leaves margin.
    torch.testing.assert_close(got_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(got_grads[name], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(), msg=name)
