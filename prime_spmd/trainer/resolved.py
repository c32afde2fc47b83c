"""What each ``auto`` setting of a run resolved to, for the ``resolved`` block of ``<output_dir>/config.json``.

The values come from the objects the run built (the policy, the engine, the process group), so they are what
ran, not a second copy of the rules. ``config.loader.auto_flags`` lists the flags whose value leaves the choice
to the run; tests/unit/test_config.py checks that every one of them is covered here.
"""

from __future__ import annotations

from typing import Any

import torch

from prime_spmd.config.job import JobConfig
from prime_spmd.inference.native import NativeEngine
from prime_spmd.log import logger
from prime_spmd.models.loading import resolve_dtype
from prime_spmd.models.registry import use_custom
from prime_spmd.trainer.build import compile_training

# native-engine flags that the vLLM engine does not read
_NATIVE_ONLY = ("decode_attention", "decode_linear", "sampler", "warmup", "prefill", "decode_steps_per_launch")


def resolved_settings(
    cfg: JobConfig,
    device: torch.device,
    *,
    topology: Any = None,
    backend: str | None = None,
    policy: Any = None,
    engine: Any = None,
    max_model_len: int | None = None,
    bridge_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Flag -> resolved value for the settings that leave the choice to the run (``auto``, 0 or None meaning
    "pick"). ``topology`` (``distributed.topology.Topology``), ``backend``, ``policy`` (``PolicyModel``) and
    ``engine`` (``InferenceEngine``) are the run's objects where this rank has them; flags that need an absent
    one are left out. Call on the rank that writes config.json (global rank 0). No side effects."""
    out: dict[str, Any] = {
        "model.dtype": str(resolve_dtype(cfg.model.dtype, device)).removeprefix("torch."),
        "model.impl": "custom" if use_custom(cfg.model) else "hf",
    }
    if topology is not None:
        out["topology.mode"] = topology.mode
    if backend is not None:
        out["topology.backend"] = backend
    if bridge_timeout_s is not None:
        out["topology.bridge_timeout_s"] = bridge_timeout_s
    if policy is not None:
        out["trainer.loss_impl"] = policy.loss_impl
        compiled = compile_training(cfg.trainer.compile, device, policy.adapter.compiles_by_default())  # type: ignore[union-attr]
        out["trainer.compile"] = "on" if compiled else "off"
        out["trainer.share_prompts"] = policy.share_prompts
        out["model.router_aux_loss_coef"] = policy.router_aux_coef
    else:  # eval: no training loss
        out["model.router_aux_loss_coef"] = "unused (no trainer)"
    if max_model_len is not None:
        out["inference.max_model_len"] = max_model_len
    if isinstance(engine, NativeEngine):
        # the generic runner (any other transformers model) re-runs its sequences and has none of these paths
        generic = "unused (generic runner: the model's own forward)"
        out["inference.native.decode_attention"] = getattr(engine.runner, "attention", generic)
        out["inference.native.decode_linear"] = getattr(engine.runner, "linear", generic)
        out["inference.native.sampler"] = engine.sampler
        out["inference.native.prefill"] = "layer_fn" if getattr(engine.runner, "prefill_layer", None) else "modules"
        out["inference.native.decode_steps_per_launch"] = engine.decode_steps
        out["inference.max_model_len"] = engine.max_model_len
        cache = getattr(engine.runner, "cache", None)
        if cache is None:
            out["inference.kv_cache_dtype"] = generic
        else:  # auto: the model's dtype
            out["inference.kv_cache_dtype"] = (
                "fp8" if cache.kv_dtype == "fp8" else str(cache.dtype).removeprefix("torch.")
            )
    elif engine is not None:
        out.update({f"inference.native.{name}": "ignored (vllm)" for name in _NATIVE_ONLY})
        kv = cfg.inference.kv_cache_dtype  # type: ignore[union-attr]
        out["inference.kv_cache_dtype"] = "fp8" if kv == "fp8" else "auto (vllm: the model's dtype)"
    return out


def warn_unshared_prompts(cfg: JobConfig, policy: Any) -> None:
    """Warn (once, on the calling rank) when --trainer.share_prompts is on but the model cannot share prompts."""
    if cfg.trainer.share_prompts and not policy.share_prompts:  # type: ignore[union-attr]
        logger.warning(
            f"--trainer.share_prompts is on but {cfg.model.path!r} ({type(policy.lm).__name__}) runs every sample's "
            "prompt: only our dense model code forwards a group's shared prompt once (MoE models would route it "
            "once instead of once per sample; transformers models take no attention mask for it); pass "
            "--trainer.no_share_prompts to silence this"
        )
