"""The ipo, cispo and gspo losses and IcePop token masking (rl/loss.py's module docstring is the spec)
against hand-computed values: per token the mask, the policy-gradient term and d pg / d lp; the test adds
the KL term kl_coef (log r)^2 (derivative 2 kl_coef log r, 0 where log r is clamped).

gspo groups tokens by the ``sample_ids`` field: checked on two samples packed in one micro-batch, and
through ``PolicyModel``'s fused path (a sequence-level loss must see the whole micro-batch at once).
"""

from __future__ import annotations

import copy
import math

import torch

from prime_spmd.config.rl_sections import LossConfig
from prime_spmd.rl.loss import RLLoss, compute_policy_loss
from prime_spmd.trainer.packing import Sample, pack
from tests.loss_check import KL, MAX_LOG_RATIO, TOL, check_policy_loss

# (p, q, A, masked, pg, d pg / d lp) with ipo_eps 0.3: masked where |p - q| > 0.3, whatever the sign of A
IPO_ROWS = [
    (0.9, 0.5, 1.0, True, 0.0, 0.0),  # p - q = 0.4
    (0.7, 0.5, 1.0, False, -1.4, -1.4),  # p - q = 0.2: -A r = -0.7 / 0.5
    (0.2, 0.7, 1.0, True, 0.0, 0.0),  # q - p = 0.5 with A > 0: masked (dppo keeps it)
    (0.9, 0.5, -2.0, True, 0.0, 0.0),  # p - q = 0.4 with A < 0: masked (dppo keeps it)
    (0.5, 0.7, -2.0, False, 2 / 1.4, 2 / 1.4),  # q - p = 0.2: -A r = 2 * 0.5 / 0.7
    (0.03, 0.01, 1.0, False, -3.0, -3.0),  # r = 3 but |p - q| = 0.02: a probability band, not a ratio one
    (0.3, 0.3, 1.5, False, -1.5, -1.5),  # r = 1
]


def test_ipo_masks_by_absolute_probability_change_by_hand() -> None:
    cfg = LossConfig(type="ipo", ipo_eps=0.3, kl_coef=KL, max_log_ratio=MAX_LOG_RATIO)
    lp = [math.log(p) for p, *_ in IPO_ROWS]
    lq = [math.log(q) for _, q, *_ in IPO_ROWS]
    rows = [(math.log(p / q), m, pg, d) for p, q, _, m, pg, d in IPO_ROWS]
    check_policy_loss(lp, lq, [a for _, _, a, *_ in IPO_ROWS], cfg, rows)


# (log r, A, clipped, pg, d pg / d lp) with cispo_clip_low 0.2, cispo_clip_high 0.3: w = sg(clip(r, 0.8, 1.3)),
# pg = -w A with gradient -w A on every token, clipped ones included (ppo gives those 0)
CISPO_ROWS = [
    (math.log(1.5), 1.0, True, -1.3, -1.3),
    (math.log(1.2), 1.0, False, -1.2, -1.2),
    (math.log(0.5), -2.0, True, 1.6, 1.6),
    (math.log(0.5), 1.0, True, -0.8, -0.8),
    (0.0, 0.7, False, -0.7, -0.7),
    (5.0, -1.0, True, 1.3, 1.3),  # log r clamped to 2: w = 1.3 still, and the gradient still flows
]


def test_cispo_clips_the_weight_and_keeps_the_gradient_by_hand() -> None:
    cfg = LossConfig(type="cispo", cispo_clip_low=0.2, cispo_clip_high=0.3, kl_coef=KL, max_log_ratio=MAX_LOG_RATIO)
    lq = [math.log(0.4) - 1.0] * len(CISPO_ROWS)
    lp = [q + lr for q, (lr, *_) in zip(lq, CISPO_ROWS)]
    rows = [(lr, m, pg, d) for lr, _, m, pg, d in CISPO_ROWS]
    check_policy_loss(lp, lq, [a for _, a, *_ in CISPO_ROWS], cfg, rows)
    # the default cispo_clip_low = 1: no lower clip (w = r = 0.1)
    lp0 = torch.tensor([math.log(0.1)], requires_grad=True)
    per_tok, masked = compute_policy_loss(lp0, torch.zeros(1), torch.tensor([1.0]), LossConfig(type="cispo", kl_coef=0))
    per_tok.sum().backward()
    torch.testing.assert_close(per_tok, torch.tensor([-0.1]))
    torch.testing.assert_close(lp0.grad, torch.tensor([-0.1]))
    assert not masked.any()


def test_icepop_masks_tokens_outside_the_ratio_band_for_any_type() -> None:
    """[mask_ratio_low, mask_ratio_high] = [0.5, 2]: r = 0.4 and r = 2.5 lose their pg term, keep the KL term."""
    log_rs = [math.log(0.4), math.log(0.6), math.log(1.9), math.log(2.5)]
    lq = [-1.5] * 4
    lp = [q + lr for q, lr in zip(lq, log_rs)]
    adv = [1.0, -1.0, 1.0, -1.0]
    base = dict(token_mask="icepop", mask_ratio_low=0.5, mask_ratio_high=2.0, kl_coef=KL, max_log_ratio=MAX_LOG_RATIO)
    # dppo with wide deltas (nothing dppo-masked): pg = -A r on the kept tokens
    cfg = LossConfig(type="dppo", prob_delta_high=1.0, prob_delta_low=1.0, **base)
    rows = [(log_rs[0], True, 0, 0), (log_rs[1], False, 0.6, 0.6), (log_rs[2], False, -1.9, -1.9)]
    check_policy_loss(lp, lq, adv, cfg, rows + [(log_rs[3], True, 0, 0)])
    # cispo (w = clip(r, 0, 1.28)): the masked tokens lose their gradient too
    cfg = LossConfig(type="cispo", **base)
    rows = [(log_rs[0], True, 0, 0), (log_rs[1], False, 0.6, 0.6), (log_rs[2], True, -1.28, -1.28)]
    check_policy_loss(lp, lq, adv, cfg, rows + [(log_rs[3], True, 0, 0)])
    # token_mask none: the same cispo rows, r = 0.4 and 2.5 trained
    cfg = LossConfig(type="cispo", kl_coef=KL, max_log_ratio=MAX_LOG_RATIO)
    rows[0] = (log_rs[0], False, -0.4, -0.4)
    check_policy_loss(lp, lq, adv, cfg, rows + [(log_rs[3], True, 1.28, 1.28)])


# gspo, gspo_clip_low 0.1, gspo_clip_high 0.2: s clipped to [0.9, 1.2]. Tokens: (sample, trained, log r, A).
GSPO_TOKENS = [
    (0, False, 0.6, 1.0),  # a prompt token: not in s_0
    (0, True, 0.3, 1.0),
    (0, True, -0.1, 1.0),
    (0, True, 0.1, 1.0),
    (0, True, 1.0, 1.0),  # r = e > 2: IcePop-masked when on (band [0.5, 2])
    (1, True, 0.5, 2.0),
    (1, True, 0.3, 2.0),
    (2, True, 0.2, -0.5),
    (2, True, -0.2, -0.5),
    (2, True, 0.0, -0.5),
    (2, True, 0.3, -0.5),
]


def _gspo_case(icepop: bool):
    """(lp, lq, adv, loss_mask, sample_ids, rows) for GSPO_TOKENS, hand-computed.

    s_0 = exp(mean(0.3, -0.1, 0.1, 1.0)) = e^0.325 = 1.384 > 1.2: clipped, pg = -1.2, no gradient; with IcePop
    the r = e token leaves the mean: s_0 = e^0.1 = 1.105, pg = -s_0 and d / d lp_t = -A s_0 on each of the 3.
    s_1 = e^0.4 = 1.492, A = 2: min(2.984, 2.4) = 2.4, clipped (with IcePop too: r = e^0.5 = 1.65 < 2).
    s_2 = e^0.075 = 1.0779, A = -0.5: min(-0.539, -0.539), not clipped: pg = 0.539, d / d lp_t = -A s_2 = 0.539.
    """
    s0 = math.exp(0.1) if icepop else math.exp(0.325)
    s2 = math.exp(0.075)
    rows = [(0.6, False, 0.0, 0.0)]
    if icepop:
        rows += [(lr, False, -s0, -s0) for lr in (0.3, -0.1, 0.1)] + [(1.0, True, 0.0, 0.0)]
    else:
        rows += [(lr, True, -1.2, 0.0) for lr in (0.3, -0.1, 0.1, 1.0)]
    rows += [(0.5, True, -2.4, 0.0), (0.3, True, -2.4, 0.0)]
    rows += [(lr, False, 0.5 * s2, 0.5 * s2) for lr in (0.2, -0.2, 0.0, 0.3)]
    lq = [-1.0 - 0.1 * i for i in range(len(GSPO_TOKENS))]
    lp = [q + lr for q, (_, _, lr, _) in zip(lq, GSPO_TOKENS)]
    mask = torch.tensor([float(t) for _, t, _, _ in GSPO_TOKENS])
    ids = torch.tensor([float(s) for s, *_ in GSPO_TOKENS])
    return lp, lq, [a for *_, a in GSPO_TOKENS], mask, ids, rows


def test_gspo_sequence_ratio_per_sample_by_hand() -> None:
    for icepop in (False, True):
        lp, lq, adv, mask, ids, rows = _gspo_case(icepop)
        extra = dict(token_mask="icepop", mask_ratio_low=0.5, mask_ratio_high=2.0) if icepop else {}
        cfg = LossConfig(type="gspo", gspo_clip_low=0.1, gspo_clip_high=0.2, kl_coef=KL, **extra)
        # the prompt token (mask 0) has a KL value here; RLLoss.token_loss zeroes it with the loss mask
        check_policy_loss(lp, lq, adv, cfg, rows, loss_mask=mask, sample_ids=ids)


def _gspo_sample(n: int, sid: int, adv: float, seed: int) -> Sample:
    g = torch.Generator().manual_seed(seed)
    return Sample(
        input_ids=list(range(5, 5 + n)),
        loss_mask=[0, 0] + [1] * (n - 2),
        fields={
            "advantages": [adv] * n,
            "inference_logprobs": (-1.0 - 0.2 * torch.rand(n, generator=g)).tolist(),
            "sample_ids": [float(sid)] * n,
        },
    )


def test_gspo_two_samples_packed_in_one_micro_batch_equal_each_alone() -> None:
    """Two samples in one packed row (the sample_ids field is shifted with the targets; each document's last
    position holds 0.0 and is untrained): the loss and its gradient equal those of each sample packed alone.
    Wide clips, so both samples' ratios are unclipped and every token's gradient depends on its sample's mean."""
    loss = RLLoss(LossConfig(type="gspo", gspo_clip_low=0.5, gspo_clip_high=0.5, kl_coef=KL))
    samples = [_gspo_sample(6, 0, 1.0, seed=0), _gspo_sample(5, 1, -2.0, seed=1)]
    (both,) = pack(samples, 11, 1)[0]
    assert both.num_docs == 2
    lp = -1.1 + 0.05 * torch.arange(11.0)

    def run(mb, lp):
        lp = lp.clone().requires_grad_(True)
        fields = {**mb.fields, "loss_mask": mb.loss_mask.float()}
        per_tok = loss.token_loss(lp, torch.zeros_like(lp), fields)
        per_tok.sum().backward()
        return per_tok.detach(), lp.grad

    got_loss, got_grad = run(both, lp)
    alone = [run(pack([s], 11, 1)[0][0], lp[o : o + n]) for s, o, n in ((samples[0], 0, 6), (samples[1], 6, 5))]
    torch.testing.assert_close(got_loss, torch.cat([a[0] for a in alone]), **TOL)
    torch.testing.assert_close(got_grad, torch.cat([a[1] for a in alone]), **TOL)
    # and by hand for sample 1 alone: positions 6..9 train (targets 2..4 of the doc; 10 is its end)
    m = both.loss_mask[6:].float()
    log_r = (lp[6:] - both.fields["inference_logprobs"][6:]) * m
    s1 = math.exp(float(log_r.sum() / m.sum()))
    want = [(2.0 * s1 + KL * float(x) ** 2) * float(k) for x, k in zip(log_r, m)]
    torch.testing.assert_close(got_loss[6:], torch.tensor(want), **TOL)


def test_sequence_level_loss_skips_the_chunked_fused_path(tmp_path, monkeypatch) -> None:
    """PolicyModel(loss_impl="fused"), with a logits budget that makes the fused loss take 4-token chunks, calls
    gspo's token_loss once with the whole micro-batch, with the same result as the reference impl."""
    from prime_spmd.kernels.lm_logprob import fused_loss
    from transformers import AutoModelForCausalLM

    from prime_spmd.models.tiny import build_tiny_model
    from prime_spmd.trainer.policy import PolicyModel

    lm = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path, "qwen3-nano"))
    monkeypatch.setattr(fused_loss, "LOGITS_BUFFER_ELEMENTS", 4 * lm.config.vocab_size)
    calls = []

    class Spy(RLLoss):
        def token_loss(self, lp, ent, fields):
            calls.append(lp.shape[0])
            return super().token_loss(lp, ent, fields)

    loss = Spy(LossConfig(type="gspo", gspo_clip_low=0.5, gspo_clip_high=0.5))
    samples = [_gspo_sample(6, 0, 1.0, seed=0), _gspo_sample(5, 1, -2.0, seed=1)]
    (mb,) = pack(samples, 11, 1)[0]
    fields = {**mb.fields, "loss_mask": mb.loss_mask.float()}
    out = {}
    for impl in ("fused", "reference"):
        policy = PolicyModel(copy.deepcopy(lm), impl)
        out[impl] = float(policy(mb.input_ids, mb.position_ids, mb.targets, 1.0, loss, fields).loss_sum.detach())
    assert calls == [11, 11]
    assert math.isclose(out["fused"], out["reference"], rel_tol=1e-6)
