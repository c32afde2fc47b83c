"""The one entry point the trainer calls: `lm_head_logprobs`, and the torch.library ops behind impl="triton".

Ops (namespace `prime_spmd`):
- `lm_logprob_fwd(hidden, weight, targets, temperature) -> (logprob, entropy, lse)`, fp32 [T] each;
  autograd registered: grads flow to hidden and weight from logprob and entropy (lse is not differentiable).
- `lm_logprob_bwd(grad_logprob?, grad_entropy?, hidden, weight, targets, temperature, lse, entropy)
  -> (grad_hidden, grad_weight)`.
Both have fake impls, so they trace under torch.compile without running Triton.

Shape legend (docs/conventions.md): T tokens, D hidden size, V vocabulary size.
"""

from typing import Literal

import torch
from prime_spmd.kernels.lm_logprob import kernel
from prime_spmd.kernels.lm_logprob.reference import reference_logprobs, temperature_per_token
from torch import Tensor


@torch.library.custom_op("prime_spmd::lm_logprob_fwd", mutates_args=())
def lm_logprob_fwd(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    return kernel.forward(hidden, weight, targets, temperature)


@lm_logprob_fwd.register_fake
def _(hidden, weight, targets, temperature):
    out = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    return out, torch.empty_like(out), torch.empty_like(out)


@torch.library.custom_op("prime_spmd::lm_logprob_bwd", mutates_args=())
def lm_logprob_bwd(
    grad_logprob: Tensor | None,
    grad_entropy: Tensor | None,
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: Tensor,
    lse: Tensor,
    entropy: Tensor,
) -> tuple[Tensor, Tensor]:
    return kernel.backward(grad_logprob, grad_entropy, hidden, weight, targets, temperature, lse, entropy)


@lm_logprob_bwd.register_fake
def _(grad_logprob, grad_entropy, hidden, weight, targets, temperature, lse, entropy):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, temperature = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, targets, temperature, lse, entropy)


def _backward(ctx, grad_logprob, grad_entropy, grad_lse):
    hidden, weight, targets, temperature, lse, entropy = ctx.saved_tensors
    if grad_logprob is not None:
        grad_logprob = grad_logprob.float().contiguous()
    if grad_entropy is not None:
        grad_entropy = grad_entropy.float().contiguous()
    grad_hidden, grad_weight = lm_logprob_bwd(
        grad_logprob, grad_entropy, hidden, weight, targets, temperature, lse, entropy
    )
    return grad_hidden, grad_weight, None, None


lm_logprob_fwd.register_autograd(_backward, setup_context=_setup_context)


def lm_head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float | Tensor = 1.0,
    impl: Literal["reference", "triton"] = "reference",
    return_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log p(target) and entropy of softmax(hidden @ weight.T / temperature).

    hidden [T, D] and weight [V, D] share a dtype (bf16 or fp32); targets [T] int in [0, V) (out of range is
    not checked: the result is undefined); temperature a float or a [T] tensor (no gradient). Returns fp32
    [T] logprob and fp32 [T] entropy (None when return_entropy is False). Differentiable in hidden and
    weight, through the entropy too, for every impl. Weight may be the tied embedding table.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [T, D] and weight [V, D], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must be shape [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    temperature_T = temperature_per_token(temperature, hidden.shape[0], hidden.device)
    if impl == "reference":
        logprob, entropy = reference_logprobs(hidden, weight, targets, temperature_T)
    elif impl == "triton":
        logprob, entropy, _ = lm_logprob_fwd(
            hidden.contiguous(), weight.contiguous(), targets.long().contiguous(), temperature_T
        )
    else:
        raise ValueError(f"impl must be 'reference' or 'triton', got {impl!r}")
    return logprob, (entropy if return_entropy else None)


from prime_spmd.kernels.lm_logprob.fused_loss import fused_lm_head_loss  # noqa: E402,F401  (the 3-pass loss-fused variant)
