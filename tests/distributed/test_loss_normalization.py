"""RL ``train_step`` on 2 FSDP2 ranks (gloo, CPU) equals the single-process token mean: the summed
per-token loss divided by the global number of trained tokens, whatever the ranks' shares.

The ranks get unequal shares on purpose (different trained-token counts and micro-batch lengths,
one rank padded with a dummy), so dividing by a rank's own tokens, dropping the ``world_size``
factor that undoes FSDP2's gradient averaging, or averaging per micro-batch all show.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from prime_spmd.config.rl_sections import LossConfig
from prime_spmd.rl.loss import RLLoss
from prime_spmd.trainer.packing import pack
from tests.dist_utils import init_default_group, run_ranks
from tests.unit.test_loss_formula import GradRecorder, rl_samples, token_mean_reference

LENGTHS = (20, 18, 5, 9)  # rank 0: 17 trained tokens + a dummy; rank 1: 15 + 8
MICRO_BATCH_TOKENS = 20
CFGS = [
    LossConfig(type="dppo", kl_coef=0.05, prob_delta_high=0.02, prob_delta_low=0.02),
    LossConfig(type="ppo", kl_coef=0.05),
]


def _rank(rank: int, world: int, model: str) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from prime_spmd.distributed.fsdp import parallelize
    from prime_spmd.trainer.policy import PolicyModel
    from prime_spmd.trainer.step import train_step

    init_default_group(rank, world)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(model)
    policy = PolicyModel(lm, "reference")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    parallelize(policy, policy.adapter.block_lists(), mesh, torch.float32, activation_checkpointing=False)
    mbs = pack(rl_samples(LENGTHS), MICRO_BATCH_TOKENS, world)[rank]
    out = []
    for cfg in CFGS:  # the recorder never changes the weights: every step starts from the same ones
        opt = GradRecorder(policy)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        stats = train_step(policy, opt, sched, mbs, RLLoss(cfg), device=torch.device("cpu"), max_grad_norm=0.0)
        local = [int(mb.loss_mask.sum()) for mb in mbs]
        out.append({"stats": stats, "grads": opt.grads if rank == 0 else None, "local_tokens": local})
    return out


def test_two_ranks_equal_the_single_process_token_mean(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from prime_spmd.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "base", "qwen3-nano", initializer_range=0.3)
    results = run_ranks(_rank, 2, str(model))
    shares = [sorted(results[r][0]["local_tokens"]) for r in range(2)]
    assert sum(shares[0]) != sum(shares[1]) and len(set(shares[0] + shares[1])) >= 4, shares  # unequal shares
    assert 0 in shares[0] + shares[1], shares  # one rank runs a dummy micro-batch

    lm = AutoModelForCausalLM.from_pretrained(model)
    for i, cfg in enumerate(CFGS):
        want_loss, want_grads, want_stats = token_mean_reference(lm, rl_samples(LENGTHS), RLLoss(cfg))
        assert 0 < want_stats["masked_tokens"] < want_stats["tokens"], (cfg.type, want_stats)
        for r in range(2):
            stats = results[r][i]["stats"]
            assert stats["trained_tokens"] == want_stats["tokens"], (cfg.type, r)
            assert math.isclose(stats["loss"], want_loss, rel_tol=1e-5), (cfg.type, r, stats["loss"], want_loss)
            for k in ("masked_tokens", "mismatch_kl_sum", "entropy_sum"):
                assert math.isclose(stats[k], want_stats[k], rel_tol=1e-5), (cfg.type, r, k, stats[k], want_stats[k])
        grads = results[0][i]["grads"]
        assert grads is not None and set(grads) == set(want_grads), cfg.type
        for name, want in want_grads.items():
            # fp32, 2 ranks and another summation order: measured max |diff| / max |grad| 1.6e-6 (2026-12-03)
            tol = 1e-5 * want.abs().max().item()
            torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=tol, msg=f"{cfg.type} {name}")
