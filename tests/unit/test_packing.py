"""Packing: balanced micro-batches, shifted targets, and no attention across packed documents."""

from __future__ import annotations

import pytest
import torch

from prime_spmd.trainer.packing import Sample, pack
from prime_spmd.trainer.policy import PolicyModel


def _samples(lengths: list[int]) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        ids = torch.randint(5, 90, (n,), generator=g).tolist()
        out.append(Sample(input_ids=ids, loss_mask=[0] * 2 + [1] * (n - 2), fields={"adv": [float(n)] * n}))
    return out


def test_pack_balances_and_pads_ranks() -> None:
    samples = _samples([30, 5, 17, 9, 12, 3, 28])
    per_rank = pack(samples, micro_batch_tokens=32, num_ranks=2)
    assert len(per_rank[0]) == len(per_rank[1])
    docs = sum(mb.num_docs for mbs in per_rank for mb in mbs)
    trained = sum(int(mb.loss_mask.sum()) for mbs in per_rank for mb in mbs)
    assert trained == sum(len(s.input_ids) - 2 for s in samples)  # every trained target once
    assert docs >= len(samples)
    for mbs in per_rank:
        for mb in mbs:
            assert mb.num_tokens <= 32
            starts = (mb.position_ids[0] == 0).nonzero().flatten().tolist()
            for s, e in zip(starts, starts[1:] + [mb.num_tokens]):
                # targets are the next token of the same document; the last position trains nothing
                assert torch.equal(mb.targets[s : e - 1], mb.input_ids[0, s + 1 : e])
                assert not mb.loss_mask[e - 1]
                assert torch.all(mb.fields["adv"][s : e - 1] == float(e - s))


@pytest.mark.parametrize("impl", ["hf", "custom"])
def test_packed_logprobs_equal_unpacked(tmp_path, impl: str) -> None:
    from prime_spmd.config.sections import ModelConfig
    from prime_spmd.models.loading import load_model
    from prime_spmd.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path, "qwen3-nano")
    lm = load_model(ModelConfig(path=str(path), impl=impl), torch.device("cpu")).eval()
    policy = PolicyModel(lm)
    samples = _samples([11, 7, 13])
    (mb,) = pack(samples, micro_batch_tokens=64, num_ranks=1)[0]
    with torch.no_grad():
        packed, _ = policy.logprobs(mb.input_ids, mb.position_ids, mb.targets, 1.0)
        starts = (mb.position_ids[0] == 0).nonzero().flatten().tolist()
        for s, e in zip(starts, starts[1:] + [mb.num_tokens]):
            ids = mb.input_ids[:, s:e]
            alone, _ = policy.logprobs(ids, torch.arange(e - s)[None], mb.targets[s:e], 1.0)
            torch.testing.assert_close(packed[s : e - 1], alone[:-1], atol=1e-5, rtol=1e-5)
