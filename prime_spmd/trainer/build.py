"""Build the trainer side of a job: model (FSDP2), optimizer, schedule, tokenizer."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from prime_spmd.config.sections import ModelConfig, OptimConfig, TrainerConfig
from prime_spmd.distributed.fsdp import parallelize, unwrapped_name
from prime_spmd.distributed.groups import DistContext
from prime_spmd.distributed.mesh import build_trainer_mesh
from prime_spmd.log import logger
from prime_spmd.models.common.attention import flash_attn_varlen_func
from prime_spmd.models.loading import load_model, load_tokenizer, maybe_build_tiny, resolve_dtype
from prime_spmd.models.lora import apply_lora
from prime_spmd.models.registry import adapter_for
from prime_spmd.models.vision import load_vision_processor
from prime_spmd.trainer.optim import build_optimizer, build_scheduler
from prime_spmd.trainer.policy import PolicyModel, resolve_loss_impl, resolve_router_aux_coef


@dataclass
class TrainerParts:
    policy: nn.Module
    """PolicyModel (FSDP2 root); ``policy.lm`` is the causal LM with HF parameter names."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    mesh: DeviceMesh
    tokenizer: object
    compute_dtype: torch.dtype
    processor: object = None
    """The ``VisionProcessor`` of a vision-language model (images -> vision inputs), None for text-only models."""


def prepare_model_dir(model_cfg: ModelConfig, ctx: DistContext, seed: int) -> None:
    """With --model.init_tiny, global rank 0 writes the random model once; every rank of the job
    waits for it through the TCPStore (works across roles, before any role collective)."""
    if model_cfg.init_tiny == "none":
        return
    key = f"init_tiny_done/{os.path.abspath(model_cfg.path)}"
    if ctx.topo.rank == 0:
        maybe_build_tiny(model_cfg, seed)
        ctx.store.set(key, "1")
    else:
        ctx.store.wait([key])


def set_threads(num_threads: int) -> None:
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def varlen_attention(model_cfg: ModelConfig, device: torch.device) -> bool:
    """Whether attention over packed documents runs varlen (flash-attn), with no O(L^2) block mask: HF's
    flash_attention_2, or flash-attn installed on CUDA (our model code). Else the trainer unpacks
    documents into padded rows (``PolicyModel.unpack_documents``)."""
    if model_cfg.attn_implementation == "flash_attention_2":
        return True

    return device.type == "cuda" and flash_attn_varlen_func is not None


def compile_training(flag: str, device: torch.device, by_default: bool) -> bool:
    """--trainer.compile: auto compiles on CUDA where the adapter says so (``compiles_by_default``: our dense
    Qwen3 code); "on" forces it, "off" never."""
    return flag == "on" or (flag == "auto" and device.type == "cuda" and by_default)


def build_trainer(
    model_cfg: ModelConfig,
    trainer_cfg: TrainerConfig,
    optim_cfg: OptimConfig,
    ctx: DistContext,
    tokenizer: Any | None = None,
) -> TrainerParts:
    """Load the LM (fp32 master weights), add LoRA adapters (--model.lora.rank > 0: only they train), apply
    EP (ep > 1), AC and FSDP2, build AdamW (trainable parameters only) + schedule. ``tokenizer``: ``model_cfg``'s,
    already loaded (a colocated engine's: one load a process, ~0.5-1 s of start-up for Qwen3's), else loaded here.

    Collective over the trainer role: every trainer rank calls it.
    """
    device = ctx.device
    compute_dtype = resolve_dtype(model_cfg.dtype, device)
    torch.manual_seed(trainer_cfg.seed)
    master = trainer_cfg.offload == "master"
    if master:
        check_master_offload(model_cfg, ctx.topo.num_trainer_ranks)
    # fp32 master weights for what trains; with LoRA the frozen base is held once, in the compute dtype (bf16 on CUDA:
    # 2 bytes a parameter instead of 4) and only the fp32 adapters train; with the masters on the host
    # (--trainer.offload master) the parameters are the compute-dtype weights
    lm = load_model(model_cfg, device, dtype=compute_dtype if model_cfg.lora.rank or master else torch.float32)
    adapter = adapter_for(lm)
    adapter.prepare_for_training()
    if model_cfg.freeze_vision:  # before LoRA and FSDP2: frozen weights are held as loaded and get no optimizer state
        if not hasattr(adapter, "vision_parameters"):
            raise ValueError(f"--model.freeze_vision: {adapter.model_type!r} has no vision tower")
        for p in adapter.vision_parameters():
            p.requires_grad_(False)
    if model_cfg.lora.rank:  # before FSDP2: the adapters are sharded with their block (docs/lora.md)
        adapted = apply_lora(lm, model_cfg.lora, seed=trainer_cfg.seed, base_model=model_cfg.path)
        num_trainable = sum(p.numel() for p in lm.parameters() if p.requires_grad)
        num_total = sum(p.numel() for p in lm.parameters())
        logger.info(
            f"LoRA r={model_cfg.lora.rank} alpha={model_cfg.lora.alpha} on {len(adapted)} modules: "
            f"{num_trainable:,} trainable of {num_total:,} parameters"
        )
    router_aux_coef = resolve_router_aux_coef(model_cfg.router_aux_loss_coef, adapter)
    policy = PolicyModel(
        lm,
        resolve_loss_impl(trainer_cfg.loss_impl, device),
        router_aux_coef,
        unpack_documents=not varlen_attention(model_cfg, device),
        share_prompts=trainer_cfg.share_prompts,
        exact=model_cfg.exact,
        compile_warmup=trainer_cfg.compile_warmup,
    )
    mesh = build_trainer_mesh(ctx.topo, device)
    # EP (mesh with an ep axis) -> activation checkpointing -> FSDP2 per block -> root
    parallelize(
        policy,
        adapter.block_lists(),
        mesh,
        param_dtype=compute_dtype,
        activation_checkpointing=trainer_cfg.activation_checkpointing,
        reshard_after_forward=trainer_cfg.reshard_after_forward,
        experts=adapter.expert_modules(),
        compile_blocks="inductor"
        if compile_training(trainer_cfg.compile, device, adapter.compiles_by_default()) and not model_cfg.exact
        else None,
        plain_trained=master,
    )
    optimizer = build_optimizer(policy, optim_cfg, offload=trainer_cfg.offload)
    scheduler = build_scheduler(optimizer, optim_cfg, trainer_cfg.max_steps)
    return TrainerParts(
        policy=policy,
        optimizer=optimizer,
        scheduler=scheduler,
        mesh=mesh,
        tokenizer=(tokenizer := tokenizer if tokenizer is not None else load_tokenizer(model_cfg)),
        compute_dtype=compute_dtype,
        processor=load_vision_processor(model_cfg.path, tokenizer),
    )


def check_master_offload(model_cfg: ModelConfig, num_trainer_ranks: int) -> None:
    """``--trainer.offload master`` needs one trainer rank (its parameters stay whole, plain tensors: no FSDP2 shard to
    keep a master of) and full fine-tuning (LoRA's adapters are small fp32 tensors already)."""
    if num_trainer_ranks != 1:
        raise ValueError(
            f"--trainer.offload master runs on one trainer rank (this job has {num_trainer_ranks}): use "
            "--trainer.offload optimizer with several"
        )
    if model_cfg.lora.rank:
        raise ValueError(
            f"--trainer.offload master is for full fine-tuning; with --model.lora.rank {model_cfg.lora.rank} the "
            "adapters are the only trained weights: use --trainer.offload optimizer"
        )


def strip_prefix(state_dict: dict[str, torch.Tensor], prefix: str = "lm.") -> dict[str, torch.Tensor]:
    """PolicyModel state-dict names -> the LM's own (HF) names; checkpoint wrappers' prefixes removed."""
    out = {}
    for k, v in state_dict.items():
        if k.startswith(prefix):
            k = k[len(prefix) :]
        out[unwrapped_name(k)] = v
    return out
