"""Our Qwen3 / Qwen3-MoE vs transformers: logits parity (fp32, packed and unpacked) and HF round trip."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from prime_spmd.config.sections import ModelConfig
from prime_spmd.models import registry
from prime_spmd.models.qwen3.hf import load_qwen3, save_hf
from prime_spmd.models.qwen3.model import set_moe_impl
from prime_spmd.models.registry import adapter_for
from prime_spmd.models.tiny import build_tiny_model

# fp32 CPU: measured max |diff| 0.0 (dense and MoE, packed and unpacked, reference and grouped_mm
# experts; Triton experts run here too under the same bound, kernel tests measure 5e-7 relative); the issue asks < 1e-4
ATOL = 1e-4


def _build_moe(path, tie: bool = False, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, tie_word_embeddings=tie, mlp_only_layers=[1], rope_theta=10000.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF inits the router to zeros-ish std; make routing non-trivial
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("dense"), preset="qwen3-nano")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return _build_moe(tmp_path_factory.mktemp("moe"))


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 14), generator=g)
    # row 0: documents of 5, 6, 3 tokens; row 1: one document
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2], list(range(14))])
    return ids, packed


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logits_parity(kind, dense_dir, moe_dir):
    path = dense_dir if kind == "dense" else moe_dir
    hf, ours = _hf(path), load_qwen3(path)
    ids, packed = _inputs(hf.config.vocab_size)
    impls = ["reference", "grouped_mm", "triton"] if kind == "moe" else ["reference"]
    with torch.no_grad():
        for pos in (None, packed):
            ref = hf(input_ids=ids, position_ids=pos, use_cache=False).logits
            for impl in impls:
                set_moe_impl(ours, impl)
                got = ours(ids, pos).logits
                assert (got - ref).abs().max() < ATOL, (kind, impl, pos is not None)
        # packing really isolates documents: document 2 of row 0 equals it run alone
        alone = ours(ids[:1, 5:11]).logits
        assert (ours(ids, packed).logits[:1, 5:11] - alone).abs().max() < ATOL
        # the two families' adapters agree
        a_hf, a_ours = adapter_for(hf), adapter_for(ours)
        assert (a_hf.family, a_ours.family) == ("hf", "qwen3")
        h_hf, h_ours = a_hf.forward_hidden(ids, packed), a_ours.forward_hidden(ids, packed)
        assert (h_hf - h_ours).abs().max() < ATOL
        assert torch.equal(a_hf.lm_head_weight(), a_ours.lm_head_weight())
        assert len(a_hf.blocks()) == len(a_ours.blocks())
        assert a_hf.dims() == a_ours.dims()
        (c_hf, s_hf), (c_ours, s_ours) = (a.rope_tables(16, ids.device, torch.float32) for a in (a_hf, a_ours))
        assert (c_hf - c_ours).abs().max() < ATOL and (s_hf - s_ours).abs().max() < ATOL
        # the native engine's slot cache: our code always; transformers' MoE is not Llama-style
        assert a_ours.supports_slot_cache() and a_hf.supports_slot_cache() == (kind == "dense")


def test_moe_backward_matches_hf(moe_dir):
    hf, ours = _hf(moe_dir), load_qwen3(moe_dir)
    hf.train(), ours.train()
    ids, packed = _inputs(hf.config.vocab_size)
    hf(input_ids=ids, position_ids=packed, use_cache=False).logits.square().mean().backward()
    ours(ids, packed).logits.square().mean().backward()
    ref = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        g_ref = ref[name].grad
        assert (p.grad - g_ref).abs().max() <= 1e-5 * (1 + g_ref.abs().max()), name
    assert ours.aux_loss() is not None and ours.aux_loss() > 0


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_hf_round_trip_bitwise(kind, dense_dir, moe_dir, tmp_path):
    path = dense_dir if kind == "dense" else moe_dir
    save_hf(load_qwen3(path), tmp_path)
    with (
        safe_open(str(path / "model.safetensors"), "pt") as a,
        safe_open(str(tmp_path / "model.safetensors"), "pt") as b,
    ):
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            ta, tb = a.get_tensor(k), b.get_tensor(k)
            assert ta.dtype == tb.dtype and torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), k
    # and transformers loads what we wrote, with the same weights
    assert torch.equal(adapter_for(_hf(tmp_path)).lm_head_weight(), adapter_for(_hf(path)).lm_head_weight())


def test_registry_auto_and_custom(dense_dir, moe_dir):
    from prime_spmd.models.loading import load_model
    from prime_spmd.models.qwen3.model import Qwen3ForCausalLM

    for path in (dense_dir, moe_dir):
        for impl in ("auto", "custom"):
            cfg = ModelConfig(path=str(path), impl=impl)
            assert registry.use_custom(cfg)
            assert isinstance(load_model(cfg, torch.device("cpu")), Qwen3ForCausalLM)
        assert not registry.use_custom(ModelConfig(path=str(path), impl="hf"))
