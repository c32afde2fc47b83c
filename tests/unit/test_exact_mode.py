"""Exact mode (``--model.exact``): the native engine's sampled-token logprobs equal the trainer's forward logprobs bit
for bit (``torch.equal``), in fp32 and bf16, whatever the batch: one row or many, prompts and generations of different
lengths, prefilled or decoded. A control runs the default engine and shows the comparison can fail.

CPU: the batch-invariant Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.kernels.batch_invariant import op
from prime_spmd.models import registry
from prime_spmd.models import exact as exact_model
from prime_spmd.models.tiny import build_char_tokenizer, build_tiny_model

PROMPTS = ["hello world", "abc", "the quick brown fox jumps over", "x", "reverse me please", "qwerty uiop asdf"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # initializer_range 0.3: a peaky random model (std 0.02 repeats one token); vocab padded past 64 so the LM head
    # spans several matmul column tiles
    return build_tiny_model(tmp_path_factory.mktemp("nano"), "qwen3-nano", seed=0, initializer_range=0.3)


def _model(path, dtype):
    return registry.load_custom(str(path), device=torch.device("cpu"), dtype=dtype).eval()


def _engine(path, dtype, exact=True, **kw):
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("max_model_len", 96)
    return NativeEngine(_model(path, dtype), build_char_tokenizer(), device="cpu", exact=exact, **kw)


def _requests(tok, prompts, max_tokens, temperature=1.0, seed0=0):
    return [
        Request(
            prompt_ids=tok.encode(p),
            sampling=SamplingParams(temperature=temperature, max_tokens=m, seed=seed0 + i, ignore_eos=True),
            request_id=i,
        )
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]


def trainer_logprobs(model, completions, temperature=1.0) -> list[torch.Tensor]:
    """The trainer side: one exact forward over all samples as rows (right-padded), then the exact LM-head logprobs of
    each completion token, as ``PolicyModel`` computes them in exact mode."""
    seqs = [c.prompt_ids + c.token_ids for c in completions]
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        hidden = exact_model.forward_hidden(model, ids)
        targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        lp, _ = op.lm_head_logprobs(hidden.reshape(-1, hidden.shape[-1]), model.lm_head_weight(), targets.flatten(), temperature)
    lp = lp.view(len(seqs), T)
    return [lp[i, len(c.prompt_ids) - 1 : len(c.prompt_ids) - 1 + len(c.token_ids)] for i, c in enumerate(completions)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_logprobs_equal_trainer(model_dir, dtype):
    tok = build_char_tokenizer()
    eng = _engine(model_dir, dtype)
    many = eng.generate(_requests(tok, PROMPTS, [3, 17, 9, 30, 1, 12]))
    assert [len(c.token_ids) for c in many] == [3, 17, 9, 30, 1, 12]
    # the same requests one at a time: other batches, other buckets; the same tokens (seeded) and logprobs
    alone = [eng.generate(_requests(tok, [p], [m], seed0=i))[0] for i, (p, m) in enumerate(zip(PROMPTS, [3, 17, 9, 30, 1, 12]))]
    model = _model(model_dir, dtype)
    for batch in (many, alone):
        got = trainer_logprobs(model, batch)
        for c, lp in zip(batch, got):
            assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), lp), (c.request_id, c.logprobs, lp)
    for a, b in zip(many, alone):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    # trainer rows of another composition: each sample alone
    for c in many[:3]:
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), trainer_logprobs(model, [c])[0])
