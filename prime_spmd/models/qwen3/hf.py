"""Hugging Face checkpoint <-> our state dict, the one place that maps names.

Only MoE experts differ: HF safetensors hold ``mlp.experts.{e}.{gate,up,down}_proj.weight`` per
expert; we hold ``mlp.experts.gate_up_proj`` [E, 2I, D] (gate rows, then up rows) and
``mlp.experts.down_proj`` [E, D, I]. Tied embeddings: no ``lm_head.weight`` on either side.
Stacking and splitting copy bytes unchanged, so HF -> ours -> HF is bitwise.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from prime_spmd.models.adapter import HF_EXPERT_NAME
from prime_spmd.models.qwen3.model import Qwen3Args, Qwen3ForCausalLM, set_moe_impl


def from_hf(hf_items: Iterable[tuple[str, torch.Tensor]], num_experts: int) -> dict[str, torch.Tensor]:
    """HF-named tensors -> our state dict (stacks per-expert weights; raises if an expert is missing)."""
    ours: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in hf_items:
        m = HF_EXPERT_NAME.match(name)
        if m is None:
            ours[name] = t
            continue
        experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
    for prefix, parts in experts.items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            got = sorted(parts.get(proj, {}))
            if got != list(range(num_experts)):
                raise ValueError(f"{prefix}: {proj} experts {got} in the checkpoint, expected 0..{num_experts - 1}")
        gate, up = (torch.stack([parts[p][e] for e in range(num_experts)]) for p in ("gate_proj", "up_proj"))
        ours[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        ours[f"{prefix}.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(num_experts)])
    return ours


def to_hf(state: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Our (name, tensor) pairs -> HF names, experts split per expert (views; clone before saving)."""
    for name, t in state:
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, inter = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", t[e, :inter]
                yield f"{prefix}.{e}.up_proj.weight", t[e, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", t[e]
        else:
            yield name, t


def read_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """All tensors of the ``*.safetensors`` files in a directory (sharded or not), on CPU."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def build_model(args: Qwen3Args, device: torch.device | str, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """An uninitialized model on ``device`` (built on meta, then materialized; call load or init_weights)."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(args)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary_emb.reset_parameters()
    return model


def load_qwen3(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Load an HF ``qwen3``/``qwen3_moe`` directory into our model (registry loader). MoE kernel:
    ``triton`` on CUDA, ``reference`` elsewhere (``set_moe_impl`` changes it)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    args = Qwen3Args.from_hf_config(cfg)
    model = build_model(args, device, dtype)
    state = from_hf(read_safetensors(path), args.num_experts)
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=True)
    set_moe_impl(model, "triton" if torch.device(device).type == "cuda" else "reference")
    model.hf_config = cfg
    return model


def save_hf(model: Qwen3ForCausalLM, path: str | Path, hf_config: dict | None = None) -> None:
    """Write ``model.safetensors`` with HF names (and ``config.json`` when given); CPU copies, dtype kept."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").clone().contiguous() for name, t in to_hf(model.state_dict().items())}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config if hf_config is not None else getattr(model, "hf_config", None)
    if cfg is not None:
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
