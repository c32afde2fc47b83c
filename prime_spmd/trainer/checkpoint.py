"""Checkpoints that resume exactly, and HF-format weight export.

Layout of ``<output_dir>/checkpoints/``:
- ``step_000010/``: complete checkpoints only. ``dcp/`` holds the torch.distributed.checkpoint
  shards of model + optimizer (written by every trainer rank), ``state.json`` the controller state
  (step, scheduler, data position, counters, anything the loop adds), ``rng_rank{r}.pt`` each rank's
  RNG states.
- ``step_000010.tmp/``: being written. A checkpoint is written under the .tmp name and renamed
  by rank 0 after every rank finished (rename is atomic), so a kill mid-write never leaves a
  corrupt checkpoint under a complete name; stale .tmp dirs are deleted at the next start.

LoRA (docs/lora.md): ``dcp/`` holds the trainable parameters (the adapters) and their optimizer state
only; the frozen base is reloaded from --model.path on resume. Each checkpoint also holds
``adapter/`` in PEFT's layout, and ``save_hf`` writes the merged model plus ``<run>/adapter``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from prime_spmd.distributed.fsdp import unwrapped_name
from prime_spmd.log import logger
from prime_spmd.models.lora import is_adapter, lora_modules, lora_scale, merge_state_dict, save_adapter
from prime_spmd.models.registry import adapter_for


def _has_frozen(model: nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def _options(model: nn.Module) -> StateDictOptions:
    """Frozen parameters (the LoRA base) stay out of checkpoints: they are reloaded from the model dir."""
    frozen = _has_frozen(model)
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``get_state_dict`` without frozen parameters; tied aliases of a frozen parameter (a tied LM head)
    are dropped too, which ``ignore_frozen_params`` alone keeps (torch 2.13)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    frozen = {unwrapped_name(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Save/load trainer state. Collective over the trainer role: every trainer rank calls
    ``save``/``load`` at the same step; only trainer rank 0 touches the directory names."""

    def __init__(self, output_dir: str | Path, keep_last: int, rank: int) -> None:
        self.root = Path(output_dir) / "checkpoints"
        self.keep_last, self.rank = keep_last, rank
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("step_*.tmp"):
                logger.warning(f"removing incomplete checkpoint {stale}")
                shutil.rmtree(stale, ignore_errors=True)
        _barrier()

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return complete_checkpoints(self.root.parent)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root.parent)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        blobs: dict[str, bytes] | None = None,
    ) -> Path:
        """Write checkpoint ``step`` (the number of optimizer steps taken). ``state`` is JSON-able and
        ``blobs`` (file name -> bytes, e.g. the controller's rollout buffer) are rank 0's."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"step_{step:06d}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = _state_dicts(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        torch.save(rng_state(), tmp / f"rng_rank{self.rank}.pt")
        _save_adapter_if_lora(model, tmp / "adapter", self.rank)
        _barrier()
        if self.rank == 0:
            for name, data in (blobs or {}).items():
                (tmp / name).write_bytes(data)
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
            _test_pause_before_rename(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in self.complete()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            logger.info(f"saved checkpoint {final}")
        _barrier()
        return final

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load model + optimizer shards and this rank's RNG; return the saved controller state."""
        model_sd, optim_sd = _state_dicts(model, optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=str(path / "dcp"))
        set_state_dict(
            model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=_options(model)
        )
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        logger.info(f"resumed from {path}")
        return json.loads((path / "state.json").read_text())


def _test_pause_before_rename(tmp: Path) -> None:
    """Test hook (tests/distributed/test_kill_resume.py): with PRIME_SPMD_TEST_CKPT_PAUSE_S set, every
    shard and state.json are written, a PAUSED marker appears and the writer sleeps before the rename,
    so the test can SIGKILL it mid-write. Unset in real runs."""
    pause_s = float(os.environ.get("PRIME_SPMD_TEST_CKPT_PAUSE_S", "0"))
    if pause_s > 0:
        (tmp / "PAUSED").touch()
        time.sleep(pause_s)


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run directory, oldest first (any rank may call it; no collectives)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if p.is_dir() and p.suffix != ".tmp" and (p / "state.json").is_file()]
    return sorted(done, key=lambda p: int(p.name[5:]))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run directory (any rank may call it; no collectives)."""
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict; collective over the trainer role, result on every rank."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _save_adapter_if_lora(model: nn.Module, out_dir: Path, rank: int) -> None:
    """LoRA: gather the adapters (collective over the trainer role: every trainer rank calls it) and
    write them in PEFT's layout on trainer rank 0. Does nothing without LoRA."""
    lm = getattr(model, "lm", model)
    if not lora_modules(lm):
        return
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    sd = {unwrapped_name(k).removeprefix("lm."): v for k, v in get_model_state_dict(model, options=options).items()}
    if rank == 0:
        save_adapter(sd, lm.lora_config, lm.lora_base_model, out_dir)


def save_hf(lm: nn.Module, state_dict: dict[str, torch.Tensor], out_dir: str | Path, tokenizer=None) -> Path:
    """Write HF-format safetensors that ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads.

    ``state_dict`` has the LM's own (HF) parameter names. Written to a temp dir and renamed.
    LoRA (adapters in ``state_dict``): the merged model goes to ``out_dir`` and the adapters, in
    PEFT's layout, to ``<out_dir>/../adapter``. Call on one rank only.
    """
    if any(is_adapter(k) for k in state_dict):
        save_adapter(state_dict, lm.lora_config, lm.lora_base_model, Path(out_dir).with_name("adapter"))
        state_dict = merge_state_dict(state_dict, lora_scale(lm))
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    adapter_for(lm).write_hf(state_dict, tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
