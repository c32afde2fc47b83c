"""The trainer's side of exact mode (``--model.exact``): the forward the engine runs, bit for bit (models/exact.py).

A packed row's documents become right-padded rows of one document each (``packing.row_layout``, whatever the padding
costs), each from position 0, as the engine's cache slots hold them; the hidden states go back to packed order and
the LM head's logprobs come from the kernels the engine's sampler reports with. Legend: B rows, T tokens, D hidden,
V vocab, P packed tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from prime_spmd.models.adapter import ModelOutput
from prime_spmd.models.exact import check_exact_model, forward_hidden
from prime_spmd.trainer.packing import row_layout


def check_trainer_model(lm: nn.Module) -> None:
    """ValueError naming --model.exact unless ``lm`` is our dense Qwen3 (``--model.impl custom``), whose blocks run
    the exact layer (``Block.forward`` on an ``ExactContext``)."""
    from prime_spmd.models.qwen3.model import Qwen3ForCausalLM

    if not isinstance(lm, Qwen3ForCausalLM):
        raise ValueError(f"--model.exact trains our Qwen3 code: set --model.impl custom (got {type(lm).__name__})")
    check_exact_model(lm)


def exact_hidden(
    lm: nn.Module, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor
) -> tuple[torch.Tensor, ModelOutput, int]:
    """``PolicyModel.hidden`` in exact mode: (hidden [B*T, D] in input order, the output, 0 shared tokens). A packed
    row ([1, P]) is unpacked into one row per document; every row must then run positions 0, 1, 2, ... (ValueError
    otherwise: the engine's positions start at 0)."""
    layout = row_layout(position_ids_BT, max_pad_factor=math.inf) if input_ids_BT.shape[0] == 1 else None
    ids, pos = (
        (input_ids_BT, position_ids_BT) if layout is None else (layout.to_rows(input_ids_BT), layout.position_ids_ST)
    )
    if not torch.equal(pos, torch.arange(pos.shape[1], device=pos.device).expand_as(pos)):
        raise ValueError("--model.exact: every document must start at position 0 and count up by one")
    hidden_BTD = forward_hidden(lm, ids)
    D = hidden_BTD.shape[-1]
    hidden_TD = hidden_BTD.reshape(-1, D) if layout is None else layout.from_rows(hidden_BTD)
    return hidden_TD, ModelOutput(hidden_BTD), 0


def exact_logprobs(
    hidden_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable fp32 (logprob, entropy) [T]: the engine's fp32 LM-head logits and log-softmax kernels."""
    from prime_spmd.kernels.batch_invariant.op import lm_head_logprobs

    return lm_head_logprobs(hidden_TD, weight_VD, targets_T, temperature)
