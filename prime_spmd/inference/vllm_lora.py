"""LoRA on the vLLM engine: the adapters that arrive over the weight bridge run in vLLM's own LoRA layers.

Written against vLLM 0.32.0 (docs/lora.md, docs/vllm.md). With ``--model.lora.rank > 0`` the engine is
built with ``LLM(enable_lora=True, max_lora_rank=..., max_loras=1)``: vLLM wraps every linear layer in a
LoRA layer (on CPU through ``PunicaWrapperCPU``) and keeps the base weights it loaded from
``--model.path``; a weight sync carries the adapter tensors only (prime_spmd/sync/weights.py).

vLLM 0.32 loads an adapter only from a directory: ``LoRARequest.lora_path`` is read by
``WorkerLoRAManager._load_adapter`` -> ``LoRAModel.from_local_checkpoint``, which reads the safetensors
and ends in ``LoRAModel.from_lora_tensors``. We call ``from_lora_tensors`` with the received tensors
ourselves (``install_adapter``, on the worker, through the worker extension) and register the result in
the worker's adapter manager under a new adapter id per weight update, after removing the previous one.
Requests then carry a ``LoRARequest`` with that id; when a batch runs, vLLM's runner
(``set_active_adapters`` -> ``LRUCacheWorkerLoRAManager.add_adapter``) finds the id registered and only
activates it, so ``lora_path`` is never read (vLLM's own warm-up registers its dummy adapters the same
way: vllm/v1/worker/lora_model_runner_mixin.py ``maybe_setup_dummy_loras``). Nothing touches disk or HTTP.

Logprobs: vLLM runs the factored form x W0^T + (alpha / r) * (x A^T) B^T, as the trainer's ``LoraLinear``
does (no merge), so the two agree to fp32 rounding (tests/vllm_venv/test_lora_vllm.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from prime_spmd.log import logger
from prime_spmd.models.lora import PEFT_PREFIX, is_adapter, peft_config

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for ``max_lora_rank`` (vllm/config/lora.py ``MaxLoRARanks``)."""
IN_MEMORY_PATH = "prime_spmd:weight-bridge"
"""``LoRARequest.lora_path`` of our adapters (vLLM requires a non-empty path; it never reads this one)."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM 0.32 accepts that holds adapters of rank ``rank``."""
    for r in VLLM_MAX_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(
        f"--model.lora.rank={rank}: vLLM 0.32's LoRA layers hold ranks up to {VLLM_MAX_LORA_RANKS[-1]}; "
        f"lower --model.lora.rank or use --inference.engine=native"
    )


def lora_llm_kwargs(lora_cfg: Any) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` that enable LoRA for ``--model.lora.*`` (one adapter at a time)."""
    return dict(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora_cfg.rank), max_loras=1, max_cpu_loras=1)


class AdapterUpdates:
    """Engine side of LoRA on vLLM: stages the adapter tensors of one weight update (any number of
    buckets), installs them as a new vLLM adapter when the update closes, and holds the ``LoRARequest``
    every later request carries (``request``; None until the first update: the base model, which is the
    trainer's step-0 policy since its ``lora_B`` start at zero).

    ``add`` copies each tensor to CPU: the weight receiver reuses its staging buffer for every bucket, and
    vLLM's adapter manager keeps CPU copies that it moves into its device buffers at activation.
    ``lora_cfg`` is the ``--model.lora`` section (rank > 0), ``base_model`` the adapter config's base
    name. Single-process; the engine calls it on every rank of its tp group.
    """

    def __init__(self, lora_cfg: Any, base_model: str, lora_request_cls: Any = None) -> None:
        if lora_request_cls is None:
            from vllm.lora.request import LoRARequest as lora_request_cls
        self.cfg, self.base_model, self._request_cls = lora_cfg, base_model, lora_request_cls
        self.scale = lora_cfg.alpha / lora_cfg.rank
        """alpha / rank, what the trainer's ``LoraLinear`` and vLLM's ``PEFTHelper`` scale B A by."""
        self.adapter_id = 0
        self.request: Any = None
        self._tensors: dict[str, torch.Tensor] = {}

    def add(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stage adapter tensors (our HF-style names); any other name raises ``ValueError``. Returns how many."""
        n = 0
        for name, t in weights:
            if not is_adapter(name):
                raise ValueError(
                    f"the vLLM engine runs with LoRA (--model.lora.rank > 0) and takes adapter tensors only, got {name!r}"
                )
            self._tensors[PEFT_PREFIX + name] = t.detach().to("cpu", copy=True)
            n += 1
        return n

    def install(self, llm: Any) -> None:
        """Make the staged tensors (every ``lora_A`` with its ``lora_B``) the adapter of later requests.

        A new adapter id per update (``LLM.collective_rpc`` -> ``install_adapter`` on each worker), and
        a new name: vLLM's prefix-cache keys include the adapter's name and path."""
        tensors, self._tensors = self._tensors, {}
        a = {k.removesuffix(".lora_A.weight") for k in tensors if k.endswith(".lora_A.weight")}
        b = {k.removesuffix(".lora_B.weight") for k in tensors if k.endswith(".lora_B.weight")}
        if not tensors or a != b:
            raise RuntimeError(f"LoRA weight update: no adapters, or adapters without their pair: {sorted(a ^ b)[:3]}")
        self.adapter_id += 1
        config = peft_config(self.cfg, self.base_model)
        (num_modules, *_) = llm.collective_rpc("prime_spmd_set_adapter", args=(self.adapter_id, tensors, config))
        self.request = self._request_cls(
            lora_name=f"prime_spmd_{self.adapter_id}", lora_int_id=self.adapter_id, lora_path=IN_MEMORY_PATH
        )
        logger.debug(f"vllm: adapter {self.adapter_id} installed on {num_modules} modules")


def install_adapter(worker: Any, adapter_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> int:
    """On a vLLM worker: make ``tensors`` (PEFT names) adapter ``adapter_id``, replacing every adapter held.

    Validates as vLLM's own loader does (``PEFTHelper.validate_legal``: rank <= max_lora_rank, no DoRA or
    bias) and raises ``ValueError`` for a module vLLM cannot adapt. ``config`` is the adapter's
    ``adapter_config.json`` content (``models.lora.peft_config``). Returns how many of vLLM's (fused)
    modules hold weights of the new adapter.
    """
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    manager = worker.model_runner.lora_manager  # LRUCacheWorkerLoRAManager
    adapters = manager._adapter_manager  # LRUCacheLoRAModelManager: registered and active adapters
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    # The check from_local_checkpoint makes (from_lora_tensors makes none): module suffixes vLLM adapts,
    # the fused qkv_proj / gate_up_proj expanded into the checkpoint's q/k/v and gate/up names.
    supported = set()
    for module in adapters.supported_lora_modules:
        supported.update(adapters.packed_modules_mapping.get(module, [module]))
    modules = {parse_fine_tuned_lora_name(name, mapper)[0] for name in tensors}
    bad = sorted(m for m in modules if m.rsplit(".", 1)[-1] not in supported)
    if bad:
        raise ValueError(
            f"--model.lora.target_modules: vLLM 0.32 has no LoRA layer for {bad[:3]} (it adapts {sorted(supported)})"
        )
    lora = LoRAModel.from_lora_tensors(
        adapter_id,
        tensors,
        helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    adapters.remove_all_adapters()
    adapters.add_adapter(lora)  # packs q/k/v into qkv_proj and gate/up into gate_up_proj, in place
    return len(lora.loras)
