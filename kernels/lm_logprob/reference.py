"""Plain PyTorch spec of the LM-head logprob + entropy op; materializes [N, V] fp32 logits.

Shape legend: N tokens, H hidden size, V vocabulary size.
"""

import torch
from torch import Tensor


def temperature_per_token(temperature: float | Tensor, num_tokens: int, device: torch.device) -> Tensor:
    """Return temperature as a contiguous fp32 [N] tensor (no grad) from a scalar or an [N] tensor."""
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
    hidden_NH: Tensor, weight_VH: Tensor, targets_N: Tensor, temperature_N: Tensor
) -> tuple[Tensor, Tensor]:
    """log_softmax(hidden @ weight.T / T)[target] and the softmax entropy, both fp32 [N]; differentiable.

    Inputs are upcast to fp32 first, so bf16 inputs give exact fp32 products (the spec, not the fast path).
    """
    logits_NV = (hidden_NH.float() @ weight_VH.float().T) / temperature_N[:, None]
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    logprob_N = logp_NV.gather(1, targets_N[:, None].long()).squeeze(1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return logprob_N, entropy_N


def grad_logits(
    logits_NV: Tensor,
    lse_N: Tensor,
    entropy_N: Tensor,
    targets_N: Tensor,
    grad_logprob_N: Tensor | None,
    grad_entropy_N: Tensor | None,
) -> Tensor:
    """d loss / d z for z = logits / T (fp32), from saved logsumexp and entropy.

    With p = softmax(z) and S = sum_v p_v z_v = lse - entropy:
    d logprob / d z_v = 1[v = target] - p_v and d entropy / d z_v = p_v (S - z_v).
    """
    p_NV = torch.exp(logits_NV - lse_N[:, None])
    grad_NV = torch.zeros_like(logits_NV)
    if grad_logprob_N is not None:
        grad_NV -= grad_logprob_N[:, None] * p_NV
        grad_NV.scatter_add_(1, targets_N[:, None].long(), grad_logprob_N[:, None].float())
    if grad_entropy_N is not None:
        expected_N = lse_N - entropy_N
        grad_NV += grad_entropy_N[:, None] * p_NV * (expected_N[:, None] - logits_NV)
    return grad_NV
