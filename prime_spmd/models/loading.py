"""Load causal LMs and tokenizers from local directories (or hub ids where a hub is reachable).

Every error names the path and what is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from prime_spmd.config.sections import ModelConfig
from prime_spmd.log import logger
from prime_spmd.models import registry
from prime_spmd.models.qwen3.hf import materialize_random, random_init_std
from prime_spmd.models.tiny import build_tiny_model
from prime_spmd.models.vlm import VLM_PRESETS, VLM_TYPES, build_tiny_vlm


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def check_model_dir(path: str, random_init: bool = False) -> None:
    """Raise ``ValueError`` when a local model directory lacks what ``from_pretrained`` needs (``random_init``: a
    local directory with config.json and no weights, which ``--model.random_init`` draws instead).

    Paths that do not exist locally are treated as hub ids and left to transformers.
    """
    p = Path(path)
    if random_init:
        if not (p / "config.json").is_file():
            raise ValueError(f"--model.random_init: --model.path={path!r} must be a local directory with a config.json")
        weights = sorted(x.name for x in [*p.glob("*.safetensors"), *p.glob("*.bin")])
        if weights:
            raise ValueError(
                f"--model.random_init draws the weights, but --model.path={path!r} holds weights too ({weights[:3]}); "
                "drop --model.random_init to load them, or point --model.path at a directory with config.json and "
                "the tokenizer only"
            )
        return
    if not p.exists():
        if p.is_absolute() or path.startswith((".", "~")) or path.count("/") != 1:
            raise ValueError(f"--model.path={path!r}: no such directory (and not a hub id of the form org/name)")
        return
    if not p.is_dir():
        raise ValueError(f"--model.path={path!r} is a file; expected a model directory")
    if not (p / "config.json").is_file():
        raise ValueError(f"--model.path={path!r} has no config.json; is it a Hugging Face model directory?")
    weights = list(p.glob("*.safetensors")) + list(p.glob("*.bin"))
    if not weights:
        raise ValueError(
            f"--model.path={path!r} has no weights (*.safetensors or *.bin); "
            "write one with save_pretrained or use --model.init_tiny"
        )


def maybe_build_tiny(cfg: ModelConfig, seed: int) -> None:
    """With ``--model.init_tiny``, write a random tiny model at ``--model.path`` unless one is there."""
    if cfg.init_tiny == "none":
        return
    p = Path(cfg.path)
    if (p / "config.json").is_file():
        logger.info(f"model.init_tiny={cfg.init_tiny}: {p} already holds a model, loading it")
        return

    logger.info(f"model.init_tiny={cfg.init_tiny}: writing a random-init model to {p}")
    if cfg.init_tiny in VLM_PRESETS:
        build_tiny_vlm(p, preset=cfg.init_tiny, seed=seed)
        return
    build_tiny_model(p, preset=cfg.init_tiny, seed=seed)


def load_tokenizer(cfg: ModelConfig):
    """Load the tokenizer of ``--model.tokenizer_path`` (or ``--model.path``); pad token set."""
    path = cfg.tokenizer_path or cfg.path
    try:
        tok = tokenizer_class(path, cfg.trust_remote_code).from_pretrained(
            path, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_class(path: str, trust_remote_code: bool = False):
    """The class ``AutoTokenizer`` would pick for ``path``: its tokenizer_config.json's ``tokenizer_class`` where
    transformers has that class, imported alone; else ``AutoTokenizer`` (remote code, no such file or class).
    ``AutoTokenizer`` imports the auto-model factory and with it transformers' generation code (5.17-5.19, the
    releases vLLM 0.32 pins: ~6 s of start-up on the H200 machine, 2.2 s of it scikit-learn), which a tokenizer never
    uses."""
    config = Path(path) / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() and not trust_remote_code else None
    for candidate in (name, name.removesuffix("Fast")) if isinstance(name, str) else ():
        try:
            return getattr(transformers, candidate)
        except (AttributeError, ImportError):  # not in this release (a renamed or removed slow/fast class)
            continue
    return transformers.AutoTokenizer


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Load the causal LM of ``cfg`` onto ``device``: custom code where registered (impl auto/custom), else HF.

    ``--model.random_init``: our registered loader draws the weights on ``device`` instead of reading them (device
    "meta": nothing materialized yet; ``materialize_random_init`` draws what is left)."""
    check_model_dir(cfg.path, random_init=cfg.random_init)
    dtype = dtype or resolve_dtype(cfg.dtype, device)
    if cfg.random_init:
        mtype = registry.model_type(cfg.path)
        if cfg.impl == "hf" or mtype not in registry.REGISTRY:
            raise ValueError(
                f"--model.random_init: only our own model code draws weights (model types {sorted(registry.REGISTRY)} "
                f"with --model.impl auto or custom); {cfg.path!r} is {mtype!r} with --model.impl={cfg.impl}"
            )
        return registry.REGISTRY[mtype](cfg.path, device=device, dtype=dtype, random_init_seed=cfg.random_init_seed)
    if registry.use_custom(cfg):
        return registry.load_custom(cfg.path, device=device, dtype=dtype)
    # vision-language models (models/vlm.py) load as image-text-to-text: transformers has no causal-LM class for them
    vlm = registry.model_type(cfg.path) in VLM_TYPES
    auto = transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(
        cfg.path,
        dtype=dtype,
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code,
    )
    return model.to(device)


def materialize_random_init(model: torch.nn.Module, cfg: ModelConfig, device: torch.device) -> int:
    """``--model.random_init``: draw every parameter of ``model`` (loaded on meta) still on meta, on ``device``, with
    the values ``load_model`` gives them; returns the bytes drawn. Single process, no collective."""
    return materialize_random(model, device, cfg.random_init_seed, random_init_std(model.hf_config))
