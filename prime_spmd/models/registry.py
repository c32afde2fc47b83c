"""Which HF config types have our own model code (``--model.impl custom|auto``).

Custom model families register a loader here: ``REGISTRY[model_type] = loader(path, device, dtype)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from prime_spmd.config.sections import ModelConfig

REGISTRY: dict[str, Callable[..., torch.nn.Module]] = {}


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


def _load_qwen3(path: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from prime_spmd.models.qwen3.hf import load_qwen3  # lazy: keeps kernels/ out of plain HF runs

    return load_qwen3(path, device=device, dtype=dtype)


REGISTRY.update(qwen3=_load_qwen3, qwen3_moe=_load_qwen3)
