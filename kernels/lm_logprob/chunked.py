"""Chunked pure-PyTorch LM-head logprob + entropy (the PRIME-RL-style middle baseline).

Logits exist for one chunk of tokens at a time, [chunk, V], in forward and again (recomputed) in
backward, so peak memory grows with chunk * V, not T * V. Matmuls run in the input dtype (bf16 logits
on GPU for bf16 inputs, as PRIME-RL does); softmax math is fp32.

Shape legend (docs/conventions.md): T tokens, D hidden size, V vocabulary size, C tokens in a chunk.
"""

import torch
from prime_spmd.kernels.lm_logprob.reference import grad_logits
from torch import Tensor

DEFAULT_CHUNK_TOKENS = 2048


class ChunkedLogprobs(torch.autograd.Function):
    """autograd.Function: (hidden [T, D], weight [V, D], targets [T], temperature [T] fp32) -> (logprob, entropy)."""

    @staticmethod
    def forward(ctx, hidden_TD, weight_VD, targets_T, temperature_T, chunk_tokens):
        num_tokens = hidden_TD.shape[0]
        logprob_T = torch.empty(num_tokens, device=hidden_TD.device, dtype=torch.float32)
        entropy_T = torch.empty_like(logprob_T)
        lse_T = torch.empty_like(logprob_T)
        for start in range(0, num_tokens, chunk_tokens):
            end = min(start + chunk_tokens, num_tokens)
            logits_CV = (hidden_TD[start:end] @ weight_VD.T).float() / temperature_T[start:end, None]
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            p_CV = torch.exp(logits_CV - lse_C[:, None])
            lse_T[start:end] = lse_C
            entropy_T[start:end] = lse_C - (p_CV * logits_CV).sum(-1)
            logprob_T[start:end] = logits_CV.gather(1, targets_T[start:end, None].long()).squeeze(1) - lse_C
        ctx.save_for_backward(hidden_TD, weight_VD, targets_T, temperature_T, lse_T, entropy_T)
        ctx.chunk_tokens = chunk_tokens
        ctx.mark_non_differentiable(lse_T)
        return logprob_T, entropy_T

    @staticmethod
    def backward(ctx, grad_logprob_T, grad_entropy_T):
        hidden_TD, weight_VD, targets_T, temperature_T, lse_T, entropy_T = ctx.saved_tensors
        grad_hidden_TD = torch.empty_like(hidden_TD)
        grad_weight_VD = torch.zeros(weight_VD.shape, device=weight_VD.device, dtype=torch.float32)
        for start in range(0, hidden_TD.shape[0], ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, hidden_TD.shape[0])
            temp_C = temperature_T[start:end, None]
            logits_CV = (hidden_TD[start:end] @ weight_VD.T).float() / temp_C
            grad_CV = grad_logits(
                logits_CV,
                lse_T[start:end],
                entropy_T[start:end],
                targets_T[start:end],
                None if grad_logprob_T is None else grad_logprob_T[start:end],
                None if grad_entropy_T is None else grad_entropy_T[start:end],
            )
            # d z / d raw logits = 1 / T; the matmuls then run in the input dtype.
            grad_CV = (grad_CV / temp_C).to(hidden_TD.dtype)
            grad_hidden_TD[start:end] = grad_CV @ weight_VD
            grad_weight_VD += (grad_CV.T @ hidden_TD[start:end]).float()
        return grad_hidden_TD, grad_weight_VD.to(weight_VD.dtype), None, None, None


def chunked_logprobs(
    hidden_TD: Tensor,
    weight_VD: Tensor,
    targets_T: Tensor,
    temperature_T: Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[Tensor, Tensor]:
    """fp32 [T] logprob of targets and entropy, chunked over tokens; differentiable in hidden and weight."""
    return ChunkedLogprobs.apply(hidden_TD, weight_VD, targets_T, temperature_T, chunk_tokens)
