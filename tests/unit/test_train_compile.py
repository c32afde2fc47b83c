"""--trainer.compile: compiled block forwards give the eager model's outputs and gradients, reuse one graph
across blocks and micro-batch lengths, and keep the parameter names (checkpoints, weight sync)."""

from __future__ import annotations

import copy

import pytest
import torch

from prime_spmd.distributed.fsdp import compile_block_forwards
from prime_spmd.models.qwen3.model import Qwen3Args, Qwen3ForCausalLM
from prime_spmd.trainer.build import compile_training


def _model() -> Qwen3ForCausalLM:
    args = Qwen3Args(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(args)
    model.init_weights(std=0.2, seed=0)
    return model


def _batches():
    g = torch.Generator().manual_seed(1)
    for lengths in ([9, 14], [5, 7, 12], [6, 20], [20]):  # packed rows of 4 lengths (the last one document: no mask)
        ids = torch.randint(0, 96, (1, sum(lengths)), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        yield ids, pos, None
    T = 12  # an explicit mask (prompt sharing's path): two rows, each key set a causal prefix
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None].expand(2, T, T).clone()
    yield torch.randint(0, 96, (2, T), generator=g), torch.arange(T).expand(2, T), mask


def test_compiled_blocks_match_eager_and_reuse_one_graph(device: torch.device) -> None:
    """CPU: the aot_eager backend (dynamo + autograd tracing, no codegen: seconds); CUDA (scripts/test_gpu.sh):
    inductor, as --trainer.compile runs it there."""
    torch._dynamo.reset()
    eager = _model().to(device)
    compiled = copy.deepcopy(eager)
    names = [n for n, _ in compiled.named_parameters()]
    compile_block_forwards(compiled.blocks(), backend="inductor" if device.type == "cuda" else "aot_eager")
    assert [n for n, _ in compiled.named_parameters()] == names  # no _orig_mod: checkpoints and sync unchanged
    torch._dynamo.utils.counters.clear()
    for ids, pos, mask in _batches():
        ids, pos, mask = ids.to(device), pos.to(device), None if mask is None else mask.to(device)
        outs = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            hidden = model.forward_hidden(ids, pos, mask)
            (hidden.float().square().mean()).backward()
            outs.append((hidden.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-5)
        assert len(outs[1][1]) == len(outs[0][1]) == len(names) - 1  # all but the LM head (not in forward_hidden)
        for g_c, g_e in zip(outs[1][1], outs[0][1]):
            torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-6)
    # 3 blocks x 5 micro-batches: one graph per kind of input (block mask, plain causal, 2 masked rows: a size
    # of 1 is always specialized), not per block or length; static shapes would take 5, one per block 3x more
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 3, dict(torch._dynamo.utils.counters["stats"])


@pytest.mark.parametrize(
    ("flag", "device", "by_default", "expect"),
    [("auto", "cuda", True, True), ("auto", "cpu", True, False), ("auto", "cuda", False, False),
     ("on", "cpu", False, True), ("off", "cuda", True, False)],
)  # fmt: skip
def test_compile_flag_resolution(flag: str, device: str, by_default: bool, expect: bool) -> None:
    assert compile_training(flag, torch.device(device), by_default) is expect


def test_compiled_blocks_under_activation_checkpointing_match_eager() -> None:
    """--trainer.compile with --trainer.activation_checkpointing: the block is compiled first, then wrapped, so the
    backward recomputes the compiled forward; gradients equal the eager model's."""
    from prime_spmd.distributed.fsdp import apply_activation_checkpointing

    torch._dynamo.reset()
    eager = _model()
    compiled = copy.deepcopy(eager)
    compile_block_forwards(compiled.blocks(), backend="aot_eager")
    apply_activation_checkpointing(compiled.blocks(), [compiled.model.layers])
    ids, pos, _ = next(_batches())
    grads = []
    for model in (eager, compiled):
        model.forward_hidden(ids, pos).float().square().mean().backward()
        grads.append([p.grad for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for g_c, g_e in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-6)


def test_auto_compiles_our_dense_code_only() -> None:
    """compile auto's rule lives in the adapter: our dense Qwen3 yes; our MoE and transformers models no."""
    import dataclasses

    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM as HFQwen3

    from prime_spmd.models.registry import adapter_for

    assert adapter_for(_model()).compiles_by_default()
    moe = dataclasses.replace(_model().args, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    assert not adapter_for(Qwen3ForCausalLM(moe)).compiles_by_default()
    hf = HFQwen3(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8))  # fmt: skip
    assert not adapter_for(hf).compiles_by_default()
