"""Expert parallelism on gloo: ep=2 over 2 and 4 ranks gives one process's loss and gradients.

Each rank also runs the single-process reference (same seed, whole batch) and compares; expert
grads are compared on the rank's expert slice. Grad reduction outside EP is done by hand here:
non-expert grads summed over all ranks, expert grads over the ``dp_shard`` axis.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import init_default_group, run_ranks

# fp32; measured max |diff|: loss 0.0 (2 ranks) and 4.8e-7 (4 ranks, summation order), grads (relative to
# max |grad|) 2.3e-7 and 3.8e-7
LOSS_ATOL = 1e-5
GRAD_RTOL = 1e-5


def _model():
    from prime_spmd.models.qwen3.hf import build_model
    from prime_spmd.models.qwen3.model import Qwen3Args

    args = Qwen3Args(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    )  # fmt: skip
    model = build_model(args, "cpu", torch.float32)
    model.init_weights(std=0.3, seed=0)
    return model


def _loss(model, ids, num_tokens):
    logits = model(ids[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum") / num_tokens


def _worker(rank: int, world: int, ep: int):
    from torch.distributed.device_mesh import init_device_mesh

    from prime_spmd.distributed.ep import apply_ep
    from prime_spmd.models.common.moe import MoEBlock

    init_default_group(rank, world)
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp_shard", "ep"))
    ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(3))
    num_tokens = ids[:, 1:].numel()

    ref = _model()
    ref_loss = _loss(ref, ids, num_tokens)
    ref_loss.backward()

    model = _model()
    experts = {f"{name}.experts": m.experts for name, m in model.named_modules() if isinstance(m, MoEBlock)}
    for m in experts.values():
        apply_ep(m, mesh["ep"])
    per_rank = ids.shape[0] // world
    loss = _loss(model, ids[rank * per_rank : (rank + 1) * per_rank], num_tokens)
    loss.backward()

    total = loss.detach().clone()
    dist.all_reduce(total)
    diffs = {"loss": (total - ref_loss).abs().item()}
    ref_params = dict(ref.named_parameters())
    ep_rank = mesh.get_local_rank("ep")
    for name, p in model.named_parameters():
        g, g_ref = p.grad, ref_params[name].grad
        if name.rsplit(".", 1)[0] in experts:
            assert p.full_tensor().shape == g_ref.shape  # DTensor over ep: full stacked experts
            g = g.to_local()
            dist.all_reduce(g, group=mesh.get_group("dp_shard"))
            g_ref = g_ref[ep_rank * g.shape[0] : (ep_rank + 1) * g.shape[0]]
        else:
            dist.all_reduce(g)
        diffs[name] = ((g - g_ref).abs().max() / g_ref.abs().max().clamp_min(1e-12)).item()
    return diffs


def test_ep_matches_single_process():
    for world in (2, 4):
        for rank, diffs in enumerate(run_ranks(_worker, world, 2)):
            assert diffs.pop("loss") < LOSS_ATOL, (world, rank)
            worst = max(diffs, key=diffs.get)
            assert diffs[worst] < GRAD_RTOL, (world, rank, worst, diffs[worst])
