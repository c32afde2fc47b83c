"""Prompt (prefix) sharing in the trainer's forward (trainer/packing.py: ShareLayout, share units in pack) gives
the unshared paths' logprobs, entropy, loss and gradients. About 3 s on 2 cores."""

from __future__ import annotations

import copy

import pytest
import torch

from prime_spmd.trainer.loss import TokenLoss
from prime_spmd.trainer.packing import Sample, pack, share_layout
from prime_spmd.trainer.policy import PolicyModel


class _MeanLogprob(TokenLoss):
    def token_loss(self, lp, ent, fields):
        return -(lp + 0.1 * ent) * fields["advantages"] * fields["loss_mask"]


def _doc(prompt: list[int], rest: list[int], mask_rest: list[int] | None = None, adv: float = 1.0) -> Sample:
    n = len(prompt) + len(rest)
    mask = [0] * len(prompt) + (mask_rest if mask_rest is not None else [1] * len(rest))
    return Sample(input_ids=prompt + rest, loss_mask=mask, fields={"advantages": [adv] * n})


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(1, 60, (n,), generator=g).tolist()

    pa, pb, pc = rand(7), rand(4), rand(3)
    return [
        # group A: three suffix lengths, all starting with token 5 (the shared prefix is longer than the prompt)
        _doc(pa, [5, 6] + rand(3), adv=0.5),
        _doc(rand(9), rand(4), adv=-0.3),  # no share partner
        _doc(pa, [5, 6] + rand(8), adv=-1.0),
        _doc(pb, rand(6), adv=0.7),  # group B
        _doc(pa, [5, 7], adv=0.2),
        _doc(pb, rand(2), adv=-0.4),
        # group C: trained from token 3 on, then untrained tokens (a tool response) inside the suffix, so the
        # shared prefix is shorter than the untrained part of the document
        _doc(pc, rand(6), mask_rest=[1, 1, 0, 0, 1, 1], adv=0.9),
        _doc(pc, rand(5), mask_rest=[1, 0, 0, 1, 1], adv=-0.6),
        _doc(rand(5), rand(0) + [3], mask_rest=[0]),  # nothing trained: never shared
    ]


def test_share_layout_rows_and_mask() -> None:
    # two documents [1 2 | 3 4] and [1 2 | 5]: prompt 1 2, first trained token at index 2; then a solo one
    samples = [_doc([1, 2], [3, 4]), _doc([1, 2], [5]), _doc([7, 8, 9], [6])]
    (mb,) = pack(samples, micro_batch_tokens=64, num_ranks=1)[0]
    layout = share_layout(mb.input_ids, mb.position_ids, mb.loss_mask)
    assert layout is not None and layout.num_shared_tokens == 2
    # segments: [1 2 3 4 5] (5 tokens, the row width) and [7 8 9 6], one row each
    assert layout.input_ids_RW.tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 6, 0]]
    assert layout.position_ids_RW.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 3, 0]]
    assert layout.flat_index_P.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 8]
    m = layout.attn_mask_RWW.int().tolist()
    assert m[0] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]
    assert m[1] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 1]]  # pad: itself
    assert share_layout(mb.input_ids, mb.position_ids, mb.loss_mask, max_mask_elements=2 * 5 * 5 - 1) is None
    other = [_doc([1, 2], [3]), _doc([1, 3], [3])]  # different prompts: nothing to share
    (mb,) = pack(other, micro_batch_tokens=64, num_ranks=1)[0]
    assert share_layout(mb.input_ids, mb.position_ids, mb.loss_mask) is None


def test_pack_keeps_share_groups_together() -> None:
    # by length alone, first-fit decreasing would put the two 9-token documents of group 1 into different bins
    samples = [_doc([1, 1, 1], [2] * 6), _doc([4] * 8, [2]), _doc([1, 1, 1], [3] * 6), _doc([5] * 6, [2, 2])]
    samples += [_doc([9] * 3, [2] * 2, adv=float(k)) for k in range(4)]  # a 20-token group: more than a bin
    per_rank = pack(samples, micro_batch_tokens=19, num_ranks=2)
    bins = [tuple(mb.input_ids[0].tolist()) for mbs in per_rank for mb in mbs if mb.num_tokens > 2]
    assert sum(len(b) for b in bins) == sum(len(s.input_ids) for s in samples)
    group1 = [b for b in bins if b[:3] == (1, 1, 1) or b[9:12] == (1, 1, 1)]
    assert len(group1) == 1 and group1[0].count(1) == 6  # both documents in one micro-batch
    assert sorted(b.count(9) for b in bins if 9 in b) == [3, 9]  # the big group cut into 15 + 5 tokens
    assert pack(samples, 19, 2)[1][0].input_ids.tolist() == per_rank[1][0].input_ids.tolist()  # deterministic


def _run(policy: PolicyModel, mb) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int]:
    fields = {**mb.fields, "loss_mask": mb.loss_mask.float()}
    out = policy(mb.input_ids, mb.position_ids, mb.targets, 0.9, _MeanLogprob(), fields)
    out.loss_sum.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    return out.loss_sum.detach(), out.logprob_T, out.entropy_T, grads, out.shared_tokens


def test_shared_prompts_match_unshared(tmp_path) -> None:
    from prime_spmd.config.sections import ModelConfig
    from prime_spmd.models.loading import load_model
    from prime_spmd.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path, "qwen3-nano")
    lm = load_model(ModelConfig(path=str(path), impl="custom"), torch.device("cpu"))
    (mb,) = pack(_samples(), micro_batch_tokens=128, num_ranks=1)[0]
    layout = share_layout(mb.input_ids, mb.position_ids, mb.loss_mask)
    # 3 share groups and 2 solo documents (5 segments) in 2-4 rows: some row holds more than one segment
    assert layout is not None and 2 <= layout.input_ids_RW.shape[0] <= 4
    assert layout.num_shared_tokens == 2 * (7 + 1) + 4 + 3  # prefix lengths 8 (A), 4 (B), 3 (C)
    shared = PolicyModel(copy.deepcopy(lm), "reference")
    assert shared.share_prompts
    l1, lp1, e1, g1, shared_tokens = _run(shared, mb)
    assert shared_tokens == layout.num_shared_tokens
    for unpack in (False, True):  # the masked packed row and the padded one-document rows
        l0, lp0, e0, g0, _ = _run(
            PolicyModel(copy.deepcopy(lm), "reference", unpack_documents=unpack, share_prompts=False), mb
        )
        # measured (fp32, both unshared paths): logprob max abs diff 4.8e-7, entropy 9.5e-7, loss 7.5e-8
        # relative, grads 1.9e-6 max abs (largest |grad| 8.2): rounding of other GEMM shapes and of the sum
        # of a prefix's gradient over its group
        torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(e1, e0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)


def test_share_prompts_only_where_supported(tmp_path) -> None:
    from prime_spmd.config.sections import ModelConfig
    from prime_spmd.models.loading import load_model
    from prime_spmd.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path, "qwen3-nano")
    hf = PolicyModel(load_model(ModelConfig(path=str(path), impl="hf"), torch.device("cpu")))
    assert not hf.share_prompts and not hf.adapter.supports_prefix_sharing()
    (mb,) = pack(_samples(), micro_batch_tokens=128, num_ranks=1)[0]
    layout = share_layout(mb.input_ids, mb.position_ids, mb.loss_mask)
    with pytest.raises(ValueError, match="no explicit attention mask"):
        hf.adapter.forward_hidden_routed(layout.input_ids_RW, layout.position_ids_RW, layout.attn_mask_RWW)


def test_train_step_counts_the_tokens_the_blocks_ran(tmp_path) -> None:
    # what MFU multiplies the blocks' parameters by: packed tokens less the prompt copies sharing skipped
    from prime_spmd.config.sections import ModelConfig
    from prime_spmd.models.loading import load_model
    from prime_spmd.models.tiny import build_tiny_model
    from prime_spmd.trainer.step import train_step

    path = build_tiny_model(tmp_path, "qwen3-nano")
    lm = load_model(ModelConfig(path=str(path), impl="custom"), torch.device("cpu"))
    mbs = pack(_samples(), micro_batch_tokens=48, num_ranks=1)[0]
    assert len(mbs) >= 2  # the count sums over micro-batches
    shared_tokens = 0
    for mb in mbs:
        layout = share_layout(mb.input_ids, mb.position_ids, mb.loss_mask)
        shared_tokens += layout.num_shared_tokens if layout is not None else 0
    assert shared_tokens > 0
    packed = sum(mb.num_tokens for mb in mbs)
    for share, want in ((True, packed - shared_tokens), (False, packed)):
        policy = PolicyModel(copy.deepcopy(lm), "reference", share_prompts=share)
        opt = torch.optim.SGD(policy.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        stats = train_step(policy, opt, sched, mbs, _MeanLogprob(), device=torch.device("cpu"))
        assert stats["model_tokens"] == want, (share, stats["model_tokens"], want)


def test_pack_with_shared_prompts_budgets_the_tokens_the_model_runs() -> None:
    from prime_spmd.trainer.packing import _unit_cost

    # group A: a 10-token prompt x 4 completions of 5: 60 packed tokens, 30 through the model
    group_a = [_doc([1] * 10, [2, 3, 4, 5, 6], adv=float(k)) for k in range(4)]
    unshared = pack(group_a, micro_batch_tokens=32, num_ranks=1)[0]
    shared = pack(group_a, micro_batch_tokens=32, num_ranks=1, share_prompts=True)[0]
    assert [mb.num_tokens for mb in unshared] == [30, 30] and [mb.num_tokens for mb in shared] == [60]
    # group B: a 20-token prompt x 4 completions of 2: 28 model tokens fit, but 88 packed tokens pass 2 x 32
    group_b = [_doc([7] * 20, [8, 9], adv=float(k)) for k in range(4)]
    mbs = pack(group_b, micro_batch_tokens=32, num_ranks=1, share_prompts=True)[0]
    assert [mb.num_tokens for mb in mbs] == [44, 44]  # a third 22-token sample would make 66 > 64
    everything = group_a + group_b + _samples()
    for mb in pack(everything, micro_batch_tokens=32, num_ranks=2, share_prompts=True)[0]:
        assert mb.num_tokens <= 64
    # the bins' model tokens, as the trainer would count them, stay within the budget
    for mb in pack(everything, micro_batch_tokens=32, num_ranks=1, share_prompts=True)[0]:
        layout = share_layout(mb.input_ids, mb.position_ids, mb.loss_mask)
        model_tokens = mb.num_tokens - (layout.num_shared_tokens if layout is not None else 0)
        assert model_tokens <= 32, (mb.num_tokens, model_tokens)
    assert _unit_cost(group_a, [0, 1, 2, 3], True) == 30 and _unit_cost(group_a, [0, 1, 2, 3], False) == 60
