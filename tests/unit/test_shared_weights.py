"""share_weights: the engine's model reads the trainer's frozen tensors in place (colocated, one rank)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from prime_spmd.config.sections import LoraConfig
from prime_spmd.inference.runner import fuse_linears
from prime_spmd.inference.shared_weights import count_shared, share_weights, tie_fused
from prime_spmd.models.lora import apply_lora
from prime_spmd.models.tiny import build_tiny_model


def test_frozen_weights_are_shared_and_adapted_or_fused_ones_are_not(tmp_path) -> None:
    path = build_tiny_model(tmp_path / "m", preset="qwen3-nano")
    trainer = AutoModelForCausalLM.from_pretrained(path)
    apply_lora(trainer, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))  # freezes everything else
    engine = AutoModelForCausalLM.from_pretrained(path)
    attn = engine.model.layers[0].self_attn
    fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])  # layer 0's q/k/v now views of one fused tensor
    ids = torch.tensor([[5, 9, 17, 3]])
    before = engine(ids).logits
    report = count_shared(engine, trainer, share_weights(engine, trainer))
    t_params = dict(trainer.named_parameters())
    e_params = dict(engine.named_parameters())
    shared = {n for n, p in e_params.items() if p.data_ptr() == t_params[n].data_ptr()}
    assert "model.embed_tokens.weight" in shared and "model.layers.1.mlp.down_proj.weight" in shared
    assert "model.layers.1.self_attn.k_proj.weight" in shared  # not adapted, not fused
    assert "model.layers.1.self_attn.q_proj.weight" not in shared  # adapted: the engine holds its merged copy
    assert "model.layers.0.self_attn.k_proj.weight" not in shared  # fused with its neighbours
    assert report.shared == len(shared) and report.owned == len(e_params) - len(shared)
    assert report.shared_bytes + report.owned_bytes == sum(p.numel() * 4 for p in e_params.values())
    assert set(report.lora_base) == {f"model.layers.{i}.self_attn.{m}_proj.weight" for i in (0, 1) for m in "qv"}
    torch.testing.assert_close(engine(ids).logits, before, rtol=0, atol=0)  # same weights, same output


def test_weights_trained_in_place_are_shared_and_fused_ones_tied_back(tmp_path) -> None:
    """--trainer.offload master: the trained weights are the engine's too. After the engine fuses q/k/v, the trainer's
    parameters are re-pointed at the fused slices, so an in-place optimizer update lands where the engine reads."""
    path = build_tiny_model(tmp_path / "m", preset="qwen3-nano")
    trainer = AutoModelForCausalLM.from_pretrained(path)  # every parameter trains
    engine = AutoModelForCausalLM.from_pretrained(path)
    assert count_shared(engine, trainer, share_weights(engine, trainer)).shared == 0  # fp32 masters: a copy each
    report = share_weights(engine, trainer, trained_in_place=True)
    attn = engine.model.layers[0].self_attn
    fused, _ = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    t_attn = trainer.model.layers[0].self_attn
    assert t_attn.k_proj.weight.data_ptr() != attn.k_proj.weight.data_ptr()  # the fuse copied them
    tied = tie_fused(engine, trainer)
    assert tied == fused.numel() * fused.element_size()
    for m in ("q_proj", "k_proj", "v_proj"):
        assert getattr(t_attn, m).weight.data_ptr() == getattr(attn, m).weight.data_ptr()
        assert getattr(t_attn, m).weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    e_params, t_params = dict(engine.named_parameters()), dict(trainer.named_parameters())
    report = count_shared(engine, trainer, report)
    assert report.owned == 0 and report.shared == len(e_params)
    ids = torch.tensor([[5, 9, 17, 3]])
    with torch.no_grad():
        t_attn.k_proj.weight.add_(0.25)  # an optimizer step's in-place write
        assert torch.equal(
            fused[t_attn.q_proj.weight.shape[0] :][: t_attn.k_proj.weight.shape[0]], t_attn.k_proj.weight
        )
        torch.testing.assert_close(engine(ids).logits, trainer(ids).logits, rtol=0, atol=0)
    assert all(e_params[n].data_ptr() == t_params[n].data_ptr() for n in e_params)
