"""Hidden states, LM-head weight and transformer blocks of a causal LM, for both impls (HF and ours).

The trainer computes logprobs from final hidden states with a fused LM-head kernel, so it never
asks a model for [tokens, vocab] logits; these helpers hide where each impl keeps those pieces.
"""

from __future__ import annotations

import torch
from torch import nn


def forward_hidden(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Final-norm hidden states [B, T, D]. HF models detect packed documents from ``position_ids``
    (with no attention mask) the same way ours do."""
    if hasattr(model, "forward_hidden"):
        return model.forward_hidden(input_ids, position_ids)
    out = model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    """The LM-head weight [V, D] (the embedding when tied)."""
    if hasattr(model, "lm_head_weight"):
        return model.lm_head_weight()
    return model.get_output_embeddings().weight


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, in order (what FSDP2 shards one by one before the root)."""
    if hasattr(model, "blocks"):
        return model.blocks()
    return list(model.model.layers)
