"""The trainer's model: a causal LM plus the per-token logprob/entropy head, as one FSDP root.

Wrapping the LM keeps the LM-head weight inside the root module's forward, so FSDP2 gathers it
before the fused logprob computation reads it (calling the decoder directly would bypass the
root's hooks). Legend: L = packed tokens, H = hidden size, V = vocabulary.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn


def decoder_layer_lists(lm: nn.Module) -> list[nn.ModuleList]:
    """The ModuleLists holding the transformer blocks (HF ``model.layers`` or our ``layers``)."""
    for path in ("model.layers", "layers", "transformer.h", "gpt_neox.layers"):
        obj = lm
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return [obj]
    raise ValueError(f"cannot find the transformer blocks of {type(lm).__name__} (looked for model.layers, layers)")


def lm_head_weight(lm: nn.Module) -> torch.Tensor:
    if hasattr(lm, "lm_head_weight"):
        return lm.lm_head_weight()
    head = lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(lm).__name__} has no output embeddings (LM head)")
    return head.weight


def forward_hidden(lm: nn.Module, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor) -> torch.Tensor:
    """Final hidden states [B, T, H] (after the final norm), without computing logits."""
    if hasattr(lm, "forward_hidden"):
        return lm.forward_hidden(input_ids_BT, position_ids_BT)
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
    out = decoder(input_ids=input_ids_BT, position_ids=position_ids_BT, use_cache=False)
    return out.last_hidden_state


def reference_logprobs(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(h W^T / T)[target] and the entropy, fp32, materializing [N, V] logits."""
    logits_NV = (hidden_NH.float() @ weight_VH.float().t()) / temperature
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    lp_N = logp_NV.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1)
    ent_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return lp_N, ent_N


class PolicyModel(nn.Module):
    """``forward(input_ids [1, L], position_ids [1, L], targets [L], temperature)`` -> (logprob [L], entropy [L]) fp32.

    ``targets[t]`` is the token whose log-probability is read at position t (the next token of the
    same document; arbitrary where masked). Packed documents are separated by position_ids resets.
    """

    def __init__(self, lm: nn.Module, loss_impl: Literal["reference", "chunked", "triton"] = "reference") -> None:
        super().__init__()
        self.lm = lm
        self.loss_impl = loss_impl

    def blocks(self) -> list[nn.Module]:
        return [b for layers in decoder_layer_lists(self.lm) for b in layers]

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor,
        targets_N: torch.Tensor,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_BTH = forward_hidden(self.lm, input_ids_BT, position_ids_BT)
        hidden_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
        weight_VH = lm_head_weight(self.lm)
        if self.loss_impl == "reference":
            lp, ent = reference_logprobs(hidden_NH, weight_VH, targets_N, temperature)
            return lp.clone(), ent  # a fresh tensor, not a view: FSDP2 hooks the outputs for the backward
        from kernels.lm_logprob.op import lm_head_logprobs

        lp, ent = lm_head_logprobs(
            hidden_NH, weight_VH, targets_N, temperature=temperature, impl=self.loss_impl, return_entropy=True
        )
        return lp, ent


def resolve_loss_impl(name: str, device: torch.device) -> Literal["reference", "chunked", "triton"]:
    if name == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return name  # type: ignore[return-value]
