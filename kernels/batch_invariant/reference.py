"""Plain PyTorch spec of the batch-invariant ops (kernel.py): the math each kernel computes, not its reduction order
(so kernel and reference agree to rounding, and the kernel alone is batch-invariant), except the matmul's order of
K chunks (``linear_chunked_reference``), which its split and fused launches share. Runs on any device.

Legend: M rows, N output columns, K reduction dim; D normalized dim; B rows (sequences), Tq query tokens, Tk key
positions, N query heads, Nkv kv heads, Dh head dim; R rows of logits, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_reference(x_MK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None = None, out_dtype=None):
    """x @ w.T (+ b) in fp32, rounded once to ``out_dtype`` (default x's dtype)."""
    out = x_MK.float() @ w_NK.float().T
    if b_N is not None:
        out = out + b_N.float()
    return out.to(out_dtype or x_MK.dtype)


def linear_chunked_reference(
    x_MK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None = None, *, chunk_k: int, out_dtype=None
) -> torch.Tensor:
    """``linear_reference`` in the kernels' K order: fp32 partials over K chunks of ``chunk_k`` from 0 (the last may
    be partial), added in chunk order (((p0 + p1) + p2) + ...), + b, rounded once. Inside a chunk torch's own order
    (the kernel's: BLOCK_K steps from the chunk's start), so the two agree to fp32 rounding of a chunk's sum."""
    x32, w32 = x_MK.float(), w_NK.float()
    out = None
    for k0 in range(0, max(1, x_MK.shape[1]), chunk_k):
        part = x32[:, k0 : k0 + chunk_k] @ w32[:, k0 : k0 + chunk_k].T
        out = part if out is None else out + part
    if b_N is not None:
        out = out + b_N.float()
    return out.to(out_dtype or x_MK.dtype)


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: fp32 statistics, cast back to x's dtype, scaled by w in x's dtype."""
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (w.to(x.dtype) * y).to(x.dtype)


def silu_mul_reference(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``F.silu(g) * u`` in the inputs' dtype."""
    return F.silu(g) * u


def attention_reference(
    q_BTqNDh: torch.Tensor, k_BNkvTkDh: torch.Tensor, v_BNkvTkDh: torch.Tensor, start_B: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal GQA in fp32: query t of row b sits at position start_B[b] + t and attends keys [0, that position] of
    row b. Returns [B, Tq, N, Dh] in q's dtype."""
    B, Tq, N, Dh = q_BTqNDh.shape
    Nkv, Tk = k_BNkvTkDh.shape[1], k_BNkvTkDh.shape[2]
    g = N // Nkv
    q = q_BTqNDh.float().transpose(1, 2)  # [B, N, Tq, Dh]
    k = k_BNkvTkDh.float().repeat_interleave(g, dim=1)
    v = v_BNkvTkDh.float().repeat_interleave(g, dim=1)
    pos_BTq = start_B[:, None] + torch.arange(Tq, device=q.device)[None]
    visible = torch.arange(Tk, device=q.device)[None, None, :] <= pos_BTq[:, :, None]  # [B, Tq, Tk]
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).to(q_BTqNDh.dtype)


def logprob_reference(
    logits_RV: torch.Tensor, targets_R: torch.Tensor, temperature_R: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (log_softmax(logits / T)[target], entropy) per row."""
    logp = torch.log_softmax(logits_RV.float() / temperature_R.float()[:, None], dim=-1)
    return logp.gather(1, targets_R[:, None].long()).squeeze(1), -(logp.exp() * logp).sum(-1)
