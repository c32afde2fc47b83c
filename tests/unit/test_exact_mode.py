"""Exact mode (``--model.exact``): the native engine's sampled-token logprobs equal the trainer's logprobs bit for bit
(``torch.equal``), in fp32 and bf16, whatever the batch on either side: one request or many, prompts and generations
of different lengths (prefilled or decoded, other length buckets), and on the trainer side samples packed into one row
(``PolicyModel``: documents unpacked into rows) or one sample a row. A control runs the default engine against the same
trainer and shows the comparison can fail.

Device-aware (``device`` fixture): CUDA compiles the kernels and the engine replays them in CUDA graphs; CPU runs them
under TRITON_INTERPRET=1 (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.models import registry
from prime_spmd.models.tiny import build_char_tokenizer, build_tiny_model
from prime_spmd.trainer.policy import PolicyModel

PROMPTS = ["hello world", "abc", "the quick brown fox jumps", "x", "reverse me"]
MAX_TOKENS = [2, 9, 4, 12, 1]  # generations of different lengths: rows finish at different steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # initializer_range 0.3: a peaky random model (std 0.02 repeats one token)
    return build_tiny_model(tmp_path_factory.mktemp("nano"), "qwen3-nano", seed=0, initializer_range=0.3)


def _model(path, dtype, device):
    return registry.load_custom(str(path), device=device, dtype=dtype).eval()


def _engine(path, dtype, device, exact=True):
    """On CUDA with its defaults: CUDA graphs, the decode and prefill graphs replaying the exact kernels."""
    return NativeEngine(
        _model(path, dtype, device), build_char_tokenizer(), device=device, max_batch_size=8, max_model_len=64,
        exact=exact,
    )  # fmt: skip


def _requests(prompts, max_tokens, seeds, temperature=1.0):
    tok = build_char_tokenizer()
    return [
        Request(
            prompt_ids=tok.encode(p),
            sampling=SamplingParams(temperature=temperature, max_tokens=m, seed=s, ignore_eos=True),
            request_id=s,
        )
        for p, m, s in zip(prompts, max_tokens, seeds)
    ]


def trainer_logprobs(policy: PolicyModel, completions, temperature: float, packed: bool) -> list[torch.Tensor]:
    """Each completion token's logprob as the trainer computes it: all samples packed into one row (positions restart
    at each sample), or one forward per sample."""
    groups = [completions] if packed else [[c] for c in completions]
    out = []
    for group in groups:
        seqs = [c.prompt_ids + c.token_ids for c in group]
        dev = policy.adapter.lm_head_weight().device
        ids = torch.tensor([sum(seqs, [])], device=dev)
        pos = torch.cat([torch.arange(len(s), device=dev) for s in seqs])[None]
        targets = torch.cat([ids[0, 1:], ids.new_zeros(1)])
        with torch.no_grad():
            lp, _ = policy.logprobs(ids, pos, targets, temperature)
        o = 0
        for c, s in zip(group, seqs):
            n = len(c.prompt_ids)
            out.append(lp[o + n - 1 : o + n - 1 + len(c.token_ids)].cpu())
            o += len(s)
    return out


def _equal(completions, trainer) -> list[bool]:
    return [torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), t) for c, t in zip(completions, trainer)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_logprobs_equal_trainer(model_dir, dtype, device):
    eng = _engine(model_dir, dtype, device)
    seeds = list(range(len(PROMPTS)))
    batch = eng.generate(_requests(PROMPTS, MAX_TOKENS, seeds, temperature=0.7))
    assert [len(c.token_ids) for c in batch] == MAX_TOKENS
    # two of them again, one at a time: another batch composition and length bucket; seeded, so the same tokens
    alone = [eng.generate(_requests([PROMPTS[i]], [MAX_TOKENS[i]], [i], temperature=0.7))[0] for i in (1, 4)]
    for a in alone:
        b = batch[a.request_id]
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    policy = PolicyModel(_model(model_dir, dtype, device), exact=True)
    for packed in (True, False):
        assert all(_equal(batch, trainer_logprobs(policy, batch, 0.7, packed))), packed


def test_default_mode_differs(model_dir, device):
    """The control: the default engine (fused decode, SDPA prefill, torch sampler) against the exact trainer. Equal
    logprobs here would mean the test above cannot tell the modes apart."""
    eng = _engine(model_dir, torch.float32, device, exact=False)
    batch = eng.generate(_requests(PROMPTS[:3], [6, 6, 6], [0, 1, 2]))
    policy = PolicyModel(_model(model_dir, torch.float32, device), exact=True)
    assert not all(_equal(batch, trainer_logprobs(policy, batch, 1.0, packed=True)))


def test_exact_engine_refuses_filtered_sampling(model_dir, device):
    eng = _engine(model_dir, torch.float32, device)
    req = _requests(["abc"], [2], [0])[0]
    req.sampling.top_p = 0.9
    with pytest.raises(ValueError, match="--model.exact samples without top-k/top-p/min-p"):
        eng.add_request(req)


def test_exact_refuses_moe_and_hf_models(model_dir):
    from prime_spmd.models.qwen3.model import Qwen3Args, Qwen3ForCausalLM
    from prime_spmd.trainer.exact import check_trainer_model

    moe = Qwen3ForCausalLM(
        Qwen3Args(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        )
    )  # fmt: skip
    with pytest.raises(ValueError, match="--model.exact covers dense SwiGLU MLPs"):
        PolicyModel(moe, exact=True)
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="--model.exact trains our Qwen3 code: set --model.impl custom"):
        check_trainer_model(AutoModelForCausalLM.from_pretrained(model_dir))
