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
from prime_spmd.models.exact import SharedRows, check_exact_model, forward_hidden
from prime_spmd.trainer.packing import _doc_bounds, _first_trained, row_layout

POSITIONS_ERROR = "--model.exact: every document must start at position 0 and count up by one"


def check_trainer_model(lm: nn.Module) -> None:
    """ValueError naming --model.exact unless ``lm`` is our dense Qwen3 (``--model.impl custom``), whose blocks run
    the exact layer (``Block.forward`` on an ``ExactContext``)."""
    from prime_spmd.models.qwen3.model import Qwen3ForCausalLM

    if not isinstance(lm, Qwen3ForCausalLM):
        raise ValueError(f"--model.exact trains our Qwen3 code: set --model.impl custom (got {type(lm).__name__})")
    check_exact_model(lm)


def _share_plan(
    input_ids_1P: torch.Tensor, position_ids_1P: torch.Tensor, loss_mask_P: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, SharedRows, torch.Tensor, int] | None:
    """Prompt sharing for a packed row whose documents run from position 0: (flat ids [1, N], positions [1, N],
    ``SharedRows``, index [P] of each packed token's hidden state in the flat row, packed tokens not run), or None
    when no two documents share the tokens before their first trained one, or the padded rows would not be fewer
    tokens than the unshared path's (one row a document, padded to the longest); ValueError when a document does not
    start at position 0. A document's prefix is its tokens before its first trained token; documents with equal
    prefixes form a group whose prefix runs once (``models/exact.py``, ``SharedRows``)."""
    ids, pos = input_ids_1P[0].tolist(), position_ids_1P[0].tolist()
    trained = loss_mask_P.bool().tolist()
    docs = _doc_bounds(pos)
    if any(pos[a] != 0 for a, _ in docs):  # documents count up by one from their start (_doc_bounds)
        raise ValueError(POSITIONS_ERROR)
    groups: dict[tuple[int, ...], int] = {}
    doc_group, prefix_len = [], []
    for a, b in docs:
        f = _first_trained(trained, a, b)
        key = tuple(ids[a : a + (b - a if f is None else f)])
        doc_group.append(groups.setdefault(key, len(groups)))
        prefix_len.append(len(key))
    if len(groups) == len(docs):
        return None
    G, S = len(groups), len(docs)
    pw = max(len(k) for k in groups)
    sw = max(1, max(b - a - p for (a, b), p in zip(docs, prefix_len)))
    n_pre = G * pw
    if n_pre + S * sw >= S * max(b - a for a, b in docs):  # the unshared rows: every document padded to the longest
        return None
    flat_ids, flat_pos = [0] * (n_pre + S * sw), [0] * (n_pre + S * sw)
    for key, g in groups.items():
        flat_ids[g * pw : g * pw + len(key)] = key
        flat_pos[g * pw : (g + 1) * pw] = range(pw)
    index = []
    for s, ((a, b), g, p) in enumerate(zip(docs, doc_group, prefix_len)):
        o = n_pre + s * sw
        flat_ids[o : o + b - a - p] = ids[a + p : b]
        flat_pos[o : o + sw] = range(p, p + sw)
        index += [g * pw + t if t < p else o + t - p for t in range(b - a)]
    dev = input_ids_1P.device
    shared = SharedRows(
        num_groups=G, prefix_len=pw, num_suffixes=S, suffix_len=sw,
        group_S=torch.tensor(doc_group, device=dev), start_S=torch.tensor(prefix_len, device=dev),
    )  # fmt: skip
    tokens_run = sum(len(k) for k in groups) + sum(b - a - p for (a, b), p in zip(docs, prefix_len))
    return (
        torch.tensor([flat_ids], device=dev),
        torch.tensor([flat_pos], device=dev),
        shared,
        torch.tensor(index, device=dev),
        len(ids) - tokens_run,
    )


def exact_hidden(
    lm: nn.Module, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, loss_mask_T: torch.Tensor | None = None
) -> tuple[torch.Tensor, ModelOutput, int]:
    """``PolicyModel.hidden`` in exact mode: (hidden [B*T, D] in input order, the output, packed tokens not run). A
    packed row ([1, P]) is unpacked into one row per document, or, given ``loss_mask_T`` (prompt sharing), into the
    rows of ``_share_plan`` when documents share a prompt; every document must run positions 0, 1, 2, ...
    (ValueError otherwise: the engine's positions start at 0)."""
    if loss_mask_T is not None and input_ids_BT.shape[0] == 1:
        plan = _share_plan(input_ids_BT, position_ids_BT, loss_mask_T)
        if plan is not None:
            ids_1N, pos_1N, shared, index_P, not_run = plan
            hidden_1ND = forward_hidden(lm, ids_1N, pos_1N, shared)
            return hidden_1ND[0][index_P], ModelOutput(hidden_1ND), not_run
    layout = row_layout(position_ids_BT, max_pad_factor=math.inf) if input_ids_BT.shape[0] == 1 else None
    ids, pos = (
        (input_ids_BT, position_ids_BT) if layout is None else (layout.to_rows(input_ids_BT), layout.position_ids_ST)
    )
    if not torch.equal(pos, torch.arange(pos.shape[1], device=pos.device).expand_as(pos)):
        raise ValueError(POSITIONS_ERROR)
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
