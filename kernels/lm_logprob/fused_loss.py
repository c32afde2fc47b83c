"""Loss-fused LM head: sum over tokens of a per-token loss of (logprob, entropy), with gradients computed
during the forward, one chunk of tokens at a time (Liger's fused-linear-cross-entropy trick, generalized).

Per chunk of C tokens: logits [C, V] = h_C @ W^T (one GEMM, fp32 output), softmax stats of z = logits / T,
logprob and entropy, then g_lp = d loss / d lp and g_ent = d loss / d ent from autograd on the [C]-sized
per-token loss, then G = d loss / d logits [C, V] in the input dtype and two GEMMs: d h_C = G @ W and
d W += G^T @ h_C. That is 3 GEMM passes of 2 T D V FLOPs for forward + backward; the backward only scales the
saved gradients by the upstream scalar. `op.lm_head_logprobs` needs 4 (see README.md).

impl="torch": cuBLAS GEMMs + torch elementwise (runs on CPU). impl="triton": the elementwise part is two
Triton kernels (`fused_kernel.py`), GEMMs stay in cuBLAS.

Shape legend (docs/conventions.md): T tokens, D hidden size, V vocabulary size, C tokens in a chunk.
"""

import functools
import warnings
from collections.abc import Callable
from typing import Literal

import torch
import triton
from prime_spmd.kernels.lm_logprob import fused_kernel
from prime_spmd.kernels.lm_logprob.reference import temperature_per_token
from torch import Tensor

# the per-token loss, e.g. a bound prime_spmd.trainer.loss.TokenLoss.token_loss: (logprob, entropy, fields) -> [T]
TokenLossFn = Callable[[Tensor, Tensor, dict[str, Tensor]], Tensor]
# Cap on C * V per chunk. Extra memory per element of C * V: torch ~14 B (two fp32 [C, V] + G; 2**29 is
# 3456 tokens at V = 151936, ~7 GiB), triton 6 B (fp32 logits + bf16 G; 2**30 lets the default 4096-token
# chunk through at V = 151936, 3.5 GiB: measured 602 vs 594 TFLOP/s fwd+bwd on an H200 against 3456-token
# chunks, docs/benchmarks.md).
LOGITS_BUFFER_ELEMENTS = 2**29
TRITON_LOGITS_BUFFER_ELEMENTS = 2**30


def num_chunk_tokens(num_tokens: int, vocab: int, chunk_tokens: int, budget: int | None = None) -> int:
    """Tokens per chunk: at most chunk_tokens and budget // vocab, balanced over chunks, a multiple of 128
    when that fits (GEMM-friendly M)."""
    budget = LOGITS_BUFFER_ELEMENTS if budget is None else budget
    cap = max(1, min(chunk_tokens, budget // vocab, num_tokens))
    if cap >= 128:
        cap -= cap % 128
    chunk = triton.cdiv(num_tokens, triton.cdiv(num_tokens, cap))  # even chunks: no tiny ragged last one
    if chunk >= 128 and triton.cdiv(chunk, 128) * 128 <= cap:
        chunk = triton.cdiv(chunk, 128) * 128
    return chunk


@functools.cache
def _has_fp32_out_gemm(device: torch.device) -> bool:
    """Whether this torch has aten::mm.dtype (bf16 x bf16 -> fp32 output, CUDA, torch >= 2.8) on device."""
    a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
    try:
        torch.mm(a, a.T, out_dtype=torch.float32)  # the same transposed layout as the logits GEMM
    except (NotImplementedError, TypeError, RuntimeError) as err:
        warnings.warn(
            f"fused_lm_head_loss: no fp32-output bf16 GEMM on {device} ({err}); logits rounded to bf16", stacklevel=3
        )
        return False
    return True


def logits_fp32(hidden_CD: Tensor, weight_VD: Tensor) -> Tensor:
    """[C, V] fp32 logits, products accumulated in fp32 and not rounded to bf16 (unlike `chunked.py`)."""
    if hidden_CD.dtype == torch.float32:
        return hidden_CD @ weight_VD.T
    if hidden_CD.device.type != "cuda":
        return hidden_CD.float() @ weight_VD.float().T  # CPU: bf16 products are exact in fp32
    if _has_fp32_out_gemm(hidden_CD.device):
        return torch.mm(hidden_CD, weight_VD.T, out_dtype=torch.float32)
    return (hidden_CD @ weight_VD.T).float()


def token_loss_grads(
    token_loss: TokenLossFn, logprob_C: Tensor, entropy_C: Tensor, fields_C: dict[str, Tensor], need_grad: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(loss [C] fp32 detached, d loss / d lp or None, d loss / d ent or None); None where loss ignores it."""
    lp_C = logprob_C.detach().requires_grad_(need_grad)
    ent_C = entropy_C.detach().requires_grad_(need_grad)
    with torch.enable_grad():
        loss_C = token_loss(lp_C, ent_C, fields_C)
        if loss_C.shape != lp_C.shape:
            raise ValueError(f"token_loss must return a [{lp_C.shape[0]}] tensor, got {tuple(loss_C.shape)}")
        if not (need_grad and loss_C.requires_grad):
            return loss_C.detach().float(), None, None
        grad_lp, grad_ent = torch.autograd.grad(loss_C.sum(), (lp_C, ent_C), allow_unused=True)
    as_fp32 = lambda g: None if g is None else g.float().contiguous()  # noqa: E731
    return loss_C.detach().float(), as_fp32(grad_lp), as_fp32(grad_ent)


def _stats_torch(logits_CV: Tensor, temperature_C: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(z = logits / T in place of logits, lse, E_p[z]), all fp32."""
    z_CV = logits_CV.div_(temperature_C[:, None])
    lse_C = torch.logsumexp(z_CV, dim=-1)
    expected_z_C = (torch.exp(z_CV - lse_C[:, None]) * z_CV).sum(-1)
    return z_CV, lse_C, expected_z_C


def _grad_logits_torch(z_CV, targets_C, temperature_C, lse_C, expected_z_C, grad_lp_C, grad_ent_C, dtype) -> Tensor:
    """G = (g_lp (onehot - p) + g_ent p (E_p[z] - z)) / T in `dtype`; overwrites z_CV."""
    p_CV = torch.exp(z_CV - lse_C[:, None])
    if grad_ent_C is None:
        grad_CV = p_CV.mul_(-grad_lp_C[:, None])
    else:
        grad_CV = z_CV.neg_().add_(expected_z_C[:, None]).mul_(grad_ent_C[:, None])
        if grad_lp_C is not None:
            grad_CV.sub_(grad_lp_C[:, None])
        grad_CV.mul_(p_CV)
    if grad_lp_C is not None:
        grad_CV.scatter_add_(1, targets_C[:, None], grad_lp_C[:, None])
    return grad_CV.div_(temperature_C[:, None]).to(dtype)


def _run_chunks(hidden_TD, weight_VD, targets_T, temperature_T, token_loss, fields, chunk, impl, need_gh, need_gw):
    """The chunk loop: (loss_sum fp32 scalar, lp [T], ent [T], d hidden or None, d weight or None)."""
    num_tokens = hidden_TD.shape[0]
    alloc = fused_kernel.empty_buffer
    logprob_T = alloc((num_tokens,), hidden_TD, torch.float32)
    entropy_T = alloc((num_tokens,), hidden_TD, torch.float32)
    grad_hidden_TD = alloc(tuple(hidden_TD.shape), hidden_TD, hidden_TD.dtype) if need_gh else None
    grad_weight_VD = alloc(tuple(weight_VD.shape), weight_VD, weight_VD.dtype) if need_gw else None
    loss_sum = torch.zeros((), device=hidden_TD.device, dtype=torch.float32)
    if need_gw and num_tokens == 0:
        grad_weight_VD.zero_()
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        h_CD, tgt_C, temp_C = hidden_TD[start:end], targets_T[start:end], temperature_T[start:end]
        logits_CV, z_CV = logits_fp32(h_CD, weight_VD), None
        if impl == "triton":
            lse_C, expected_z_C = fused_kernel.softmax_stats(logits_CV, temp_C)
            z_target_C = logits_CV.gather(1, tgt_C[:, None]).squeeze(1) / temp_C
        else:
            z_CV, lse_C, expected_z_C = _stats_torch(logits_CV, temp_C)
            z_target_C = z_CV.gather(1, tgt_C[:, None]).squeeze(1)
        logprob_T[start:end] = z_target_C - lse_C
        entropy_T[start:end] = lse_C - expected_z_C
        fields_C = {k: v[start:end] for k, v in fields.items()}
        loss_C, g_lp, g_ent = token_loss_grads(
            token_loss, logprob_T[start:end], entropy_T[start:end], fields_C, need_gh or need_gw
        )
        loss_sum += loss_C.sum()
        if not (need_gh or need_gw):
            continue
        if g_lp is None and g_ent is None:  # the loss does not depend on this chunk's logits
            g_lp = torch.zeros_like(loss_C)
        if impl == "triton":
            grad_CV = alloc(tuple(logits_CV.shape), logits_CV, hidden_TD.dtype)
            fused_kernel.write_grad_logits(logits_CV, grad_CV, tgt_C, temp_C, lse_C, expected_z_C, g_lp, g_ent)
        else:
            grad_CV = _grad_logits_torch(z_CV, tgt_C, temp_C, lse_C, expected_z_C, g_lp, g_ent, hidden_TD.dtype)
        logits_CV = z_CV = None  # free the fp32 [C, V] buffers before the gradient GEMMs
        if need_gh:
            torch.mm(grad_CV, weight_VD, out=grad_hidden_TD[start:end])
        if need_gw and start == 0:
            torch.mm(grad_CV.T, h_CD, out=grad_weight_VD)
        elif need_gw:  # accumulates in the weight dtype: one rounding per chunk (see README)
            grad_weight_VD.addmm_(grad_CV.T, h_CD)
    return loss_sum, logprob_T, entropy_T, grad_hidden_TD, grad_weight_VD


class FusedLMHeadLoss(torch.autograd.Function):
    """(hidden, weight, targets, temperature_T, token_loss, fields, chunk, impl) -> (loss_sum, lp, ent).

    Gradients are computed in forward; backward scales them by the upstream scalar, in place, and releases
    them, so a second backward through the same graph (retain_graph) raises.
    """

    @staticmethod
    def forward(ctx, hidden_TD, weight_VD, targets_T, temperature_T, token_loss, fields, chunk, impl):
        need_gh, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss_sum, logprob_T, entropy_T, grad_hidden_TD, grad_weight_VD = _run_chunks(
            hidden_TD, weight_VD, targets_T, temperature_T, token_loss, fields, chunk, impl, need_gh, need_gw
        )
        ctx.grads = (grad_hidden_TD, grad_weight_VD)
        ctx.mark_non_differentiable(logprob_T, entropy_T)
        return loss_sum, logprob_T, entropy_T

    @staticmethod
    def backward(ctx, grad_loss, _grad_logprob, _grad_entropy):
        if ctx.grads is None:
            raise RuntimeError("fused_lm_head_loss: backward ran twice; its gradients were already released")
        grad_hidden_TD, grad_weight_VD = ctx.grads
        ctx.grads = None
        if grad_hidden_TD is not None:
            grad_hidden_TD.mul_(grad_loss)
        if grad_weight_VD is not None:
            grad_weight_VD.mul_(grad_loss)
        return grad_hidden_TD, grad_weight_VD, None, None, None, None, None, None


def fused_lm_head_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float | Tensor,
    token_loss: TokenLossFn,
    fields: dict[str, Tensor] | None = None,
    chunk_tokens: int = 4096,
    impl: Literal["torch", "triton"] = "torch",
    max_logits_elements: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """sum_t token_loss(lp, ent, fields)[t] of softmax(hidden @ weight.T / T), in 3 GEMM passes.

    hidden [T, D] and weight [V, D] share a dtype (bf16 or fp32; weight may be the tied embedding); targets
    [T] int in [0, V) (not checked); temperature a float or a [T] tensor (no gradient). token_loss maps
    (lp [C] fp32, ent [C] fp32, {name: field[start:end]}) to a [C] per-token loss; it is called once per
    chunk (chunks of at most chunk_tokens, fewer when C * V exceeds max_logits_elements, default
    LOGITS_BUFFER_ELEMENTS, TRITON_LOGITS_BUFFER_ELEMENTS for impl="triton"), must be
    elementwise over tokens, and is differentiated by autograd in lp and ent only: fields [T, ...] are
    constants (detached). Returns (loss_sum fp32 scalar, differentiable in hidden and weight; lp [T] fp32
    and ent [T] fp32, detached). Under torch.no_grad or when neither input requires grad it runs the
    forward GEMM only. Extra memory is bounded by the chunk, plus the d hidden and d weight it holds
    from forward to backward.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [T, D] and weight [V, D], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    num_tokens = hidden.shape[0]
    if targets.shape != (num_tokens,):
        raise ValueError(f"targets must be shape [{num_tokens}], got {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if impl not in ("torch", "triton"):
        raise ValueError(f"impl must be 'torch' or 'triton', got {impl!r}")
    if impl == "triton" and hidden.device.type != "cuda" and not fused_kernel.INTERPRET:
        raise ValueError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1); use impl='torch'")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    fields = {} if fields is None else fields
    for name, value in fields.items():
        if value.shape[:1] != (num_tokens,):
            raise ValueError(f"field {name!r} must have {num_tokens} rows, got shape {tuple(value.shape)}")
    fields = {name: value.detach() for name, value in fields.items()}
    temperature_T = temperature_per_token(temperature, num_tokens, hidden.device)
    if max_logits_elements is None and impl == "triton":
        max_logits_elements = TRITON_LOGITS_BUFFER_ELEMENTS
    chunk = num_chunk_tokens(num_tokens, weight.shape[0], chunk_tokens, max_logits_elements) if num_tokens else 1
    args = (hidden.contiguous(), weight.contiguous(), targets.long().contiguous(), temperature_T)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return FusedLMHeadLoss.apply(*args, token_loss, fields, chunk, impl)
    loss_sum, logprob_T, entropy_T, _, _ = _run_chunks(*args, token_loss, fields, chunk, impl, False, False)
    return loss_sum, logprob_T, entropy_T
