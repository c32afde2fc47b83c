"""Chunked pure-PyTorch LM-head logprob + entropy (the PRIME-RL-style middle baseline).

Logits exist for one chunk of tokens at a time, [chunk, V], in forward and again (recomputed) in
backward, so peak memory grows with chunk * V, not N * V. Matmuls run in the input dtype (bf16 logits
on GPU for bf16 inputs, as PRIME-RL does); softmax math is fp32.

Shape legend: N tokens, H hidden size, V vocabulary size, C tokens in a chunk.
"""

import torch
from torch import Tensor

from kernels.lm_logprob.reference import grad_logits

DEFAULT_CHUNK_TOKENS = 2048


class ChunkedLogprobs(torch.autograd.Function):
    """autograd.Function: (hidden [N, H], weight [V, H], targets [N], temperature [N] fp32) -> (logprob, entropy)."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, temperature_N, chunk_tokens):
        num_tokens = hidden_NH.shape[0]
        logprob_N = torch.empty(num_tokens, device=hidden_NH.device, dtype=torch.float32)
        entropy_N = torch.empty_like(logprob_N)
        lse_N = torch.empty_like(logprob_N)
        for start in range(0, num_tokens, chunk_tokens):
            end = min(start + chunk_tokens, num_tokens)
            logits_CV = (hidden_NH[start:end] @ weight_VH.T).float() / temperature_N[start:end, None]
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            p_CV = torch.exp(logits_CV - lse_C[:, None])
            lse_N[start:end] = lse_C
            entropy_N[start:end] = lse_C - (p_CV * logits_CV).sum(-1)
            logprob_N[start:end] = logits_CV.gather(1, targets_N[start:end, None].long()).squeeze(1) - lse_C
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, temperature_N, lse_N, entropy_N)
        ctx.chunk_tokens = chunk_tokens
        ctx.mark_non_differentiable(lse_N)
        return logprob_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprob_N, grad_entropy_N):
        hidden_NH, weight_VH, targets_N, temperature_N, lse_N, entropy_N = ctx.saved_tensors
        grad_hidden_NH = torch.empty_like(hidden_NH)
        grad_weight_VH = torch.zeros(weight_VH.shape, device=weight_VH.device, dtype=torch.float32)
        for start in range(0, hidden_NH.shape[0], ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, hidden_NH.shape[0])
            temp_C = temperature_N[start:end, None]
            logits_CV = (hidden_NH[start:end] @ weight_VH.T).float() / temp_C
            grad_CV = grad_logits(
                logits_CV,
                lse_N[start:end],
                entropy_N[start:end],
                targets_N[start:end],
                None if grad_logprob_N is None else grad_logprob_N[start:end],
                None if grad_entropy_N is None else grad_entropy_N[start:end],
            )
            # d z / d raw logits = 1 / T; the matmuls then run in the input dtype.
            grad_CV = (grad_CV / temp_C).to(hidden_NH.dtype)
            grad_hidden_NH[start:end] = grad_CV @ weight_VH
            grad_weight_VH += (grad_CV.T @ hidden_NH[start:end]).float()
        return grad_hidden_NH, grad_weight_VH.to(weight_VH.dtype), None, None, None


def chunked_logprobs(
    hidden_NH: Tensor,
    weight_VH: Tensor,
    targets_N: Tensor,
    temperature_N: Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[Tensor, Tensor]:
    """fp32 [N] logprob of targets and entropy, chunked over tokens; differentiable in hidden and weight."""
    return ChunkedLogprobs.apply(hidden_NH, weight_VH, targets_N, temperature_N, chunk_tokens)
