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


class PolicyModel(nn.Module):
    """``forward(input_ids [1, L], position_ids [1, L], targets [L], temperature, loss)`` ->
    (loss summed over tokens, logprob [L], entropy [L]); logprob/entropy fp32 and detached.

    ``targets[t]`` is the token whose log-probability is read at position t (the next token of the
    same document; arbitrary where masked). Packed documents are separated by position_ids resets.
    ``loss`` is a ``TokenLoss``: a per-token function of (logprob, entropy, per-token fields).
    Computing it here, inside the root module's forward, lets the ``fused`` impl produce the
    gradients during the forward (3 GEMM passes, no [L, V] logits kept).
    """

    def __init__(
        self, lm: nn.Module, loss_impl: Literal["reference", "chunked", "triton", "fused"] = "reference"
    ) -> None:
        super().__init__()
        self.lm = lm
        self.loss_impl = loss_impl

    def blocks(self) -> list[nn.Module]:
        return [b for layers in decoder_layer_lists(self.lm) for b in layers]

    def logprobs(
        self, input_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor, targets_N: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable per-token (logprob, entropy) [L] fp32 (impls reference/chunked/triton)."""
        hidden_BTH = forward_hidden(self.lm, input_ids_BT, position_ids_BT)
        hidden_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
        from kernels.lm_logprob.op import lm_head_logprobs

        impl = "triton" if self.loss_impl == "fused" else self.loss_impl
        return lm_head_logprobs(hidden_NH, lm_head_weight(self.lm), targets_N, temperature=temperature, impl=impl)

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor,
        targets_N: torch.Tensor,
        temperature: float,
        loss: TokenLoss,
        fields: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.loss_impl == "fused":
            from kernels.lm_logprob.op import fused_lm_head_loss

            hidden_BTH = forward_hidden(self.lm, input_ids_BT, position_ids_BT)
            hidden_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
            impl = "triton" if hidden_NH.is_cuda else "torch"
            return fused_lm_head_loss(
                hidden_NH, lm_head_weight(self.lm), targets_N, temperature, loss.token_loss, fields, impl=impl
            )
        lp, ent = self.logprobs(input_ids_BT, position_ids_BT, targets_N, temperature)
        return loss.token_loss(lp, ent, fields).sum(), lp.detach(), ent.detach()


class TokenLoss:
    """A loss that is a sum over tokens of ``token_loss(logprob, entropy, fields)``.

    ``fields`` holds per-token float tensors aligned with the targets, including ``loss_mask``
    (1.0 where the target is trained); ``token_loss`` must be elementwise over tokens and return 0
    where the mask is 0. ``stats`` returns summed, detached statistics of a micro-batch.
    """

    def token_loss(self, lp: torch.Tensor, ent: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def stats(self, lp: torch.Tensor, ent: torch.Tensor, fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {}


def resolve_loss_impl(name: str, device: torch.device) -> Literal["reference", "chunked", "triton", "fused"]:
    """``auto``: the loss-fused Triton path on CUDA, the plain PyTorch reference on CPU."""
    if name == "auto":
        return "fused" if device.type == "cuda" else "reference"
    return name  # type: ignore[return-value]
