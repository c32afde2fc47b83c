"""Policy-gradient losses with importance-ratio correction against the inference logprobs.

Per token t with trainer logprob lp, inference logprob lq and advantage A:
log r = clamp(lp - lq, -max_log_ratio, max_log_ratio) (so exp cannot overflow), r = exp(log r),
p = exp(lp), q = exp(lq). Every type adds kl_coef (log r)^2 on every trained token.

- ``dppo`` (the default): keep = 0 where the probability moved too far in the direction of the
  advantage: p - q > prob_delta_high with A > 0, q - p > prob_delta_low with A < 0; pg_t = -A r keep.
- ``ipo`` (PRIME-RL's IPO): keep = 0 where |p - q| > ipo_eps, whatever the sign of A; pg_t = -A r keep.
- ``ppo``: pg_t = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); "masked" counts the clipped tokens.
- ``cispo`` (MiniMax-M1): w = sg(clip(r, 1 - cispo_clip_low, 1 + cispo_clip_high)); pg_t = -w A exp(lp - sg(lp)):
  the value is -w A and the gradient -w A d lp on every token, clipped ones included.
- ``gspo`` (sequence level): per sample i, log s_i = mean of log r over its kept trained tokens,
  pg_t = -min(s_i A, clip(s_i, 1 - gspo_clip_low, 1 + gspo_clip_high) A) on each of them; the sample
  loss counts once per token (token-mean step), so d / d lp_t = -A s_i where s_i is not clipped.
  Samples are told apart by the ``sample_ids`` field (rl/samples.py); a sequence-level loss needs the
  whole micro-batch's logprobs at once (``TokenLoss.sequence_level``: no chunked fused LM-head loss).

``token_mask = "icepop"`` (any type): keep = 0 also where sg(r) is outside [mask_ratio_low, mask_ratio_high]
(gspo leaves those tokens out of s_i as well). Masked tokens keep the KL term.

Summed over trained tokens; the step divides by the global number of trained tokens.
Stats (sums): mismatch KL exp(d) - d - 1 with d = lp - lq, masked tokens (the type's masked or clipped
tokens and the IcePop-masked ones), tokens, entropy.
"""

from __future__ import annotations

import torch

from prime_spmd.config.rl_sections import LossConfig
from prime_spmd.trainer.loss import TokenLoss


def _gspo(
    log_r: torch.Tensor, adv: torch.Tensor, keep: torch.Tensor, sample_ids: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pg [L], clipped [L]) of the sequence-level ratio over the tokens where ``keep`` (bool [L]) holds,
    grouped by equal ``sample_ids`` values."""
    _, seg = torch.unique(sample_ids, return_inverse=True)
    k = keep.to(log_r.dtype)
    n_S = torch.zeros(seg.numel(), dtype=log_r.dtype, device=log_r.device).index_add(0, seg, k)
    sum_S = torch.zeros_like(n_S).index_add(0, seg, log_r * k)
    s = torch.exp((sum_S / n_S.clamp(min=1.0))[seg])  # s_i on each of sample i's tokens
    clipped = torch.clamp(s, 1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high)
    pg = -torch.minimum(s * adv, clipped * adv) * k
    return pg, keep & ((s * adv).detach() > (clipped * adv).detach())


def compute_policy_loss(
    lp: torch.Tensor,
    lq: torch.Tensor,
    adv: torch.Tensor,
    cfg: LossConfig,
    loss_mask: torch.Tensor | None = None,
    sample_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss [L] and the bool mask of masked/clipped tokens [L] (fp32 inputs).

    ``loss_mask`` and ``sample_ids`` ([L] float) are needed by ``gspo`` only (which tokens form a sample's ratio)."""
    log_r = torch.clamp(lp - lq, -cfg.max_log_ratio, cfg.max_log_ratio)
    r = torch.exp(log_r)
    kl = cfg.kl_coef * log_r.pow(2)
    ratio_masked = torch.zeros_like(lp, dtype=torch.bool)
    if cfg.token_mask == "icepop":
        r_sg = r.detach()
        ratio_masked = (r_sg < cfg.mask_ratio_low) | (r_sg > cfg.mask_ratio_high)
    if cfg.type == "gspo":
        assert loss_mask is not None and sample_ids is not None, "gspo groups tokens by sample"
        pg, masked = _gspo(log_r, adv, (loss_mask > 0) & ~ratio_masked, sample_ids, cfg)
        return pg + kl, masked | ratio_masked
    if cfg.type in ("dppo", "ipo"):
        delta = torch.exp(lp.detach()) - torch.exp(lq)
        if cfg.type == "dppo":
            masked = ((adv > 0) & (delta > cfg.prob_delta_high)) | ((adv < 0) & (delta < -cfg.prob_delta_low))
        else:
            masked = delta.abs() > cfg.ipo_eps
        pg = -adv * r * (~masked).to(r.dtype)
    elif cfg.type == "cispo":
        w = torch.clamp(r.detach(), 1 - cfg.cispo_clip_low, 1 + cfg.cispo_clip_high)
        pg = -w * adv * torch.exp(lp - lp.detach())
        masked = w != r.detach()
    else:
        clipped = torch.clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high)
        pg = -torch.minimum(r * adv, clipped * adv)
        masked = (r * adv).detach() > (clipped * adv).detach()
    return pg * (~ratio_masked).to(r.dtype) + kl, masked | ratio_masked


def _field(fields: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    """A per-token field, or zeros for the dummy micro-batches of a batch that filtering emptied
    (no sample, so packing knows no field names; the loss mask is all zero there anyway)."""
    return fields[name] if name in fields else torch.zeros_like(like)


class RLLoss(TokenLoss):
    """The configured policy-gradient loss over micro-batches carrying ``advantages`` and
    ``inference_logprobs`` fields (and ``sample_ids`` for ``gspo``)."""

    def __init__(self, cfg: LossConfig) -> None:
        self.cfg = cfg
        self.sequence_level = cfg.type == "gspo"

    def _loss(self, lp: torch.Tensor, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        m = fields["loss_mask"]
        if self.sequence_level and "sample_ids" not in fields and bool(m.any()):
            raise ValueError("--loss.type gspo: the micro-batch has no sample_ids field to group tokens by sample")
        return compute_policy_loss(
            lp,
            _field(fields, "inference_logprobs", lp),
            _field(fields, "advantages", lp),
            self.cfg,
            loss_mask=m,
            sample_ids=_field(fields, "sample_ids", lp),
        )

    def token_loss(self, lp: torch.Tensor, ent: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._loss(lp, fields)[0] * fields["loss_mask"]

    def stats(self, lp: torch.Tensor, ent: torch.Tensor, fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        m, lq = fields["loss_mask"], _field(fields, "inference_logprobs", lp)
        _, masked = self._loss(lp, fields)
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
