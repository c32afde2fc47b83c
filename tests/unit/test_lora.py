"""LoRA: config validation, the adapter module, PEFT names/layout, adapter-only weight sync with merging."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from prime_spmd.config import RLJobConfig, SFTJobConfig, load_toml
from prime_spmd.config.job import EvalJobConfig
from prime_spmd.config.sections import LoraConfig, ModelConfig
from prime_spmd.models.lora import (
    LoraLinear,
    LoraMerger,
    apply_lora,
    from_peft,
    load_adapter,
    lora_modules,
    merge_state_dict,
    save_adapter,
    to_peft,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(rank=-1), "model.lora.rank"),
        (dict(alpha=0.0), "model.lora.alpha"),
        (dict(alpha=float("nan")), "model.lora.alpha"),
        (dict(dropout=1.0), "model.lora.dropout"),
        (dict(target_modules=[]), "model.lora.target_modules"),
        (dict(target_modules=["q_proj", "q_proj"]), "model.lora.target_modules"),
        (dict(target_modules=[".q_proj"]), "model.lora.target_modules"),
    ],
)
def test_lora_config_errors_name_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=f"--{flag}="):
        LoraConfig(**kwargs)


def test_lora_flags_toml_and_job_rules(tmp_path: Path) -> None:
    from prime_spmd.config.loader import parse_cli

    argv = ["--model.path", "m", "--model.lora.rank", "8", "--model.lora.alpha", "16"]
    cfg = parse_cli(SFTJobConfig, [*argv, "--model.lora.target_modules", "q_proj", "v_proj"], "sft")
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.target_modules) == (8, 16.0, ["q_proj", "v_proj"])
    toml = tmp_path / "sft.toml"
    toml.write_text('[model]\npath = "m"\n[model.lora]\nrank = 4\ntarget_modules = ["o_proj"]\n')
    cfg = load_toml(SFTJobConfig, toml)
    assert cfg.model.lora.rank == 4 and cfg.model.lora.target_modules == ["o_proj"] and cfg.model.lora.alpha == 16.0
    toml.write_text('[model]\npath = "m"\n[model.lora]\ntarget_modules = "o_proj"\n')
    with pytest.raises(ValueError, match="model.lora.target_modules"):
        load_toml(SFTJobConfig, toml)
    toml.write_text('[model]\npath = "m"\n[model.lora]\nranks = 4\n')
    with pytest.raises(ValueError, match="unknown key 'model.lora.ranks'"):
        load_toml(SFTJobConfig, toml)
    assert parse_cli(RLJobConfig, [*argv, "--inference.engine", "vllm"], "rl").model.lora.rank == 8
    with pytest.raises(ValueError, match="--model.lora.rank=1024: vLLM 0.32's LoRA layers hold ranks up to 512"):
        parse_cli(RLJobConfig, ["--model.path", "m", "--model.lora.rank", "1024", "--inference.engine", "vllm"], "rl")
    assert parse_cli(RLJobConfig, argv, "rl").model.lora.rank == 8
    with pytest.raises(ValueError, match="eval runs a plain model"):
        EvalJobConfig(model=ModelConfig(path="m", lora=LoraConfig(rank=2))).validate()


def _tiny_hf(tmp_path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from prime_spmd.models.tiny import build_tiny_model

    return AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", "qwen3-nano", seed=0))


def test_apply_lora_starts_at_the_base_and_trains_only_adapters(tmp_path: Path) -> None:
    lm = _tiny_hf(tmp_path)
    ids = torch.randint(5, 90, (2, 11))
    with torch.no_grad():
        ref = lm(ids).logits
    base = {k: v.clone() for k, v in lm.state_dict().items()}
    names = apply_lora(lm, LoraConfig(rank=4, alpha=8.0), seed=0)
    assert len(names) == 7 * lm.config.num_hidden_layers
    assert set(lora_modules(lm)) == set(names)
    with torch.no_grad():
        assert torch.equal(lm(ids).logits, ref)  # B = 0: exactly the base model
    trainable = {n for n, p in lm.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in trainable)
    assert len(trainable) == 2 * len(names)
    # the same seed gives the same adapters (every rank must build identical ones before FSDP2)
    lm2 = _tiny_hf(tmp_path)
    apply_lora(lm2, LoraConfig(rank=4, alpha=8.0), seed=0)
    a1 = dict(lm.named_parameters())
    for n, p in lm2.named_parameters():
        assert torch.equal(p, a1[n]), n
    # one step: gradients on adapters only, the base does not move
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=1e-2)
    lm(ids, labels=ids).loss.backward()
    for n, p in lm.named_parameters():
        assert (p.grad is not None) == (n in trainable), n
    opt.step()
    for k, v in lm.state_dict().items():
        if k in base:
            assert torch.equal(v, base[k]), k
    with torch.no_grad():
        assert not torch.equal(lm(ids).logits, ref)


def test_lora_forward_equals_merged_weight_and_dropout_only_in_train() -> None:
    torch.manual_seed(0)
    base = nn.Linear(16, 24)
    layer = LoraLinear(base, rank=4, alpha=12.0, dropout=0.5, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(5, 16)
    layer.eval()
    merged = merge_state_dict({"x." + k: v for k, v in layer.state_dict().items()}, layer.scale)
    assert set(merged) == {"x.weight", "x.bias"}
    y = nn.functional.linear(x, merged["x.weight"], merged["x.bias"])
    # measured max |diff| 1.9e-6 (fp32, merged vs factored products)
    torch.testing.assert_close(layer(x), y, atol=1e-5, rtol=1e-5)
    layer.train()
    assert not torch.allclose(layer(x), y, atol=1e-3)  # dropout on the adapter input


def test_unknown_target_and_moe_experts_are_named(tmp_path: Path) -> None:
    lm = _tiny_hf(tmp_path)
    with pytest.raises(ValueError, match=r"\['qkv', 'mlp'\] match no nn.Linear module.*q_proj"):
        apply_lora(lm, LoraConfig(rank=2, target_modules=["qkv", "mlp"]))
    from prime_spmd.models.qwen3.hf import build_model
    from prime_spmd.models.qwen3.model import Qwen3Args

    moe = dict(
        model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16,
    )  # fmt: skip
    ours = build_model(Qwen3Args.from_hf_config(moe), "cpu", torch.float32)
    ours.init_weights()
    names = apply_lora(ours, LoraConfig(rank=2))  # defaults: attention adapted, stacked experts left alone
    assert names and all(".self_attn." in n for n in names), names
    assert not any(p.requires_grad for n, p in ours.named_parameters() if ".experts." in n)
    fresh = build_model(Qwen3Args.from_hf_config(moe), "cpu", torch.float32)
    with pytest.raises(ValueError, match="stacked MoE experts cannot be adapted"):
        apply_lora(fresh, LoraConfig(rank=2, target_modules=["gate_proj", "down_proj"]))


def test_peft_names_and_layout(tmp_path: Path) -> None:
    lm = _tiny_hf(tmp_path)
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    apply_lora(lm, cfg)
    sd = lm.state_dict()
    out = save_adapter(sd, cfg, "org/base", tmp_path / "adapter")
    conf, tensors = load_adapter(out)
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    assert conf["target_modules"] == ["q_proj", "v_proj"] and conf["base_model_name_or_path"] == "org/base"
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        keys = sorted(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * 2 * lm.config.num_hidden_layers
    assert all(torch.equal(tensors[k], sd[k]) for k in tensors)
    assert from_peft(to_peft(sd)) == {k: v for k, v in sd.items() if "lora_" in k}


def test_peft_loads_our_adapter(tmp_path: Path) -> None:
    """PEFT (when installed) loads the adapter directory onto the base and gives our logits."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    lm = _tiny_hf(tmp_path)
    cfg = LoraConfig(rank=4, alpha=8.0)
    apply_lora(lm, cfg)
    with torch.no_grad():
        for m in lora_modules(lm).values():
            m.lora_B.weight.normal_(0, 0.1)
    save_adapter(lm.state_dict(), cfg, str(tmp_path / "m"), tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(5, 90, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, lm.eval()(ids).logits, atol=1e-5, rtol=1e-5)


def test_merger_pairs_adapters_across_buckets() -> None:
    w0 = torch.randn(6, 5)
    a, b = torch.randn(2, 5), torch.randn(6, 2)
    m = LoraMerger({"x.weight": w0, "y.weight": torch.ones(1)}, ["x.lora_A.weight", "x.lora_B.weight"], 0.5)
    buf = a.clone()
    assert list(m.merge([("x.lora_A.weight", buf)])) == []  # first bucket: A alone is held (a clone)
    buf.zero_()  # the sender reuses its staging buffer for the next bucket
    ((name, w),) = list(m.merge([("x.lora_B.weight", b)]))
    assert name == "x.weight" and torch.allclose(w, w0 + 0.5 * b @ a)
    m.check_done()
    with pytest.raises(ValueError, match="no base weights"):
        LoraMerger({}, ["z.lora_A.weight"], 1.0)


def test_colocated_sync_sends_only_adapters_and_the_engine_matches(tmp_path: Path) -> None:
    """Adapter-only copy into a native engine: the engine's merged weights give the trainer's logits."""
    from transformers import AutoModelForCausalLM

    from prime_spmd.inference.native import NativeEngine
    from prime_spmd.models.tiny import build_char_tokenizer, build_tiny_model
    from prime_spmd.sync.weights import WeightSender

    path = build_tiny_model(tmp_path / "m", "qwen3-nano", seed=0)
    lm = AutoModelForCausalLM.from_pretrained(path)
    apply_lora(lm, LoraConfig(rank=4, alpha=8.0))
    full = WeightSender(AutoModelForCausalLM.from_pretrained(path), torch.float32, 1 << 20, 0).spec
    sender = WeightSender(lm, torch.float32, 4096, 0)  # small buckets: A and B land in different buckets
    spec = sender.spec
    assert spec.lora_scale == 2.0 and all("lora_" in n for n in spec.names)
    assert len(spec.names) == 2 * 7 * lm.config.num_hidden_layers
    nbytes = lambda s: sum(torch.Size(x).numel() for x in s.shapes) * 4  # noqa: E731
    assert nbytes(spec) < nbytes(full) / 5, (nbytes(spec), nbytes(full))
    engine = NativeEngine(AutoModelForCausalLM.from_pretrained(path), build_char_tokenizer(), max_batch_size=2)
    with torch.no_grad():
        for m in lora_modules(lm).values():
            m.lora_B.weight.normal_(0, 0.05)
    ids = torch.randint(5, 90, (1, 13))
    for version in (1, 2):  # twice: the second merge starts again from W0, not from the merged weights
        with torch.no_grad():
            for m in lora_modules(lm).values():
                m.lora_A.weight.mul_(1.5)
        sender.copy_to(engine, version)
        assert engine.weights_version == version
        with torch.no_grad():
            # fp32, merged vs factored: measured max |diff| 2e-6 in the logits
            torch.testing.assert_close(engine.model(ids).logits, lm.eval()(ids).logits, atol=1e-4, rtol=1e-4)
    untouched = dict(engine.model.named_parameters())["model.embed_tokens.weight"]
    assert torch.equal(untouched, dict(lm.named_parameters())["model.embed_tokens.weight"])


def test_sync_bytes_qwen3_0_6b_shape_r16() -> None:
    """Bytes of one sync for the Qwen3-0.6B shape (bf16 wire), full weights vs LoRA r=16 on all 7 projections."""
    from prime_spmd.models.qwen3 import FLAVORS
    from prime_spmd.models.qwen3.model import Qwen3Args, Qwen3ForCausalLM
    from prime_spmd.sync.weights import build_spec

    with torch.device("meta"):
        lm = Qwen3ForCausalLM(Qwen3Args.from_hf_config(FLAVORS["qwen3-0.6b"]))
    full = build_spec(lm, torch.bfloat16)
    apply_lora(lm, LoraConfig(rank=16, alpha=32.0))
    lora = build_spec(lm, torch.bfloat16)
    nbytes = lambda s: 2 * sum(torch.Size(x).numel() for x in s.shapes)  # noqa: E731
    print(json.dumps({"full_bytes": nbytes(full), "lora_r16_bytes": nbytes(lora)}))
    # 2026-12-03: full 1,192,099,840 B (596M parameters, tied embeddings once), LoRA r=16 20,185,088 B (1.7%)
    assert nbytes(full) == 1_192_099_840 and nbytes(lora) == 20_185_088


def test_lora_wrapped_projections_leave_the_fused_decode_path(tmp_path: Path) -> None:
    """The engine's fused decode layer reads the plain projections' weights concatenated; a model whose
    projections are LoRA-wrapped must decode through its own modules instead (both adapters say so)."""
    from prime_spmd.models.qwen3.hf import load_qwen3
    from prime_spmd.models.registry import adapter_for

    hf = _tiny_hf(tmp_path)
    hf.save_pretrained(tmp_path / "m")
    custom = load_qwen3(tmp_path / "m")
    for lm in (hf, custom):
        assert adapter_for(lm).supports_fused_decode(), type(lm).__name__
        apply_lora(lm, LoraConfig(rank=2, alpha=4.0), seed=0)
        assert not adapter_for(lm).supports_fused_decode(), type(lm).__name__
