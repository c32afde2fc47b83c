"""FSDP2, EP and activation checkpointing, applied by ``parallelize`` in one fixed order.

Order: (TP: not yet) -> EP (models with experts and an ``ep`` axis, distributed/ep.py) ->
torch.compile of each block's forward (``--trainer.compile``) -> activation checkpointing -> FSDP2 per
transformer block (the experts of a block first, as their own FSDP unit; no per-block units on a one-rank
trainer) -> FSDP2 on the root. The model's forward stays single-device code.

Sharding with ep > 1 (trainer mesh ("dp_shard", "ep"), world W = dp_shard * ep): expert weights are
Shard(0) over ``ep`` (EP) and FSDP-sharded over ``dp_shard``; every other parameter is FSDP-sharded
over the flattened ``dp_shard_ep`` (all W ranks).

Gradient scaling: the step scales the loss by W (see trainer/step.py) because FSDP2 averages dense
grads over its W ranks, so a dense grad ends up as the sum over all ranks. An expert grad is already
summed over its ``ep`` group by the backward all-to-all and then reduced over ``dp_shard`` only;
FSDP2's default divide factor there is ``dp_shard``, which would leave expert grads ``ep`` times too
large. The experts' FSDP units therefore divide by W, like the dense ones.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from prime_spmd.distributed.ep import apply_ep
from prime_spmd.distributed.mesh import fsdp_axis


def parallelize(
    root: nn.Module,
    layer_lists: list[nn.ModuleList],
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    activation_checkpointing: bool,
    reshard_after_forward: bool = True,
    experts: list[nn.Module] = (),
    compile_blocks: str | None = None,
    plain_trained: bool = False,
) -> nn.Module:
    """Apply EP (when the mesh has an ``ep`` axis), block compilation, activation checkpointing and FSDP2,
    in that order. ``compile_blocks``: a torch.compile backend ("inductor") for every block's forward, or None.
    ``plain_trained`` (one rank, ``--trainer.offload master``): trained parameters held in ``param_dtype`` stay plain
    tensors too (``one_rank_plain``).

    ``layer_lists``: the ModuleLists holding the transformer blocks (AC replaces their entries);
    ``experts``: the stacked-expert modules inside them (``ModelAdapter.expert_modules``), sharded by EP
    and wrapped as their own FSDP units when the mesh has an ``ep`` axis, ignored otherwise.
    Collective over the trainer role: every trainer rank calls it with the same model structure
    and the same full weights.
    """
    names = mesh.mesh_dim_names or ()
    if "ep" not in names:
        experts = []
    else:
        assert names == ("dp_shard", "ep"), f"EP expects the trainer mesh axes (dp_shard, ep), got {names}"
        if not experts:
            raise ValueError("--topology.ep > 1 needs a model with experts in our code (--model.impl custom)")
        for m in experts:
            apply_ep(m, mesh["ep"])
    if compile_blocks:
        compile_block_forwards([b for layers in layer_lists for b in layers], compile_blocks)
    if activation_checkpointing:
        apply_activation_checkpointing([b for layers in layer_lists for b in layers], layer_lists)
    return apply_fsdp(
        root,
        [b for layers in layer_lists for b in layers],
        mesh,
        param_dtype,
        reshard_after_forward=reshard_after_forward,
        experts=experts,
        plain_trained=plain_trained,
    )


_AC_WRAPPER = "._checkpoint_wrapped_module"


def unwrapped_name(name: str) -> str:
    """A parameter name without the activation-checkpoint wrapper's segment (the model's own/HF name)."""
    return name.replace(_AC_WRAPPER, "")


def compile_block_forwards(blocks: list[nn.Module], backend: str = "inductor") -> None:
    """Replace each block's ``forward`` by its torch.compile'd version (dynamic shapes: RL micro-batches
    change length every step). The module itself stays (parameter names, hooks: FSDP2's and AC's wrappers
    run eagerly around the compiled forward). The blocks share one code object, so dynamo compiles it once
    per input kind (plain causal, masked, varlen) and reuses that graph in every block: parameters are graph
    inputs (``inline_inbuilt_nn_modules``), not constants. Inductor options: ``block_compile_options``."""
    options = block_compile_options(backend)
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend, dynamic=True, options=options)


def block_compile_options(backend: str) -> dict | None:
    """Inductor options of the compiled blocks: none that guard on the micro-batch's size. Inductor fuses the
    two reductions of a norm's backward (over rows for the input's gradient, over tokens for the weight's:
    "mix-order reduction", CUDA only) when the tensor is large, and in strict mode it guards on that size
    (``1024*x_BTD.size()[1]*x_BTD.size()[0] < 5242880``, torch 2.11 on the H100, 2026-12-06): the step-0
    warm-up's tiny rows compile the unfused form and every micro-batch of 5,120 tokens or more recompiles each
    block-input kind, past dynamo's recompile limit in a short SFT. Non-strict mode fuses at any size, no
    guard. Torch builds without the option get none."""
    if backend != "inductor":
        return None
    from torch._inductor import config

    if not hasattr(config.triton, "mix_order_reduction_non_strict_mode"):
        return None
    return {"triton.mix_order_reduction_non_strict_mode": True}


def apply_activation_checkpointing(blocks: list[nn.Module], parent_lists: list[nn.ModuleList]) -> None:
    """Wrap every transformer block so its activations are recomputed in the backward."""
    for layers in parent_lists:
        for i, block in enumerate(list(layers)):
            layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_fsdp(
    root: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    experts: list[nn.Module] = (),
    plain_trained: bool = False,
) -> nn.Module:
    """``fully_shard`` each block, then the root (embeddings, final norm, LM head, wrapper); on a one-rank FSDP
    axis without experts, the root only (see below).

    Collective over the trainer role: every trainer rank calls it with the same model structure.
    Parameters become DTensors sharded on dim 0 over the FSDP axis; gradients are reduce-scattered
    in ``reduce_dtype`` and averaged over the FSDP axis. ``experts`` (EP already applied, weights
    Shard(0) over ``ep``) become their own FSDP units over ``dp_shard`` with the dense divide factor
    (module docstring).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    axis = fsdp_axis(mesh)
    for m in experts:
        assert mesh.mesh_dim_names == ("dp_shard", "ep"), mesh.mesh_dim_names
        fully_shard(m, mesh=mesh["dp_shard"], mp_policy=mp, reshard_after_forward=reshard_after_forward)
        m.set_gradient_divide_factor(float(axis.size()))
        # A custom factor means a PREMUL_SUM reduce-scatter, which gloo lacks: sum, then divide. Not
        # on a 1-rank dp_shard axis, where torch (2.13) would then divide twice (no comm there anyway).
        m.set_force_sum_reduction_for_comms(mesh["dp_shard"].size() > 1)
    # One rank: nothing is sharded, and per-block units only add hooks and copies (FSDP2 on one CPU rank, 28
    # small blocks: 95-110 ms per forward + backward against 56-66 ms unwrapped, root only 56-74 ms; 2026-12-03).
    # So the root alone holds every parameter; its unsharded (param_dtype) copy then lives for the whole
    # forward + backward instead of one block's at a time.
    if axis.size() > 1 or experts:
        for block in blocks:
            fully_shard(block, mesh=axis, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # The root keeps its parameters gathered after the forward: the backward needs them at once.
    fully_shard(
        root,
        mesh=axis,
        mp_policy=mp,
        reshard_after_forward=False,
        ignored_params=one_rank_plain(root, axis, experts, param_dtype, plain_trained),
    )
    if axis.size() == 1 and not experts and hasattr(root, "set_custom_reduce_scatter"):
        root.set_custom_reduce_scatter(OneRankReduceScatter())
        _ONE_RANK_ROOTS.add(root)
    return root


def one_rank_plain(
    root: nn.Module, axis: DeviceMesh, experts, param_dtype: torch.dtype, trained: bool = False
) -> set[nn.Parameter] | None:
    """The parameters a one-rank root leaves out of FSDP2 (``ignored_params``): frozen ones already in the compute
    dtype (the LoRA base, loaded in bf16), and with ``trained`` (``--trainer.offload master``: the trained weights are
    compute-dtype parameters whose fp32 masters the optimizer keeps on the host) every parameter in the compute dtype:
    they need no cast, and their gradients accumulate through the optimizer's hooks (``trainer/offload.py``). There
    FSDP2 would shard nothing, yet it copies each parameter into a new padded shard at ``fully_shard`` (all of the
    root's at once: one H100, Qwen3-30B-A3B LoRA at 667582b, out of memory at 78.5 GiB for 56.9 GiB of base weights)
    and into an unsharded copy for every forward, which the root keeps until the backward ends: twice the base either
    way. Left out, they stay plain tensors, read in place by the forward, the weight sync and the engine. Frozen
    parameters in another dtype (a frozen fp32 vision tower) still need FSDP2's cast; on more ranks, or beside expert
    units, every parameter is sharded as before."""
    if axis.size() > 1 or experts:
        return None
    return {p for p in root.parameters() if (trained or not p.requires_grad) and p.dtype == param_dtype} or None


_ONE_RANK_ROOTS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Roots ``apply_fsdp`` sharded over a one-rank axis as the only FSDP unit: their gradient "reduce" is a copy of
every gradient at once, which ``OneRankReduceScatter`` and ``set_gradient_sync`` keep to one buffer."""


class OneRankReduceScatter:
    """FSDP2's reduce-scatter on a one-rank root: the output is the input buffer itself. FSDP2 allocates an input
    buffer (every gradient, copied in, in the reduce dtype) and an output buffer of the same size, then copies one
    into the other (torch's one-rank branch) and keeps the output as the sharded gradients: two buffers of 4 bytes a
    parameter at once, on top of the bf16 gradients (one H200, 090adcf, Qwen3-8B full fine-tuning: out of memory
    asking for the second 30.5 GiB). Here ``allocate`` hands the output call the input it just made, so the copy is
    onto itself and the gradients are views of the one buffer. ``__call__`` (a real reduce-scatter, never called on
    one rank by torch 2.11-2.13) reduces into the output, in place where the two are one. Set through
    ``FSDPModule.set_custom_reduce_scatter``, which takes any object with these two methods (torch's ``ReduceScatter``
    interface)."""

    def __init__(self) -> None:
        self._input: weakref.ref[torch.Tensor] | None = None
        """The input buffer just allocated, weakly: never kept alive past FSDP2's own references (a torch whose
        reduce allocated its output elsewhere would otherwise leave a gradient-sized buffer held between steps)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        last = self._input() if self._input is not None else None
        self._input = None
        if last is not None and last.dtype == dtype and last.device == device and last.numel() == math.prod(size):
            return last.view(*size)  # the output of the reduce whose input was allocated just before
        buf = torch.empty(*size, dtype=dtype, device=device)
        self._input = weakref.ref(buf)
        return buf

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        # gradient buffers inside FSDP2's post-backward hook: no autograd graph runs through this collective
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def set_gradient_sync(module: nn.Module, sync: bool) -> None:
    """On a one-rank root (``_ONE_RANK_ROOTS``), reduce the gradients only when ``sync`` (the step's last micro-batch):
    the micro-batches before it accumulate into FSDP2's unsharded gradient (in the reduce dtype, fp32), and one
    reduce at the end copies it into the buffer the optimizer reads. Per-micro-batch reduces would add each
    micro-batch's copy onto the gradients already there: three fp32 gradient-sized buffers at the peak against two.
    Any other module: nothing (several ranks reduce-scatter every micro-batch: their sharded gradients are what
    keeps the memory down). Same sums in the same order either way."""
    if module in _ONE_RANK_ROOTS:
        module.set_requires_gradient_sync(sync)


@torch.no_grad()
def clip_grad_norm_(grads, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over gradient tensors (``grads``; None entries skipped) on several meshes
    (EP: expert grads live on the (dp_shard, ep) mesh, the rest on dp_shard_ep; torch's version stacks norms across
    meshes and fails). Returns the total L2 norm as a plain tensor, equal on every rank.

    Collective over the trainer role: every trainer rank calls it with the same parameters.
    """
    assert norm_type == 2.0, "only the L2 norm"
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        if g is not None:  # insertion order = parameter order: the same on every rank
            groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    total_sq = None
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # partial norm -> reduced over its mesh; no grad flows (no_grad)
        sq = norm.float() ** 2
        total_sq = sq if total_sq is None else total_sq + sq
    total = total_sq.sqrt() if total_sq is not None else torch.zeros(())
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total
