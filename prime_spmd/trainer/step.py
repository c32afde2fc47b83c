"""One optimizer step over this rank's micro-batches (shared by SFT and RL).

The loss is a sum over trained tokens divided by the number of trained tokens in the *global*
batch (all micro-batches of all trainer ranks), so that 1 rank and N ranks give the same update.
FSDP2 averages gradients over the trainer ranks, hence the factor ``world_size`` below.

MoE models add the router load-balance loss inside that loss sum, weighted by each micro-batch's
trained tokens (``trainer/policy.py``), so it is normalized the same way: the step's objective is
``main + coef * router_aux`` with ``router_aux`` the trained-token-weighted mean over all
micro-batches of all ranks (reported unscaled as ``router_aux``; ``loss`` is the whole objective).
"""

from __future__ import annotations

import math
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from prime_spmd.distributed.fsdp import clip_grad_norm_, set_gradient_sync
from prime_spmd.trainer.loss import TokenLoss
from prime_spmd.trainer.packing import MicroBatch


def _all_reduce_sum(values: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    """Sum scalars over the trainer role's default group (every trainer rank calls this; no grad)."""
    keys = sorted(values)
    if not keys:
        return {}
    buf = torch.stack([values[k].detach().to(device=device, dtype=torch.float64) for k in keys])
    if dist.is_initialized():
        dist.all_reduce(buf)
    return {k: float(v) for k, v in zip(keys, buf.tolist())}


def _max_expert_load(counts_LE: torch.Tensor) -> float:
    """Max over MoE layers of (most-loaded expert's token-slot count / mean count) over every routed
    token of the step on all trainer ranks: 1.0 is perfect balance, E / K every token on the same K experts.
    Collective (all-reduce over the trainer role; every trainer rank calls it); no grad."""
    if dist.is_initialized():
        dist.all_reduce(counts_LE)
    return float((counts_LE.amax(dim=1) / counts_LE.mean(dim=1).clamp_min(1e-12)).max())


def router_metrics(stats: dict[str, float]) -> dict[str, float]:
    """The MoE metrics of a ``train_step`` result under their logged names (empty for dense models)."""
    if "router_aux" not in stats:
        return {}
    return {"loss/router_aux": stats["router_aux"], "moe/max_expert_load": stats["max_expert_load"]}


def train_step(
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: list[MicroBatch],
    loss_fn: TokenLoss,
    *,
    device: torch.device,
    temperature: float = 1.0,
    max_grad_norm: float = 1.0,
    stop_requested: bool = False,
) -> dict[str, float]:
    """Forward/backward every micro-batch, clip, step. Collective over the trainer role.

    Every trainer rank calls it with the same number of micro-batches (packing pads with dummies).
    Returns global sums of the loss_fn stats, of ``model_tokens`` (packed tokens less the prompt copies that
    prompt sharing did not run through the blocks) and of ``row_tokens`` (what the blocks ran, pads included),
    plus ``loss`` (per trained token), ``grad_norm``, ``lr``, ``trained_tokens``, ``fwd_bwd_s`` (seconds to the
    clipped grad norm: forward, backward, reductions, clipping), ``optim_s`` (the optimizer and schedule steps after
    it, host time: on CUDA their kernels may still run after return), ``nonfinite`` (non-finite loss or gradient), ``empty_batch`` (no
    trained token anywhere), ``skipped`` (either: the parameters are then unchanged) and ``stop``
    (1.0 when any trainer rank passed ``stop_requested``, e.g. after a SIGTERM: the flag rides on the
    token-count all-reduce, so every rank takes the same stop decision at the same step). MoE models
    (``PolicyOutput.router`` set) add ``router_aux`` and ``max_expert_load`` (module docstring,
    ``router_metrics``). The first call with compiled blocks also compiles every kind of block input
    (``PolicyModel.warm_up_compiled_blocks``: no gradient left), so later steps never recompile.
    """
    t_start = time.perf_counter()
    warm_up = getattr(policy, "warm_up_compiled_blocks", None)  # PolicyModel: compiles every kind in the first step
    if warm_up is not None and warm_up(device):
        # the warm-up's zero gradients, also where an optimizer keeps them apart (--trainer.offload master)
        optimizer.zero_grad(set_to_none=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    n_local = sum(int(mb.loss_mask.sum()) for mb in micro_batches)
    agreed = _all_reduce_sum({"n": torch.tensor(float(n_local)), "stop": torch.tensor(float(stop_requested))}, device)
    n_global = agreed["n"]
    scale = world / max(n_global, 1.0)
    sums: dict[str, torch.Tensor] = {}
    expert_counts_LE: torch.Tensor | None = None
    for i, mb in enumerate(micro_batches):
        set_gradient_sync(policy, i == len(micro_batches) - 1)  # a one-rank root reduces once, after the last
        mb = mb.to(device)
        fields = {**mb.fields, "loss_mask": mb.loss_mask.float()}
        extra = {"vision": mb.vision} if mb.vision else {}  # rows with images (vision-language models)
        out = policy(mb.input_ids, mb.position_ids, mb.targets, temperature, loss_fn, fields, **extra)
        loss_sum = out.loss_sum
        (loss_sum * scale).backward()
        stats = loss_fn.stats(out.logprob_T, out.entropy_T, fields)
        # tokens the blocks ran: the packed ones less the prompt copies a shared forward skipped (the LM head
        # still runs on every packed token); what an honest FLOP count multiplies the blocks' parameters by
        model_tokens = mb.num_tokens - out.shared_tokens
        stats = {"loss_sum": loss_sum, "model_tokens": torch.tensor(float(model_tokens)),
                 "row_tokens": torch.tensor(float(out.row_tokens)), **stats}  # fmt: skip
        router = out.router
        if router is not None:  # the same on every rank: the model decides, not the data
            stats["router_aux_sum"] = router.aux_loss * fields["loss_mask"].sum()
            counts = router.tokens_per_expert_LE.detach().double()
            expert_counts_LE = counts if expert_counts_LE is None else expert_counts_LE + counts
        for k, v in stats.items():
            sums[k] = sums.get(k, torch.zeros((), dtype=torch.float64, device=device)) + v.detach().double()
    totals = _all_reduce_sum(sums, device)
    if expert_counts_LE is not None:
        totals.update(router_aux=totals.pop("router_aux_sum") / max(n_global, 1.0))
        totals.update(max_expert_load=_max_expert_load(expert_counts_LE))
    # the step's gradients: the parameters' own, or an optimizer's that keeps them apart (--trainer.offload master: fp32
    # buffers beside compute-dtype parameters)
    own = getattr(optimizer, "gradients", None)
    params = [p for p in policy.parameters() if p.grad is not None]
    grads = own() if own is not None else [p.grad for p in params]
    norm = clip_grad_norm_(grads, max_grad_norm if max_grad_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()  # DTensor norm -> replicated scalar (no grad flows through it)
    grad_norm = float(norm)  # waits for the device: forward, backward and the grad reductions are done here
    t_grads = time.perf_counter()
    loss = totals.get("loss_sum", 0.0) / max(n_global, 1.0)
    nonfinite = not (math.isfinite(grad_norm) and math.isfinite(loss))
    empty = n_global == 0  # e.g. every group filtered out: nothing to learn, keep the optimizer state as is
    skipped = nonfinite or empty
    lr = optimizer.param_groups[0]["lr"]
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        if own is None and params and not any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
            raise RuntimeError(
                f"the backward filled {len(params)} parameter gradients and none of them belongs to the optimizer: "
                "the model's parameters were replaced after the optimizer was built or FSDP2 never reduced the "
                "gradients (its backward hook did not fire: trainer/policy.py PolicyOutput), so this step would change "
                "nothing"
            )
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped step still advances the schedule: steps and LRs stay aligned
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        scheduler.step()
    totals.update(
        fwd_bwd_s=t_grads - t_start,
        optim_s=time.perf_counter() - t_grads,
        loss=loss,
        grad_norm=grad_norm,
        lr=lr,
        trained_tokens=n_global,
        skipped=float(skipped),
        nonfinite=float(nonfinite),
        empty_batch=float(empty),
        stop=float(agreed["stop"] > 0),
    )
    return totals
