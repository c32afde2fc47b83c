"""Which HF config types have our own model code (``--model.impl custom|auto``), and each model's adapter.

Custom model families register a loader here, ``REGISTRY[model_type] = loader(path, device, dtype)``,
and their adapter, ``ADAPTERS[model class] = adapter class``; every other model is a transformers
model (``HFAdapter``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prime_spmd.models.adapter import ModelAdapter
from prime_spmd.models.hf_adapter import HFAdapter
from prime_spmd.models.qwen3.adapter import Qwen3Adapter
from prime_spmd.models.qwen3.hf import load_qwen3
from prime_spmd.models.qwen3.model import Qwen3ForCausalLM
from prime_spmd.models.vlm import VLMAdapter

if TYPE_CHECKING:  # annotation only: the engine imports this module, and config/ needs tyro
    from prime_spmd.config.sections import ModelConfig

REGISTRY: dict[str, Callable[..., torch.nn.Module]] = dict(qwen3=load_qwen3, qwen3_moe=load_qwen3)
ADAPTERS: dict[type[torch.nn.Module], type[ModelAdapter]] = {Qwen3ForCausalLM: Qwen3Adapter}
VLM_CLASS_NAMES = {"Qwen3VLForConditionalGeneration": VLMAdapter, "Qwen3VLMoeForConditionalGeneration": VLMAdapter}
"""transformers vision-language classes by name (their modules are imported only when a model is loaded)."""


def adapter_for(lm: torch.nn.Module) -> ModelAdapter:
    """The adapter of ``lm``'s family: registered for its class (or a base class: FSDP2 subclasses the
    module it shards), else ``HFAdapter``."""
    for cls in type(lm).__mro__:
        if cls in ADAPTERS:
            return ADAPTERS[cls](lm)
        if cls.__name__ in VLM_CLASS_NAMES:
            return VLM_CLASS_NAMES[cls.__name__](lm)
    return HFAdapter(lm)


def model_type(path: str) -> str | None:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    return json.loads(cfg.read_text()).get("model_type")


def use_custom(cfg: ModelConfig) -> bool:
    """True when our own code should load this model (raises for impl=custom on an unregistered type)."""
    if cfg.impl == "hf":
        return False
    mtype = model_type(cfg.path)
    if mtype in REGISTRY:
        return True
    if cfg.impl == "custom":
        raise ValueError(
            f"--model.impl=custom: no custom code for model_type {mtype!r} of {cfg.path!r}; "
            f"registered: {sorted(REGISTRY) or 'none'}; use --model.impl=hf"
        )
    return False


def load_custom(path: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    return REGISTRY[model_type(path)](path, device=device, dtype=dtype)
