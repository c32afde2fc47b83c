"""The trainer's model: a causal LM plus the per-token logprob/entropy head, as one FSDP root.

Wrapping the LM keeps the LM-head weight inside the root module's forward, so FSDP2 gathers it
before the fused logprob computation reads it (calling the decoder directly would bypass the
root's hooks). Legend (docs/conventions.md): B batch, T tokens (packed), D hidden, V vocab, E experts,
L layers, S rows.

MoE models: the router load-balance loss (``models/common/moe.py: load_balance_loss``, mean over MoE
layers) of each micro-batch is added to its loss sum as ``coef * trained_tokens * aux``, i.e. every
trained token carries its micro-batch's aux value; after the step's division by the global number
of trained tokens the objective is ``main loss + coef * (token-weighted mean of aux over the step's
micro-batches)``. Micro-batches without trained tokens (packing's dummies) weigh 0, and the
objective does not depend on how micro-batches are dealt to ranks. Our model code always has it;
transformers models only for ``qwen3_moe`` (router logits through ``output_router_logits``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import nn

from prime_spmd.log import logger
from prime_spmd.models.adapter import ModelAdapter, ModelOutput
from prime_spmd.models.hf_adapter import HF_ROUTER_AUX_TYPES
from prime_spmd.models.registry import adapter_for
from prime_spmd.trainer.exact import check_trainer_model, exact_hidden, exact_logprobs
from prime_spmd.trainer.loss import TokenLoss
from prime_spmd.trainer.packing import ShareLayout, fill_layout, row_layout, share_layout

COMPILED_ROW_MULTIPLE = 8
"""With compiled blocks, every row the blocks run (a packed row, shared-prompt rows, RowLayout's one-document rows)
is padded to a multiple of this many tokens. Inductor on CUDA guards on the SDPA bias's strides being multiples of 8
(``torch/_inductor/lowering.py: sdpa_constraint``, ``ir.is_aligned_realized_tensor``: "guard to recompile when
necessary"), so with T tokens a row it compiled again the first time T % 8 changed class (torch 2.11, H100: 7-9 s;
/work/notes/recompile-log.md). The guard also stands on unmasked rows' T: SFT on the H100 (b30072c) hit dynamo's
recompile limit on ``x_BTD.size()[1] % 8`` while RowLayout rows were not padded. Padded, the guard holds for every
row. At most 7 pad tokens a row."""


FILL_TOKENS_RATIO = 0.8
"""``hidden`` runs a packed row's documents several to a row (``packing.fill_layout``, masked attention) where that
runs at most this fraction of the tokens one document a row (``RowLayout``, causal attention without a mask) would
run, or where RowLayout pads too much to be used (the packed row would attend under a [P, P] block mask). A guess
that favours the unmasked kernel; not yet timed on a GPU."""


class _ZeroLoss(TokenLoss):
    """0 x the logprobs: a loss whose backward runs every op of the forward and changes no gradient."""

    def token_loss(self, lp: torch.Tensor, ent: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        return lp * 0.0


def resolve_router_aux_coef(flag: float | None, adapter: ModelAdapter) -> float:
    """The load-balance loss coefficient: ``flag`` (--model.router_aux_loss_coef), or the model config's
    ``router_aux_loss_coef`` when None; 0.0 for dense models (an explicit flag > 0 there is ignored with
    a warning). Raises ``ValueError`` for a nonzero flag on an MoE we cannot compute it for."""
    if flag is not None and not (math.isfinite(flag) and flag >= 0):
        raise ValueError(f"--model.router_aux_loss_coef={flag!r} is invalid: must be a finite number >= 0")
    if adapter.dims().num_experts == 0:
        if flag:
            logger.warning(f"--model.router_aux_loss_coef={flag} ignored: the model has no MoE layers")
        return 0.0
    coef = adapter.config_router_aux_coef() if flag is None else float(flag)
    if coef > 0 and not adapter.has_router_aux():
        kind = adapter.model_type
        if flag is not None:
            raise ValueError(
                f"--model.router_aux_loss_coef={flag} is not supported for transformers model type {kind!r} "
                f"(supported: {', '.join(HF_ROUTER_AUX_TYPES)} and --model.impl custom); set it to 0"
            )
        logger.warning(f"router aux loss (config router_aux_loss_coef={coef}) not added for model type {kind!r}")
        return 0.0
    return coef


@dataclass(slots=True)
class RouterStats:
    """MoE routing of one micro-batch, detached: ``aux_loss`` (scalar fp32, mean load-balance loss over
    MoE layers, 1.0 at perfect balance) and ``tokens_per_expert_LE`` ([MoE layers, E] float counts)."""

    aux_loss: torch.Tensor
    tokens_per_expert_LE: torch.Tensor


class PolicyOutput(NamedTuple):
    """What ``PolicyModel.forward`` returns for one micro-batch of T packed tokens.

    A NamedTuple, not a dataclass: FSDP2 hooks the backward through the tensors it finds in the root's output,
    and torch 2.11's FSDP2 looks with ``tree_flatten``, to which a dataclass is one opaque leaf: no hook, no
    gradient reduction, and the optimizer's parameters never got a gradient (docs/log.md, 2026-12-06)."""

    loss_sum: torch.Tensor
    """The loss summed over tokens (scalar, with grad; MoE: the router term included)."""
    logprob_T: torch.Tensor
    """Per-token log-probability of the targets [T] fp32, detached."""
    entropy_T: torch.Tensor
    """Per-token entropy [T] fp32, detached."""
    router: RouterStats | None = None
    """The micro-batch's MoE routing (None for dense models)."""
    shared_tokens: int = 0
    """Packed tokens the forward did not run through the model (prompt copies that prompt sharing skipped)."""
    row_tokens: int = 0
    """Tokens the blocks ran, pads included: rows x row length of the layout ``hidden`` chose."""


class PolicyModel(nn.Module):
    """``forward(input_ids [1, L], position_ids [1, L], targets [L], temperature, loss, fields)`` -> ``PolicyOutput``
    (loss summed over tokens, logprob [L], entropy [L], router statistics, shared tokens).

    ``targets[t]`` is the token whose log-probability is read at position t (the next token of the
    same document; arbitrary where masked). Packed documents are separated by position_ids resets.
    ``loss`` is a ``TokenLoss``: a per-token function of (logprob, entropy, per-token fields).
    Computing it here, inside the root module's forward, lets the ``fused`` impl produce the
    gradients during the forward (3 GEMM passes, no [L, V] logits kept).

    MoE: the returned loss sum includes ``router_aux_coef * loss_mask.sum() * aux`` (module
    docstring); ``PolicyOutput.router`` holds the micro-batch's ``RouterStats`` (None for dense models).

    ``unpack_documents``: run a packed row's documents as right-padded rows of one document each
    (``packing.RowLayout``: causal attention without the O(L^2) block mask), or, where the adapter takes a mask
    and that runs at most ``FILL_TOKENS_RATIO`` of the tokens, several to a row of the longest document's length
    (``packing.fill_layout``: a block-diagonal causal mask [R, W, W]), then gather the hidden states back into
    packed order; the same per-token result up to rounding. Off for MoE models (pads would be routed and counted in
    the load-balance loss) and where attention is varlen already.

    ``share_prompts`` (where ``adapter.supports_prefix_sharing()``: our dense Qwen3): documents of a packed
    row that share their untrained prefix (a GRPO group's prompt) forward it once, with an explicit
    attention mask (``packing.ShareLayout``); the same per-token result up to rounding. Only ``forward``
    shares (it has the loss mask); a row without a share group goes the unpacked or packed way above.

    ``exact`` (``--model.exact``): the forward and the logprobs run the engine's batch-invariant kernels
    (``trainer/exact.py``), bit-equal to the logprobs the native engine sampled with; the two options above are unused.

    ``compile_warmup`` (``--trainer.compile_warmup``): ``warm_up_compiled_blocks`` runs in the first step (off: never).
    """

    def __init__(
        self,
        lm: nn.Module,
        loss_impl: Literal["reference", "triton", "fused"] = "reference",
        router_aux_coef: float = 0.0,
        unpack_documents: bool = True,
        share_prompts: bool = True,
        exact: bool = False,
        compile_warmup: bool = True,
    ) -> None:
        super().__init__()
        self.lm = lm
        self.exact = exact
        if exact:
            check_trainer_model(lm)
        self.adapter = adapter_for(lm)
        self.loss_impl = loss_impl
        self.unpack_documents = unpack_documents and self.adapter.dims().num_experts == 0
        assert router_aux_coef == 0 or self.adapter.has_router_aux(), "resolve_router_aux_coef decides it"
        self.router_aux_coef = router_aux_coef
        self.share_prompts = share_prompts and self.adapter.supports_prefix_sharing()
        self._warmed_up = not compile_warmup  # --trainer.compile_warmup off: nothing to warm up

    def blocks_compiled(self) -> bool:
        """Whether a module's ``forward`` is a torch.compile'd function (``--trainer.compile``:
        ``distributed/fsdp.py: compile_block_forwards`` runs after this module is built)."""
        return any(hasattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable") for m in self.lm.modules())

    def warm_up_compiled_blocks(self, device: torch.device) -> bool:
        """Once, where the blocks are compiled: forward and backward a tiny row of each input kind a micro-batch can
        give the blocks, so that dynamo compiles every graph now, in the first step, instead of in whatever later
        step first meets a kind. Kinds: causal attention over one row (one document, a dummy micro-batch) or several
        (``RowLayout``), a packed row under a block mask (or varlen where flash-attn runs), shared-prompt rows under
        an explicit mask, one row or several (a batch of one row is its own graph: dynamo specializes sizes 0 and 1).
        The loss is 0 x the logprobs and the gradients are dropped after (set to None, as ``optimizer.zero_grad``
        does), so the step's gradients are unchanged. Returns whether it ran. Collective over the trainer role
        (FSDP2 gathers): every trainer rank calls it at the same point (``train_step``)."""
        if self._warmed_up:
            return False
        self._warmed_up = True
        if self.exact or not self.blocks_compiled():
            return False
        rows = [  # (token ids, positions, trained targets)
            ([1, 2, 3, 4, 5, 6, 7, 8], list(range(8)), [0] * 8),  # one document
            ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4] * 2, [0] * 10),  # 2 documents: RowLayout [2, 5]
            # 3 documents, too uneven for RowLayout: fill_layout's masked rows, or the packed row's block mask
            ([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 0, 0], [0] * 8),
        ]
        if self.share_prompts:
            rows += [
                ([1, 2, 3, 4, 1, 2, 5, 6], [0, 1, 2, 3] * 2, [0, 1, 1, 0] * 2),  # prompt [1, 2] shared: one row
                ([1, 2, 3, 4, 1, 2, 5, 6, 7, 8, 9, 10, 7, 8, 11, 12], [0, 1, 2, 3] * 4, [0, 1, 1, 0] * 4),  # 2 rows
            ]
        for ids, pos, trained in rows:
            out = self(
                torch.tensor([ids], device=device),
                torch.tensor([pos], device=device),
                torch.zeros(len(ids), dtype=torch.long, device=device),
                1.0,
                _ZeroLoss(),
                {"loss_mask": torch.tensor(trained, dtype=torch.float32, device=device)},
            )
            out.loss_sum.backward()
        for p in self.parameters():
            p.grad = None
        return True

    def hidden(
        self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, loss_mask_T: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ModelOutput, int]:
        """(final hidden states [B*T, D] in input order, the model's output as it ran (``ModelOutput``: router
        aux loss and tokens per expert), packed tokens it did not run (shared prompt copies)). One packed row
        ([1, L]) goes through ``ShareLayout`` when sharing prompts (needs ``loss_mask_T``, [L]: the target at t
        is trained) and a group shares one, else, when unpacking, through filled rows (``fill_layout``) or
        ``RowLayout``; ``exact``: ``exact_hidden``."""
        if self.exact:
            return exact_hidden(self.lm, input_ids_BT, position_ids_BT, loss_mask_T if self.share_prompts else None)
        multiple = COMPILED_ROW_MULTIPLE if self.blocks_compiled() else 1
        if self.share_prompts and loss_mask_T is not None and input_ids_BT.shape[0] == 1:
            shared = share_layout(input_ids_BT, position_ids_BT, loss_mask_T, row_multiple=multiple)
            if shared is not None:
                return self._forward_segments(shared)
        layout = None
        if self.unpack_documents and input_ids_BT.shape[0] == 1:
            layout = row_layout(position_ids_BT, row_multiple=multiple)
            # the most tokens filled rows may run; they run at least the packed row's: built only where they can win
            limit = math.inf if layout is None else FILL_TOKENS_RATIO * layout.num_rows * layout.row_len
            filled = (
                fill_layout(input_ids_BT, position_ids_BT, row_multiple=multiple)
                if self.adapter.supports_prefix_sharing() and limit >= input_ids_BT.shape[1]
                else None
            )
            if filled is not None and filled.input_ids_RW.numel() <= limit:
                return self._forward_segments(filled)
        if layout is None:
            B, P = input_ids_BT.shape
            pad = -P % multiple if B == 1 else 0
            if pad:  # pads continue the last document (no new one, attended by no real token), cut off after
                input_ids_BT = torch.cat([input_ids_BT, input_ids_BT.new_zeros(1, pad)], dim=1)
                last_pos = position_ids_BT[:, -1:]
                position_ids_BT = torch.cat(
                    [position_ids_BT, last_pos + torch.arange(1, pad + 1, device=last_pos.device)], 1
                )
            out = self.adapter.forward_hidden_routed(input_ids_BT, position_ids_BT)
            hidden_BTD = out.hidden_BTD[:, :P] if pad else out.hidden_BTD
            return hidden_BTD.reshape(-1, hidden_BTD.shape[-1]), out, 0
        out = self.adapter.forward_hidden_routed(layout.to_rows(input_ids_BT), layout.position_ids_ST)
        return layout.from_rows(out.hidden_BTD), out, 0

    def _forward_segments(self, seg: ShareLayout) -> tuple[torch.Tensor, ModelOutput, int]:
        """``hidden`` over the rows of a ``ShareLayout`` (shared prompts or filled rows) under its explicit mask."""
        out = self.adapter.forward_hidden_routed(seg.input_ids_RW, seg.position_ids_RW, seg.attn_mask_RWW)
        return seg.from_rows(out.hidden_BTD), out, seg.num_shared_tokens

    def logprobs(
        self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, targets_T: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable per-token (logprob, entropy) [L] fp32 (impls reference/triton)."""
        hidden_TD, _, _ = self.hidden(input_ids_BT, position_ids_BT)
        if self.exact:
            return exact_logprobs(hidden_TD, self.adapter.lm_head_weight(), targets_T, temperature)
        from prime_spmd.kernels.lm_logprob.op import lm_head_logprobs

        impl = "triton" if self.loss_impl == "fused" else self.loss_impl
        return lm_head_logprobs(hidden_TD, self.adapter.lm_head_weight(), targets_T, temperature=temperature, impl=impl)

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor,
        targets_T: torch.Tensor,
        temperature: float,
        loss: TokenLoss,
        fields: dict[str, torch.Tensor],
        vision: list | None = None,
    ) -> PolicyOutput:
        """``vision``: ``MicroBatch.vision`` of a row with images (the adapter's ``forward_hidden_vision``: the
        packed path, one encoder run per distinct prompt images)."""
        from prime_spmd.kernels.lm_logprob.op import fused_lm_head_loss, lm_head_logprobs

        if vision:
            hidden_BTD = self.adapter.forward_hidden_vision(input_ids_BT, position_ids_BT, vision)
            hidden_TD, out, shared_tokens = hidden_BTD.reshape(-1, hidden_BTD.shape[-1]), ModelOutput(hidden_BTD), 0
        else:
            hidden_TD, out, shared_tokens = self.hidden(input_ids_BT, position_ids_BT, fields.get("loss_mask"))
        weight_VD = self.adapter.lm_head_weight()
        if self.exact:  # the engine's LM-head and log-softmax kernels (--model.exact)
            lp, ent = exact_logprobs(hidden_TD, weight_VD, targets_T, temperature)
            loss_sum, lp, ent = loss.token_loss(lp, ent, fields).sum(), lp.detach(), ent.detach()
        elif self.loss_impl == "fused" and not loss.sequence_level:  # fused calls token_loss per chunk of tokens
            impl = "triton" if hidden_TD.is_cuda else "torch"
            loss_sum, lp, ent = fused_lm_head_loss(
                hidden_TD, weight_VD, targets_T, temperature, loss.token_loss, fields, impl=impl
            )
        else:
            impl = ("triton" if hidden_TD.is_cuda else "reference") if self.loss_impl == "fused" else self.loss_impl
            lp, ent = lm_head_logprobs(hidden_TD, weight_VD, targets_T, temperature=temperature, impl=impl)
            loss_sum, lp, ent = loss.token_loss(lp, ent, fields).sum(), lp.detach(), ent.detach()
        aux = out.aux_loss
        router = None if aux is None else RouterStats(aux.detach(), out.tokens_per_expert_LE)
        if aux is not None and self.router_aux_coef > 0:
            # inside the FSDP root's forward, so the router grads take the same hooks as the main loss's
            loss_sum = loss_sum + self.router_aux_coef * fields["loss_mask"].sum() * aux
        rows = out.hidden_BTD
        return PolicyOutput(loss_sum, lp, ent, router, shared_tokens, rows.shape[0] * rows.shape[1])


def resolve_loss_impl(name: str, device: torch.device) -> Literal["reference", "triton", "fused"]:
    """``auto``: the loss-fused Triton path on CUDA, the plain PyTorch reference on CPU."""
    if name == "auto":
        return "fused" if device.type == "cuda" else "reference"
    return name  # type: ignore[return-value]
