"""Teacher-forced log-probabilities: the trainer's side of the logprob contract (docs/inference.md).

The engine reports, for each sampled token, log p(token) under the distribution it was drawn from.
With no top-k / top-p / min-p filtering that is ``log_softmax(logits / T)[token]``, which a full
forward over prompt + completion recomputes here. Tests and trainer parity checks use this.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def teacher_forced_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """float32 [len(completion_ids)]: log_softmax(logits / T)[token] of each completion token.

    One forward of ``prompt_ids + completion_ids`` (batch 1) through ``model`` (any HF causal LM);
    the logits at position i predict token i + 1. ``temperature`` 0 means 1 (greedy reports raw
    log-probabilities). No filtering is applied.
    """
    if not prompt_ids or not completion_ids:
        raise ValueError("teacher_forced_logprobs: prompt_ids and completion_ids must be non-empty")
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=device)
    logits = model(input_ids=ids).logits[0].float()
    n = len(prompt_ids)
    pred = logits[n - 1 : n - 1 + len(completion_ids)]
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(pred / t, dim=-1)
    target = torch.tensor(completion_ids, device=device)
    return logp.gather(1, target[:, None]).squeeze(1).cpu()


def mismatch_stats(trainer_lp: torch.Tensor, inference_lp: torch.Tensor) -> dict[str, float]:
    """mean |d| and the mismatch KL mean(exp(d) - d - 1), d = trainer - inference (float64)."""
    d = trainer_lp.double() - inference_lp.double()
    return {"mean_abs_diff": d.abs().mean().item(), "mismatch_kl": (torch.exp(d) - d - 1).mean().item()}
