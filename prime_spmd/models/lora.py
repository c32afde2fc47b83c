"""LoRA: low-rank adapters on the linear layers of a causal LM (docs/lora.md).

``apply_lora(lm, cfg)`` swaps every targeted ``nn.Linear`` for a ``LoraLinear`` in place and freezes
everything else. A ``LoraLinear`` IS an ``nn.Linear`` (same ``weight``/``bias`` parameters, so the
base names, the HF export and the weight spec of the frozen model do not change) plus two trainable
submodules ``lora_A`` [R, Din] and ``lora_B`` [Dout, R]:

    y = x W^T + b + (alpha / r) * B(A(dropout(x)))

``A`` is initialized like ``nn.Linear`` (Kaiming-uniform, from a generator seeded by the run seed,
so every rank builds the same adapter), ``B`` with zeros: the adapted model starts as the base.
Parameter names are ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``; PEFT's saved files use
``base_model.model.<module>.lora_A.weight``, which ``to_peft``/``from_peft`` translate.

Supported targets: any ``nn.Linear`` whose module name ends with a target (``q_proj`` matches
``model.layers.3.self_attn.q_proj``). Our stacked MoE experts (``GroupedExperts``, 3-D parameters)
are not linear modules and are never adapted; transformers models whose experts are ``nn.Linear``
modules are adapted like any other linear layer.

Legend (docs/conventions.md; local letters of this file: Din in features, Dout out features, R rank): T tokens
(any leading dims).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from prime_spmd.distributed.fsdp import unwrapped_name
from prime_spmd.log import logger

if TYPE_CHECKING:  # annotations only: the engine imports this module where the CLI stack (tyro) is not installed
    from prime_spmd.config.sections import LoraConfig

PEFT_PREFIX = "base_model.model."
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class LoraLinear(nn.Linear):
    """``nn.Linear`` with a frozen base and a trainable rank-``r`` update (module docstring).

    Built from an existing linear layer by ``LoraLinear.wrap``, which reuses its parameters.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, generator: torch.Generator) -> None:
        nn.Module.__init__(self)  # the base layer's parameters are adopted, not re-created
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        # fp32 adapters whatever the base's dtype: the base may be held in bf16 (it never trains), the adapters are
        # the optimizer's master weights; FSDP2 casts both to the compute dtype for the forward
        w = base.weight
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=w.device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=w.device, dtype=torch.float32)
        with torch.no_grad():
            # nn.Linear's default init (kaiming_uniform, a=sqrt(5)) is U(-1/sqrt(in), 1/sqrt(in))
            bound = 1.0 / math.sqrt(self.in_features)
            a = torch.empty(self.lora_A.weight.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x_TDin: torch.Tensor) -> torch.Tensor:
        y_TDout = F.linear(x_TDin, self.weight, self.bias)
        return y_TDout + self.scale * self.lora_B(self.lora_A(self.lora_dropout(x_TDin)))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def _matches(name: str, targets: Iterable[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def apply_lora(lm: nn.Module, cfg: LoraConfig, seed: int = 0, base_model: str = "") -> list[str]:
    """Replace the targeted ``nn.Linear`` modules of ``lm`` by ``LoraLinear`` in place, freeze every
    other parameter (``requires_grad=False``) and return the adapted module names, in module order.
    Records ``lm.lora_config`` and ``lm.lora_base_model`` (``base_model``: the base's path, written
    into ``adapter_config.json``).

    Every trainer rank calls it with the same ``seed`` before FSDP2 (identical adapters everywhere).
    Raises ``ValueError`` when no target matches a linear layer (naming what the model has); targets
    that match nothing while others do are logged as a warning.
    """
    assert cfg.rank > 0, "apply_lora with --model.lora.rank 0"
    gen = torch.Generator().manual_seed(seed)
    linear = {n: m for n, m in lm.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, LoraLinear)}
    unmatched = [t for t in cfg.target_modules if not any(_matches(n, [t]) for n in linear)]
    leaf = sorted({n.rsplit(".", 1)[-1] for n in linear})
    where = f"of {type(lm).__name__} (its linear layers end with: {leaf}; stacked MoE experts cannot be adapted)"
    if len(unmatched) == len(cfg.target_modules):
        raise ValueError(f"--model.lora.target_modules: {unmatched} match no nn.Linear module {where}")
    if unmatched:  # e.g. the default MLP targets on a model whose every MLP is MoE
        logger.warning(f"--model.lora.target_modules: {unmatched} match no nn.Linear module {where}; not adapted")
    for p in lm.parameters():
        p.requires_grad_(False)
    names = [n for n in linear if _matches(n, cfg.target_modules)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = lm.get_submodule(parent_name) if parent_name else lm
        setattr(parent, attr, LoraLinear(linear[name], cfg.rank, cfg.alpha, cfg.dropout, gen))
    lm.lora_config, lm.lora_base_model = cfg, base_model
    return names


def lora_modules(lm: nn.Module) -> dict[str, LoraLinear]:
    """The ``LoraLinear`` modules of ``lm`` by module name (activation-checkpoint segments removed)."""
    return {unwrapped_name(n): m for n, m in lm.named_modules() if isinstance(m, LoraLinear)}


def lora_scale(lm: nn.Module) -> float:
    """alpha / rank of the adapters of ``lm`` (0.0 without LoRA)."""
    scales = {m.scale for m in lora_modules(lm).values()}
    assert len(scales) <= 1, scales
    return scales.pop() if scales else 0.0


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def base_name(adapter_name: str) -> str:
    """``x.q_proj.lora_A.weight`` -> ``x.q_proj.weight`` (the base weight the adapter updates)."""
    for suffix in ADAPTER_SUFFIXES:
        if adapter_name.endswith(suffix):
            return adapter_name[: -len(suffix)] + ".weight"
    raise AssertionError(adapter_name)


def merged_weight(w0_DoutDin: torch.Tensor, a_RDin: torch.Tensor, b_DoutR: torch.Tensor, scale: float) -> torch.Tensor:
    """W0 + scale * B @ A ([Dout, Din]), computed in fp32, returned in W0's dtype."""
    return torch.addmm(w0_DoutDin.float(), b_DoutR.float(), a_RDin.float(), alpha=scale).to(w0_DoutDin.dtype)


def merge_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A state dict with adapters -> the plain model's (each targeted weight merged, adapters dropped)."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for k in state:
        if k.endswith(".lora_A.weight"):
            prefix = k[: -len(".lora_A.weight")]
            w = prefix + ".weight"
            out[w] = merged_weight(state[w], state[k], state[prefix + ".lora_B.weight"], scale)
    return out


def to_peft(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors of a state dict under PEFT's saved names (``base_model.model.`` prefix)."""
    return {PEFT_PREFIX + k: v for k, v in state.items() if is_adapter(k)}


def from_peft(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's saved names -> ours (inverse of ``to_peft``)."""
    return {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}


def peft_config(cfg: LoraConfig, base_model: str) -> dict:
    """``adapter_config.json`` content for PEFT's ``LoraConfig`` (fields PEFT reads; plain LoRA)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_adapter(state: dict[str, torch.Tensor], cfg: LoraConfig, base_model: str, out_dir: str | Path) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT layout) from a full state dict
    with the LM's own names; only the adapters are written. Call on one rank only."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in to_peft(state).items()}
    assert tensors, "save_adapter: the state dict holds no adapters"
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(peft_config(cfg, base_model), indent=2))
    return out


def load_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json as a dict, adapter tensors under our names) of a PEFT adapter directory."""
    p = Path(path)
    config = json.loads((p / "adapter_config.json").read_text())
    return config, from_peft(load_file(str(p / "adapter_model.safetensors")))


class LoraMerger:
    """Inference side of an adapter-only weight sync: turns adapter tensors into merged base weights.

    Holds a copy of the frozen base weight W0 of every adapted module (read from the engine's model
    when built, i.e. the weights it loaded from disk) and, for each (lora_A, lora_B) pair received,
    yields ``(base name, W0 + scale * B @ A)`` in W0's dtype. Adapters that arrive in different
    buckets are cloned and held until their pair is complete (they are small). Single-process.
    """

    def __init__(self, base: dict[str, torch.Tensor], adapter_names: Iterable[str], scale: float) -> None:
        self.scale = scale
        wanted = {base_name(n) for n in adapter_names}
        missing = sorted(wanted - set(base))
        if missing:
            raise ValueError(f"LoRA weight sync: the engine's model has no base weights {missing[:3]}")
        self.w0 = {n: base[n].detach().clone() for n in sorted(wanted)}
        self._pending: dict[str, torch.Tensor] = {}

    def merge(self, adapters: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in adapters:
            assert is_adapter(name), name
            prefix = name.rsplit(".", 2)[0]
            other = prefix + (".lora_B.weight" if name.endswith(".lora_A.weight") else ".lora_A.weight")
            if other not in self._pending:
                self._pending[name] = t.detach().clone()
                continue
            mate = self._pending.pop(other)
            a, b = (t, mate) if name.endswith(".lora_A.weight") else (mate, t)
            w = prefix + ".weight"
            yield w, merged_weight(self.w0[w], a, b, self.scale)

    def check_done(self) -> None:
        assert not self._pending, f"LoRA weight sync: adapters without their pair: {sorted(self._pending)[:3]}"
