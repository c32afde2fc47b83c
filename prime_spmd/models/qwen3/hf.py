"""Hugging Face checkpoint <-> our state dict, the one place that maps names.

Only MoE experts differ: HF safetensors hold ``mlp.experts.{e}.{gate,up,down}_proj.weight`` per
expert; we hold ``mlp.experts.gate_up_proj`` [E, 2I, D] (gate rows, then up rows) and
``mlp.experts.down_proj`` [E, D, I]. Tied embeddings: no ``lm_head.weight`` on either side.
Stacking and splitting copy bytes unchanged, so HF -> ours -> HF is bitwise.

``--model.random_init`` (``load_qwen3(random_init_seed=...)``, ``materialize_random``): no weights are read; each
parameter is drawn at load, built on meta and then filled on its device chunk by chunk, so no whole copy of the
model is ever on the host. A chunk's values depend only on (seed, parameter name, chunk index): the same on CPU and
CUDA, in every process, and equal to a ``save_hf`` of the drawn model loaded back.
"""

from __future__ import annotations

import json
import os
import zlib
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from prime_spmd.models.adapter import HF_EXPERT_NAME
from prime_spmd.models.common.meta import on_meta
from prime_spmd.models.common.norm import RMSNorm
from prime_spmd.models.common.rope import RotaryEmbedding
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
    with on_meta():
        model = Qwen3ForCausalLM(args)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary_emb.reset_parameters()
    return model


def load_qwen3(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    random_init_seed: int | None = None,
):
    """Load an HF ``qwen3``/``qwen3_moe`` directory into our model (registry loader). MoE kernel:
    ``triton`` on CUDA, ``reference`` elsewhere (``set_moe_impl`` changes it).

    ``random_init_seed`` (``--model.random_init``): read config.json only and draw the weights on ``device``
    (``materialize_random``); ``device`` "meta" leaves every parameter unmaterialized (the colocated engine shares
    the trainer's tensors first, then draws the rest)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    args = Qwen3Args.from_hf_config(cfg)
    if random_init_seed is None:
        model = build_model(args, device, dtype)
        state = from_hf(read_safetensors(path), args.num_experts)
        if args.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model.load_state_dict(state, strict=True)
    else:
        with on_meta():
            model = Qwen3ForCausalLM(args).to(dtype)
        if torch.device(device).type != "meta":
            materialize_random(model, device, random_init_seed, random_init_std(cfg))
    set_moe_impl(model, "triton" if torch.device(device).type == "cuda" else "reference")
    model.hf_config = cfg
    return model


RANDOM_INIT_CHUNK = 1 << 22
"""Elements a random-init draw takes at once (16 MiB of fp32): each chunk has its own generator, so this constant is
part of what the values are; changing it changes every random model."""


def random_init_std(hf_config: dict) -> float:
    """The std of the normal draws: the config's ``initializer_range`` (HF's default 0.02)."""
    return float(hf_config.get("initializer_range", 0.02))


def _draw_chunk(name: str, index: int, n: int, seed: int) -> torch.Tensor:
    """``n`` fp32 standard normals for chunk ``index`` of weight ``name``, from a host generator seeded with crc32 of
    (seed, name, index). Runs on a pool thread: the draw is one serial kernel that releases the GIL. The host generator
    (mt19937) keeps 32 bits of its seed: two of a 30B model's ~7k chunks share their values with odds of about 1 in
    160, harmless for the speed and memory runs this is for."""
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}/{name}#{index}".encode()))
    return torch.randn(n, generator=gen, dtype=torch.float32)


@torch.no_grad()
def materialize_random(model: nn.Module, device: torch.device | str, seed: int, std: float) -> int:
    """Give every parameter still on meta its random-init values on ``device``, in its dtype: RMSNorm weights 1,
    biases 0, every other weight (embeddings, linears, router, stacked experts) normal(0, ``std``), chunk by chunk:
    drawn in fp32 on the host (``_draw_chunk``), scaled and cast there, then copied (CPU and CUDA get the same bits).
    The RoPE buffer is recomputed on ``device``. Parameters already materialized (the trainer's tensors, shared) are
    left alone. Draws run on a thread pool, at most two chunks a thread ahead of this thread, which scales, casts and
    copies them in order (its elementwise ops use torch's intra-op threads; the pool threads run only the serial
    draw, so the two do not nest). Host memory: about two chunks (16 MiB each) a pool thread. Returns the bytes
    materialized. Single process, no collective."""
    device = torch.device(device)
    jobs, done, nbytes = [], {}, 0
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            if not p.is_meta:
                continue
            if id(p) in done:  # one parameter held by two modules (tied): one tensor
                setattr(mod, pname, done[id(p)])
                continue
            t = torch.empty(p.shape, dtype=p.dtype, device=device)
            if isinstance(mod, RMSNorm):
                t.fill_(1.0)
            elif pname == "bias":
                t.zero_()
            else:
                name = f"{mod_name}.{pname}" if mod_name else pname
                jobs += [(t.view(-1), name, i) for i in range(-(-t.numel() // RANDOM_INIT_CHUNK))]
            done[id(p)] = new = nn.Parameter(t, requires_grad=p.requires_grad)
            setattr(mod, pname, new)
            nbytes += t.numel() * t.element_size()

    def write(flat: torch.Tensor, index: int, future) -> None:
        start = index * RANDOM_INIT_CHUNK
        values = future.result().mul_(std).to(flat.dtype)
        flat[start : start + values.numel()].copy_(values)

    num_workers = min(32, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=num_workers) as pool:
        pending: deque = deque()
        for flat, name, i in jobs:
            n = min(RANDOM_INIT_CHUNK, flat.numel() - i * RANDOM_INIT_CHUNK)
            pending.append((flat, i, pool.submit(_draw_chunk, name, i, n, seed)))
            if len(pending) >= 2 * num_workers:
                write(*pending.popleft())
        while pending:
            write(*pending.popleft())
    for mod in model.modules():
        if isinstance(mod, RotaryEmbedding) and mod.inv_freq.is_meta:
            mod.inv_freq = mod._inv_freq().to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"still on meta after random init: {left[:5]}"
    return nbytes


def save_hf(model: Qwen3ForCausalLM, path: str | Path, hf_config: dict | None = None) -> None:
    """Write ``model.safetensors`` with HF names (and ``config.json`` when given); CPU copies, dtype kept."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").clone().contiguous() for name, t in to_hf(model.state_dict().items())}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config if hf_config is not None else getattr(model, "hf_config", None)
    if cfg is not None:
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
