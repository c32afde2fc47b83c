"""Models built on the meta device skip torch.nn.init (models/common/meta.py ``on_meta``): the meta draws and the
RoPE table's arange there ran through torch._refs, whose first call imports torch._dynamo (0.7-0.9 s of every CPU
eval's start-up, 2026-12-07)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from torch import nn

from prime_spmd.models.common.meta import on_meta
from prime_spmd.models.tiny import build_tiny_model


def test_loading_and_planning_a_model_import_no_dynamo(tmp_path) -> None:
    """Our Qwen3 loaded from disk, drawn at load (--model.random_init) and counted by the memory plan, in a fresh
    process: torch._dynamo stays unimported (building on plain ``torch.device("meta")`` imports it)."""
    path = build_tiny_model(tmp_path / "nano", "qwen3-nano", seed=0)
    code = f"""
        import sys
        import torch
        from prime_spmd.memory import model_shape
        from prime_spmd.models.qwen3.hf import load_qwen3
        model = load_qwen3({str(path)!r})
        assert torch.isfinite(model.model.rotary_emb.inv_freq).all()
        drawn = load_qwen3({str(path)!r}, device="cpu", random_init_seed=0)
        assert not any(t.is_meta for t in [*drawn.parameters(), *drawn.buffers()])
        assert model_shape({str(path)!r}).num_params == sum(p.numel() for p in model.parameters())
        print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "no dynamo", out.stdout + out.stderr


def test_on_meta_skips_init_only_inside() -> None:
    """Inside: meta tensors and nn.init's initializers untouched; after: the functions restored, init runs."""
    before = nn.init.normal_
    with on_meta():
        assert nn.init.normal_ is not before
        layer = nn.Linear(4, 3)
    assert layer.weight.is_meta and nn.init.normal_ is before
    torch.manual_seed(0)
    real = nn.Linear(4, 3)
    assert real.weight.abs().sum() > 0


def test_rope_table_built_on_meta_is_filled_by_reset() -> None:
    """A RotaryEmbedding built on meta holds a placeholder; reset_parameters gives the table a CPU build has."""
    from prime_spmd.models.common.rope import RotaryEmbedding

    with on_meta():
        rope = RotaryEmbedding(16, 10000.0)
    assert rope.inv_freq.is_meta and rope.inv_freq.shape == (8,)
    rope.inv_freq = torch.empty(8)
    rope.reset_parameters()
    assert torch.equal(rope.inv_freq, RotaryEmbedding(16, 10000.0).inv_freq)
