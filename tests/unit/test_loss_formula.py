"""The RL loss formula against hand-computed values (rl/loss.py's module docstring is the spec).

Per token: log r = clamp(lp - lq, -max_log_ratio, max_log_ratio), r = exp(log r);
dppo: loss = -A r keep + kl_coef (log r)^2, keep = 0 where p - q > prob_delta_high (A > 0) or
q - p > prob_delta_low (A < 0); ppo: loss = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_coef (log r)^2.
The tables below give, per token, the mask and the policy-gradient term and its derivative by hand;
the test adds the KL term (and its derivative 2 kl_coef log r) with plain Python arithmetic and
checks loss values, masks and d loss / d lp (autograd). Gradients are 0 where log r is clamped.

``train_step``'s normalization (the summed loss over the global number of trained tokens, whatever
the micro-batch split) is checked on a tiny model here and across 2 ranks in
tests/distributed/test_loss_normalization.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from prime_spmd.config.rl_sections import LossConfig
from prime_spmd.rl.loss import RLLoss, compute_policy_loss
from prime_spmd.trainer.packing import Sample, dummy_microbatch, pack
from prime_spmd.trainer.policy import PolicyModel
from prime_spmd.trainer.step import train_step
from tests.loss_check import E2, KL, MAX_LOG_RATIO, TOL, check_policy_loss

# (p, q, A, masked, pg, d pg / d lp): prob_delta_high 0.3 != prob_delta_low 0.1, so swapping them also shows.
DPPO_ROWS = [
    (0.9, 0.5, 1.0, True, 0.0, 0.0),  # A > 0, p - q = 0.4 > 0.3: masked
    (0.7, 0.5, 1.0, False, -1.4, -1.4),  # A > 0, p - q = 0.2 < 0.3: kept, -A r = -0.7 / 0.5
    (0.2, 0.7, 1.0, False, -0.2 / 0.7, -0.2 / 0.7),  # A > 0 and p fell: never masked
    (0.2, 0.7, -2.0, True, 0.0, 0.0),  # A < 0, q - p = 0.5 > 0.1: masked
    (0.5, 0.7, -2.0, True, 0.0, 0.0),  # A < 0, q - p = 0.2 > 0.1: masked
    (0.9, 0.5, -2.0, False, 3.6, 3.6),  # A < 0 and p rose: never masked, -A r = 2 * 1.8
    (0.55, 0.5, -0.5, False, 0.55, 0.55),  # A < 0, small move: kept, 0.5 * 1.1
    (0.6, 0.2, 0.0, False, 0.0, 0.0),  # A = 0: only the KL term
    (0.3, 0.3, 1.5, False, -1.5, -1.5),  # lp == lq: r = 1
]
# (log r before the clamp, A, masked, pg): clamped to +-2, so r = e^+-2 and the gradient is 0
DPPO_CLAMPED = [(5.0, -1.0, False, E2), (-5.0, 1.0, False, -1 / E2)]

# (r, A, clipped, pg, d pg / d lp) with clip_low 0.1, clip_high 0.3: r is clipped to [0.9, 1.3].
PPO_ROWS = [
    (1.5, 1.0, True, -1.3, 0.0),  # A > 0, r above 1.3: min(1.5, 1.3) = 1.3, no gradient
    (1.2, 1.0, False, -1.2, -1.2),  # A > 0, inside [0.9, 1.3] (clipped were clip_high 0.1)
    (0.5, 1.0, False, -0.5, -0.5),  # A > 0, r below 0.9: min(0.5, 0.9) = 0.5, not clipped
    (0.5, -2.0, True, 1.8, 0.0),  # A < 0, r below 0.9: min(-1.0, -1.8) = -1.8
    (0.85, -2.0, True, 1.8, 0.0),  # A < 0, r = 0.85 < 0.9 (inside were clip_low 0.3)
    (1.5, -2.0, False, 3.0, 3.0),  # A < 0, r above 1.3: min(-3.0, -2.6) = -3.0, not clipped
    (1.0, 0.7, False, -0.7, -0.7),  # r = 1
    (1.25, 0.0, False, 0.0, 0.0),  # A = 0: only the KL term
]
PPO_CLAMPED = [(5.0, -1.0, False, E2), (-5.0, 1.0, False, -1 / E2)]  # -min(e^2 * -1, 1.3 * -1) = e^2


def test_dppo_masks_ratio_kl_and_clamp_by_hand() -> None:
    cfg = LossConfig(type="dppo", prob_delta_high=0.3, prob_delta_low=0.1, kl_coef=KL, max_log_ratio=MAX_LOG_RATIO)
    lq = [math.log(q) for p, q, *_ in DPPO_ROWS] + [math.log(0.9) - 5.0, math.log(0.001) + 5.0]
    lp = [math.log(p) for p, *_ in DPPO_ROWS] + [math.log(0.9), math.log(0.001)]
    adv = [a for _, _, a, *_ in DPPO_ROWS] + [a for _, a, *_ in DPPO_CLAMPED]
    rows = [(math.log(p / q), m, pg, d) for p, q, _, m, pg, d in DPPO_ROWS]
    rows += [(lr, m, pg, 0.0) for lr, _, m, pg in DPPO_CLAMPED]
    check_policy_loss(torch.tensor(lp), torch.tensor(lq), torch.tensor(adv), cfg, rows)


def test_ppo_clips_both_sides_for_both_signs_by_hand() -> None:
    cfg = LossConfig(type="ppo", clip_low=0.1, clip_high=0.3, kl_coef=KL, max_log_ratio=MAX_LOG_RATIO)
    log_rs = [math.log(r) for r, *_ in PPO_ROWS] + [lr for lr, *_ in PPO_CLAMPED]
    lq = [math.log(0.4)] * len(log_rs)
    lp = [q + lr for q, lr in zip(lq, log_rs)]
    adv = [a for _, a, *_ in PPO_ROWS] + [a for _, a, *_ in PPO_CLAMPED]
    rows = [(math.log(r), m, pg, d) for r, _, m, pg, d in PPO_ROWS]
    rows += [(lr, m, pg, 0.0) for lr, _, m, pg in PPO_CLAMPED]
    check_policy_loss(torch.tensor(lp), torch.tensor(lq), torch.tensor(adv), cfg, rows)


@pytest.mark.parametrize("loss_type", ["dppo", "ppo"])
def test_kl_term_alone(loss_type: str) -> None:
    """A = 0: the loss is kl_coef (log r)^2 exactly; kl_coef = 0 and r = 1: exactly -A."""
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    lq = torch.tensor([-1.5, -1.0, -0.5])
    per_tok, _ = compute_policy_loss(lp, lq, torch.zeros(3), LossConfig(type=loss_type, kl_coef=0.5))
    per_tok.sum().backward()
    torch.testing.assert_close(per_tok, torch.tensor([0.5 * 0.25, 0.5 * 1.0, 0.0]))
    torch.testing.assert_close(lp.grad, torch.tensor([2 * 0.5 * 0.5, 2 * 0.5 * -1.0, 0.0]))
    adv = torch.tensor([1.0, -3.0, 0.25])
    per_tok, masked = compute_policy_loss(lq.clone(), lq, adv, LossConfig(type=loss_type, kl_coef=0.0))
    assert per_tok.tolist() == [-1.0, 3.0, -0.25] and not masked.any()


def test_rl_loss_applies_the_loss_mask_and_stats_by_hand() -> None:
    """RLLoss: 0 loss and gradient where loss_mask is 0; stats are sums over trained tokens with the
    mismatch KL exp(d) - d - 1 of the clamped d = lp - lq (exactly 0 where lp == lq, and positive,
    ~d^2 / 2, for a d where fp32 cancels)."""
    cfg = LossConfig(type="dppo", prob_delta_high=0.3, prob_delta_low=0.1, kl_coef=KL, max_log_ratio=MAX_LOG_RATIO)
    tiny = 2.0**-20  # -1 + 2^-20 is exact in fp32, so d is exactly 2^-20
    lq = torch.tensor([math.log(0.5), math.log(0.7), -1.0, -1.0, -3.0, -0.5])
    lp = torch.tensor([math.log(0.9), math.log(0.2), -1.0 + tiny, -1.0, 0.0, -0.1], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 1.0, 1.0, -1.0, 1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    ent = torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5, 100.0])
    fields = {"inference_logprobs": lq, "advantages": adv, "loss_mask": mask}
    loss = RLLoss(cfg)
    per_tok = loss.token_loss(lp, ent, fields)
    per_tok.sum().backward()
    # token 0: masked (A > 0, p - q = 0.4); token 1 masked (A < 0, q - p = 0.5); token 4: log r = 3 -> 2
    d = [math.log(0.9 / 0.5), math.log(0.2 / 0.7), tiny, 0.0, 2.0]
    want = [KL * d[0] ** 2, KL * d[1] ** 2, -math.exp(tiny) + KL * tiny**2, -1.0, math.exp(2.0) + KL * 4.0, 0.0]
    torch.testing.assert_close(per_tok, torch.tensor(want), **TOL)
    grad = [2 * KL * d[0], 2 * KL * d[1], -math.exp(tiny) + 2 * KL * tiny, -1.0, 0.0, 0.0]
    torch.testing.assert_close(lp.grad, torch.tensor(grad), **TOL)

    stats = loss.stats(lp.detach(), ent, fields)
    assert float(stats["tokens"]) == 5.0 and float(stats["masked_tokens"]) == 2.0
    assert float(stats["entropy_sum"]) == 7.5
    torch.testing.assert_close(float(stats["abs_log_ratio_sum"]), sum(abs(x) for x in d), rtol=1e-6, atol=0)
    kl = [math.exp(x) - x - 1 for x in d]
    torch.testing.assert_close(float(stats["mismatch_kl_sum"]), sum(kl), rtol=1e-6, atol=0)
    # the lp == lq token alone: exactly 0; the 2^-20 token alone: d^2/2 (+ d^3/6), not 0 or negative
    for i, want_kl in ((3, 0.0), (2, tiny**2 / 2 + tiny**3 / 6)):
        only = {**fields, "loss_mask": torch.nn.functional.one_hot(torch.tensor(i), 6).float()}
        got = float(loss.stats(lp.detach(), ent, only)["mismatch_kl_sum"])
        assert got == want_kl if want_kl == 0 else math.isclose(got, want_kl, rel_tol=1e-6), (i, got, want_kl)


def test_missing_fields_mean_zero_loss() -> None:
    """The dummy micro-batches of an emptied batch carry no advantages/inference_logprobs fields."""
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    fields = {"loss_mask": torch.zeros(2)}
    per_tok = RLLoss(LossConfig()).token_loss(lp, torch.zeros(2), fields)
    per_tok.sum().backward()
    assert per_tok.tolist() == [0.0, 0.0] and lp.grad.tolist() == [0.0, 0.0]


# --- train_step normalization on a tiny model ---------------------------------------------------------


class GradRecorder(torch.optim.SGD):
    """SGD with lr 0 that records the full gradients when ``train_step`` steps (it zeroes them after).

    With FSDP2 the grads are DTensors sharded on dim 0; ``full_tensor`` all-gathers them (every rank
    calls ``step``, in the same parameter order; no grad flows through a grad)."""

    def __init__(self, module: torch.nn.Module) -> None:
        named = list(module.named_parameters())
        super().__init__([p for _, p in named], lr=0.0)
        self.names = [n for n, _ in named]
        self.grads: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, closure=None) -> None:
        params = self.param_groups[0]["params"]
        self.grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in zip(self.names, params)
            if p.grad is not None
        }


def rl_samples(lengths: tuple[int, ...], seed: int = 0) -> list[Sample]:
    """Documents with a 2-token prompt, an untrained (environment) token mid-completion, one
    advantage per document (both signs) and inference logprobs spread so ratios clip both ways."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = [0, 0] + [1] * (n - 2)
        mask[n // 2] = 0
        adv = (1.0 + i) * (-1) ** i
        out.append(
            Sample(
                input_ids=torch.randint(5, 100, (n,), generator=g).tolist(),
                loss_mask=mask,
                fields={
                    "advantages": [adv] * n,
                    "inference_logprobs": (-2.0 - 5.0 * torch.rand(n, generator=g)).tolist(),
                    "sample_ids": [float(i)] * n,
                },
            )
        )
    return out


def token_mean_reference(lm, samples: list[Sample], loss) -> tuple[float, dict[str, torch.Tensor], dict]:
    """(loss, grads, stats) of the token mean over every trained token, computed in one piece: every
    document in one packed row, one forward, (loss sum) / (trained tokens), one backward."""
    (mb,) = pack(samples, sum(len(s.input_ids) for s in samples), 1)[0]
    policy = PolicyModel(copy.deepcopy(lm), "reference")
    fields = {**mb.fields, "loss_mask": mb.loss_mask.float()}
    out = policy(mb.input_ids, mb.position_ids, mb.targets, 1.0, loss, fields)
    loss_sum, lp, ent = out.loss_sum, out.logprob_T, out.entropy_T
    n = mb.loss_mask.sum()
    (loss_sum / n).backward()
    stats = {k: float(v) for k, v in loss.stats(lp, ent, fields).items()}
    return float(loss_sum.detach() / n), {k: p.grad for k, p in policy.named_parameters()}, stats


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from prime_spmd.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("lossnorm"), "qwen3-nano", initializer_range=0.3)
    return AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("loss_type", ["dppo", "ppo", "ipo", "cispo", "gspo"])
def test_train_step_divides_by_all_trained_tokens_of_the_micro_batches(tiny_lm, loss_type: str) -> None:
    # prob_delta / ipo_eps 0.02 so that dppo / ipo mask some tokens of this near-uniform model (p ~ 1/101);
    # gspo clip 0.5: some samples clipped, some not
    loss = RLLoss(
        LossConfig(
            type=loss_type,
            kl_coef=0.05,
            prob_delta_high=0.02,
            prob_delta_low=0.02,
            ipo_eps=0.02,
            gspo_clip_low=0.5,
            gspo_clip_high=0.5,
        )
    )
    samples = rl_samples((20, 7, 12, 5))
    mbs = pack(samples, 20, 1)[0] + [dummy_microbatch(sorted(samples[0].fields))]
    counts = [int(mb.loss_mask.sum()) for mb in mbs]
    assert len(set(counts)) >= 3, counts  # unequal micro-batches: a per-micro-batch mean would differ
    want_loss, want_grads, want_stats = token_mean_reference(tiny_lm, samples, loss)
    assert 0 < want_stats["masked_tokens"] < want_stats["tokens"], want_stats  # both masked and kept tokens

    policy = PolicyModel(copy.deepcopy(tiny_lm), "reference")
    opt = GradRecorder(policy)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    stats = train_step(policy, opt, sched, mbs, loss, device=torch.device("cpu"), max_grad_norm=0.0)
    assert stats["trained_tokens"] == sum(counts) == want_stats["tokens"]
    assert math.isclose(stats["loss"], want_loss, rel_tol=1e-5, abs_tol=1e-6), (stats["loss"], want_loss)
    for k in ("masked_tokens", "mismatch_kl_sum", "entropy_sum"):
        assert math.isclose(stats[k], want_stats[k], rel_tol=1e-5), (k, stats[k], want_stats[k])
    assert opt.grads is not None and set(opt.grads) == set(want_grads)
    for name, want in want_grads.items():
        # fp32, other summation order: measured max |diff| / max |grad| 2.2e-7 (2026-12-03)
        torch.testing.assert_close(opt.grads[name], want, rtol=1e-4, atol=1e-5 * want.abs().max().item(), msg=name)


def test_train_step_refuses_an_optimizer_that_holds_none_of_the_trained_parameters(tiny_lm) -> None:
    # what torch 2.11 on CUDA did before distributed/fsdp.py settle_parameters: the modules' parameters were new
    # objects after the first forward, the optimizer kept the old ones, and every step silently changed nothing
    loss = RLLoss(LossConfig(type="dppo"))
    samples = rl_samples((20, 7))
    policy = PolicyModel(copy.deepcopy(tiny_lm), "reference")
    stale = torch.optim.SGD([torch.nn.Parameter(p.detach().clone()) for p in policy.parameters()], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(stale, lambda _: 1.0)
    with pytest.raises(RuntimeError, match="none of them belongs to the optimizer"):
        train_step(policy, stale, sched, pack(samples, 20, 1)[0], loss, device=torch.device("cpu"))


def test_the_policy_output_is_a_container_fsdp2_looks_into(tiny_lm) -> None:
    # torch 2.11's FSDP2 registers its pre-backward hook on the tensors tree_flatten finds in the root module's
    # output; a dataclass is a leaf there, so the hook, the gradient reduction and the reshard never ran on the GPU
    from torch.utils._pytree import tree_flatten

    loss = RLLoss(LossConfig(type="dppo"))
    mb = pack(rl_samples((20, 7)), 20, 1)[0][0]
    fields = {**mb.fields, "loss_mask": mb.loss_mask.float()}
    out = PolicyModel(copy.deepcopy(tiny_lm), "reference")(mb.input_ids, mb.position_ids, mb.targets, 1.0, loss, fields)
    leaves, _ = tree_flatten(out)
    assert any(t is out.loss_sum for t in leaves) and out.loss_sum.requires_grad
