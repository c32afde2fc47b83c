"""Plain PyTorch spec of the LM-head logprob + entropy op; materializes [T, V] fp32 logits.

Shape legend (docs/conventions.md): T tokens, D hidden size, V vocabulary size.
"""

import torch
from torch import Tensor


def temperature_per_token(temperature: float | Tensor, num_tokens: int, device: torch.device) -> Tensor:
    """Return temperature as a contiguous fp32 [T] tensor (no grad) from a scalar or a [T] tensor."""
    if isinstance(temperature, Tensor):
        if temperature.dim() == 0:
            temperature = temperature.expand(num_tokens)
        if temperature.shape != (num_tokens,):
            raise ValueError(f"temperature must be a scalar or shape [{num_tokens}], got {tuple(temperature.shape)}")
        return temperature.detach().to(device=device, dtype=torch.float32).contiguous()
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.full((num_tokens,), float(temperature), device=device, dtype=torch.float32)


def reference_logprobs(
    hidden_TD: Tensor, weight_VD: Tensor, targets_T: Tensor, temperature_T: Tensor
) -> tuple[Tensor, Tensor]:
    """log_softmax(hidden @ weight.T / T)[target] and the softmax entropy, both fp32 [T]; differentiable.

    Inputs are upcast to fp32 first, so bf16 inputs give exact fp32 products (the spec, not the fast path).
    """
    logits_TV = (hidden_TD.float() @ weight_VD.float().T) / temperature_T[:, None]
    logp_TV = torch.log_softmax(logits_TV, dim=-1)
    logprob_T = logp_TV.gather(1, targets_T[:, None].long()).squeeze(1)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    return logprob_T, entropy_T
