"""The native engine decodes our Qwen3-MoE model through CUDA graphs (the triton experts kernel has no host sync):
greedy and seeded sampled tokens equal the eager engine's, the sampled tokens' logprobs within 2e-2 of them. CPU side:
tests/unit/test_moe_graph_safe.py."""

from __future__ import annotations

import pytest
import torch

from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.models.qwen3.hf import load_qwen3

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _moe_dir(path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, tie_word_embeddings=False, rope_theta=10000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # spread the routing over the experts
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def _requests(sampling):
    g = torch.Generator().manual_seed(1)
    lens = (5, 17, 9, 30, 12, 3)
    return [
        Request(prompt_ids=torch.randint(0, 512, (n,), generator=g).tolist(), sampling=sampling, request_id=str(i))
        for i, n in enumerate(lens)
    ]


def test_moe_decode_graphs_match_eager(tmp_path):
    path = _moe_dir(tmp_path / "moe")
    engines = {}
    for graphs in (True, False):
        model = load_qwen3(path, device="cuda", dtype=torch.bfloat16)
        engines[graphs] = NativeEngine(model, None, max_batch_size=8, max_model_len=96, cuda_graphs=graphs)
    assert engines[True].use_graphs and not engines[False].use_graphs
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    got, want = (engines[g].generate(_requests(greedy)) for g in (True, False))
    same = sum(a.token_ids == b.token_ids for a, b in zip(got, want))
    assert same == len(want), f"{same}/{len(want)} greedy completions equal between graphs and eager"
    assert engines[True]._graphs  # decode replayed captured graphs
    stats = engines[True].graph_stats()
    assert stats["engine_graphs_captured"] >= len(engines[True]._graphs) and stats["engine_capture_s"] > 0
    assert engines[False].graph_stats()["engine_graphs_captured"] == 0
    sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    got, want = (engines[g].generate(_requests(sampled)) for g in (True, False))
    for a, b in zip(got, want):
        n = min(len(a.token_ids), len(b.token_ids))
        assert a.token_ids[:n] == b.token_ids[:n], a.request_id
        assert max(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])) < 2e-2, a.request_id
