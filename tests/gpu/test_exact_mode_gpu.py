"""Exact mode (``--model.exact``) on CUDA at Qwen3-0.6B's layer shape (4 of its 28 layers, its 151936 vocab), bf16:
the native engine (CUDA graphs, default settings) samples ~5k tokens for 48 requests of different prompt and
generation lengths; the trainer's ``PolicyModel`` recomputes every sampled token's logprob from packed rows; mismatch
KL exactly 0.0 and max |diff| 0. The tiny-model CPU/CUDA tests: tests/unit/test_exact_mode.py, test_exact_rl.py.
"""

from __future__ import annotations

import pytest
import torch

from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.models import registry
from prime_spmd.models.tiny import build_char_tokenizer, build_tiny_model
from prime_spmd.trainer.policy import PolicyModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

SHAPE = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936,
)  # fmt: skip
ROW_TOKENS = 4096  # the trainer's packed rows (micro-batches) hold up to this many tokens


def _requests(n: int, vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(8, 200, (n,), generator=g).tolist()
    gens = torch.randint(16, 180, (n,), generator=g).tolist()
    return [
        Request(
            prompt_ids=torch.randint(5, vocab, (p,), generator=g).tolist(),
            sampling=SamplingParams(temperature=1.0, max_tokens=m, seed=i, ignore_eos=True),
            request_id=i,
        )
        for i, (p, m) in enumerate(zip(lens, gens))
    ]


def _trainer_logprobs(policy: PolicyModel, completions) -> list[torch.Tensor]:
    """Completions packed first-fit into rows of <= ROW_TOKENS tokens; each completion token's logprob."""
    rows: list[list] = [[]]
    for c in completions:
        if (
            sum(len(x.prompt_ids) + len(x.token_ids) for x in rows[-1]) + len(c.prompt_ids) + len(c.token_ids)
            > ROW_TOKENS
        ):
            rows.append([])
        rows[-1].append(c)
    out = {}
    for row in rows:
        seqs = [c.prompt_ids + c.token_ids for c in row]
        ids = torch.tensor([sum(seqs, [])], device="cuda")
        pos = torch.cat([torch.arange(len(s), device="cuda") for s in seqs])[None]
        targets = torch.cat([ids[0, 1:], ids.new_zeros(1)])
        with torch.no_grad():
            lp, _ = policy.logprobs(ids, pos, targets, 1.0)
        o = 0
        for c, s in zip(row, seqs):
            n = len(c.prompt_ids)
            out[c.request_id] = lp[o + n - 1 : o + n - 1 + len(c.token_ids)].double().cpu()
            o += len(s)
    return [out[c.request_id] for c in completions]


def test_exact_engine_equals_trainer_at_06b_layer_shape(tmp_path, record_property):
    path = build_tiny_model(tmp_path / "m", "qwen3-1m", seed=0, **SHAPE)
    model = registry.load_custom(str(path), device=torch.device("cuda"), dtype=torch.bfloat16)
    engine = NativeEngine(
        model, build_char_tokenizer(), device="cuda", max_batch_size=32, max_model_len=400, exact=True
    )
    assert engine.use_graphs  # the decode steps replay CUDA graphs of the exact kernels
    reqs = _requests(48, SHAPE["vocab_size"])  # 48 > 32 slots: rows join and leave the batch while others decode
    batch = engine.generate(reqs)
    by_id = {c.request_id: c for c in batch}
    again = engine.generate([reqs[i] for i in (0, 3)])  # another batch composition and length bucket
    for a in again:
        assert a.token_ids == by_id[a.request_id].token_ids and a.logprobs == by_id[a.request_id].logprobs
    policy = PolicyModel(registry.load_custom(str(path), device=torch.device("cuda"), dtype=torch.bfloat16), exact=True)
    trainer = _trainer_logprobs(policy, batch)
    d = torch.cat([t - torch.tensor(c.logprobs, dtype=torch.float64) for c, t in zip(batch, trainer)])
    kl = (torch.exp(d) - d - 1).mean().item()
    record_property("tokens", d.numel())
    record_property("max_abs_diff", d.abs().max().item())
    record_property("mismatch_kl", kl)
    assert d.numel() > 4000
    assert d.abs().max().item() == 0.0 and kl == 0.0, (d.abs().max().item(), kl, (d != 0).sum().item())
