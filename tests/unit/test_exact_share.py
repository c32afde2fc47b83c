"""Exact mode with prompt sharing (``trainer/exact.py``, ``_share_plan``; ``models/exact.py``, ``SharedRows``): a
packed row whose documents share prompts runs each prompt once, and every hidden state, hence every logprob, is the
same bits as the unshared rows' and the engine's. CPU: the Triton interpreter (``device`` fixture: CUDA compiles)."""

from __future__ import annotations

import pytest
import torch

from prime_spmd.models import registry
from prime_spmd.models.registry import adapter_for
from prime_spmd.models.tiny import build_tiny_model
from prime_spmd.trainer.exact import exact_hidden, exact_logprobs
from tests.unit.test_exact_mode import _engine, _requests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("nano"), "qwen3-nano", seed=0, initializer_range=0.3)


def _packed(seqs: list[list[int]], prompt_lens: list[int], device):
    """One packed row of ``seqs`` (positions restart at each), the loss mask of their completions."""
    ids = torch.tensor([sum(seqs, [])], device=device)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None].to(device)
    mask = torch.cat([torch.arange(len(s)) >= p - 1 for s, p in zip(seqs, prompt_lens)])
    for o in torch.tensor([len(s) for s in seqs]).cumsum(0) - 1:  # a document's last position has no target in it
        mask[o] = False
    return ids, pos, mask.to(device)


def test_shared_rows_equal_unshared_and_run_each_prompt_once(model_dir, device):
    lm = registry.load_custom(str(model_dir), device=device, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(3, 60, (n,), generator=g).tolist() for n in (5, 8, 4))
    comp = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (3, 7, 1, 4, 6, 2)]
    prompts = [a, a, b, a, b, c]  # two groups (a x3, b x2) and a singleton, interleaved as packing leaves them
    seqs = [p + x for p, x in zip(prompts, comp)]
    ids, pos, mask = _packed(seqs, [len(p) for p in prompts], device)
    with torch.no_grad():
        plain, _, not_run_plain = exact_hidden(lm, ids, pos)
        shared, _, not_run = exact_hidden(lm, ids, pos, mask)
    assert not_run_plain == 0 and not_run == 2 * len(a) + len(b)  # the prompt copies left out
    assert torch.equal(plain, shared)

    # gradients through the shared prefix (its K/V read by every suffix row) match the unshared rows'
    w = torch.randn(plain.shape, generator=g).to(device)
    grads = []
    for m in (None, mask):
        lm.zero_grad()
        (exact_hidden(lm, ids, pos, m)[0] * w).sum().backward()
        grads.append([p.grad.clone() for p in lm.parameters() if p.grad is not None])
    for x, y in zip(*grads, strict=True):  # fp32 sums in another order: within 1e-4 of each tensor's largest grad
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-4 * float(x.abs().max()))


def test_no_shared_prompt_or_no_gain_keeps_the_unshared_rows(model_dir, device):
    lm = registry.load_custom(str(model_dir), device=device, dtype=torch.float32).eval()
    seqs, plens = [[5, 6, 7, 8], [9, 10, 11]], [2, 2]
    ids, pos, mask = _packed(seqs, plens, device)
    with torch.no_grad():
        assert exact_hidden(lm, ids, pos, mask)[2] == 0
    ids, pos, _ = _packed([[5, 6, 7], [5, 6, 7]], [2, 2], device)
    with pytest.raises(ValueError, match="--model.exact: every document must start at position 0"):
        exact_hidden(lm, ids, pos + 1, torch.ones(6, dtype=torch.bool, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_logprobs_equal_shared_trainer(model_dir, dtype, device):
    """GRPO-shaped: groups of samples of one prompt, the trainer's packed row shares each prompt; every completion
    token's logprob equals the engine's bit for bit."""
    eng = _engine(model_dir, dtype, device)
    prompts = ["hello world"] * 3 + ["abc"] * 2 + ["x"]
    outs = eng.generate(_requests(prompts, [5, 2, 7, 3, 6, 4], list(range(6)), temperature=0.8))
    outs = sorted(outs, key=lambda c: c.request_id)
    seqs = [c.prompt_ids + c.token_ids for c in outs]
    ids, pos, mask = _packed(seqs, [len(c.prompt_ids) for c in outs], device)
    lm = registry.load_custom(str(model_dir), device=device, dtype=dtype).eval()
    with torch.no_grad():
        hidden, _, not_run = exact_hidden(lm, ids, pos, mask)
        targets = torch.cat([ids[0, 1:], ids.new_zeros(1)])
        lp, _ = exact_logprobs(hidden, adapter_for(lm).lm_head_weight(), targets, 0.8)
    assert not_run > 0
    o = 0
    for c, s in zip(outs, seqs):
        n = len(c.prompt_ids)
        assert torch.equal(lp[o + n - 1 : o + n - 1 + len(c.token_ids)].cpu(), torch.tensor(c.logprobs)), c.request_id
        o += len(s)
