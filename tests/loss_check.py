"""The per-token check of a policy loss against hand-computed rows, shared by tests/unit/test_loss_formula.py
(dppo, ppo) and tests/unit/test_loss_family.py (ipo, cispo, gspo, IcePop)."""

from __future__ import annotations

import math

import torch

from prime_spmd.config.rl_sections import LossConfig
from prime_spmd.rl.loss import compute_policy_loss

KL = 0.1
MAX_LOG_RATIO = 2.0
E2 = math.exp(2.0)
# fp32 inputs, values O(1)-O(10): measured max |diff| 1.2e-7 (loss), 6e-8 (grad) on 2026-12-03
TOL = dict(rtol=1e-5, atol=1e-5)


def check_policy_loss(lp, lq, adv, cfg: LossConfig, rows: list[tuple], **kw) -> None:
    """Per token, ``compute_policy_loss(lp, lq, adv, cfg, **kw)`` against rows of (log r before the clamp, masked,
    pg, d pg / d lp): the loss is pg + KL (log r)^2 with log r clamped to +-MAX_LOG_RATIO, its derivative
    d pg / d lp + 2 KL log r (the KL part 0 where log r is clamped); the mask as given."""
    lp = torch.as_tensor(lp).clone().requires_grad_(True)
    per_tok, masked = compute_policy_loss(lp, torch.as_tensor(lq), torch.as_tensor(adv), cfg, **kw)
    per_tok.sum().backward()
    want_loss, want_grad = [], []
    for log_r, _, pg, dpg in rows:
        clamped = abs(log_r) > MAX_LOG_RATIO
        log_r = max(-MAX_LOG_RATIO, min(MAX_LOG_RATIO, log_r))
        want_loss.append(pg + KL * log_r**2)
        want_grad.append(dpg + (0.0 if clamped else 2 * KL * log_r))
    assert masked.tolist() == [m for _, m, _, _ in rows]
    torch.testing.assert_close(per_tok, torch.tensor(want_loss), **TOL)
    torch.testing.assert_close(lp.grad, torch.tensor(want_grad), **TOL)
