"""Policy-gradient losses with importance-ratio correction against the inference logprobs.

Per token t with trainer logprob lp, inference logprob lq and advantage A:
log r = clamp(lp - lq, -max_log_ratio, max_log_ratio) (so exp cannot overflow), r = exp(log r).

- ``dppo`` (PRIME-RL's default): tokens are masked (keep = 0) where the probability moved too far
  in the direction of the advantage: p - q > prob_delta_high with A > 0, q - p > prob_delta_low with
  A < 0; loss_t = -A r keep + kl_coef (log r)^2.
- ``ppo``: loss_t = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_coef (log r)^2;
  "masked" counts the clipped tokens.

Both are summed over trained tokens; the step divides by the global number of trained tokens.
Stats (sums): mismatch KL exp(d) - d - 1 with d = lp - lq, masked tokens, tokens, entropy.
"""

from __future__ import annotations

import torch

from prime_spmd.config.rl_sections import LossConfig
from prime_spmd.trainer.loss import TokenLoss


def compute_policy_loss(
    lp: torch.Tensor, lq: torch.Tensor, adv: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss [L] and the bool mask of masked/clipped tokens [L] (fp32 inputs)."""
    log_r = torch.clamp(lp - lq, -cfg.max_log_ratio, cfg.max_log_ratio)
    r = torch.exp(log_r)
    kl = cfg.kl_coef * log_r.pow(2)
    if cfg.type == "dppo":
        delta = torch.exp(lp.detach()) - torch.exp(lq)
        masked = ((adv > 0) & (delta > cfg.prob_delta_high)) | ((adv < 0) & (delta < -cfg.prob_delta_low))
        return -adv * r * (~masked).to(r.dtype) + kl, masked
    clipped = torch.clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high)
    surrogate = torch.minimum(r * adv, clipped * adv)
    masked = (r * adv).detach() > (clipped * adv).detach()
    return -surrogate + kl, masked


def _field(fields: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    """A per-token field, or zeros for the dummy micro-batches of a batch that filtering emptied
    (no sample, so packing knows no field names; the loss mask is all zero there anyway)."""
    return fields[name] if name in fields else torch.zeros_like(like)


class RLLoss(TokenLoss):
    """The configured policy-gradient loss over micro-batches carrying ``advantages`` and
    ``inference_logprobs`` fields."""

    def __init__(self, cfg: LossConfig) -> None:
        self.cfg = cfg

    def token_loss(self, lp: torch.Tensor, ent: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        per_tok, _ = compute_policy_loss(
            lp, _field(fields, "inference_logprobs", lp), _field(fields, "advantages", lp), self.cfg
        )
        return per_tok * fields["loss_mask"]

    def stats(self, lp: torch.Tensor, ent: torch.Tensor, fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        m, lq = fields["loss_mask"], _field(fields, "inference_logprobs", lp)
        _, masked = compute_policy_loss(lp, lq, _field(fields, "advantages", lp), self.cfg)
        # float64: exp(d) - d - 1 cancels catastrophically in fp32 for |d| ~ 1e-6 (it went negative)
        d = (lp - lq).clamp(-self.cfg.max_log_ratio, self.cfg.max_log_ratio).double()
        return {
            "tokens": m.sum(),
            "masked_tokens": (masked.to(m.dtype) * m).sum(),
            "mismatch_kl_sum": ((torch.exp(d) - d - 1) * m).sum(),
            "abs_log_ratio_sum": (d.abs() * m).sum(),
            "entropy_sum": (ent * m).sum(),
        }


def make_rl_loss(cfg: LossConfig) -> RLLoss:
    return RLLoss(cfg)
