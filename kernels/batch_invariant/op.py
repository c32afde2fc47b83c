"""Entry points of the batch-invariant kernels (kernel.py), with autograd for the trainer.

Forward runs the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1); backward uses plain PyTorch on the saved
inputs (the norms' and the SiLU-gate's written out in fp32, compiled on CUDA), recomputing what it needs: only
forward values must be batch-invariant (exact mode compares the trainer's forward logprobs with the engine's).
Every function takes tensors of any leading shape where it says so.

Legend: see reference.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from prime_spmd.kernels.batch_invariant import kernel as K


def check_device(t: torch.Tensor) -> None:
    """ValueError unless the kernels can run on ``t``'s device (CUDA, or CPU under the Triton interpreter)."""
    if t.device.type != "cuda" and not K.INTERPRET:
        raise ValueError(
            f"--model.exact runs Triton kernels: on {t.device.type} set TRITON_INTERPRET=1 (CPU tests) or use CUDA"
        )


def _flags(dtype: torch.dtype) -> tuple[bool, bool]:
    """(UPCAST, IEEE): the interpreter multiplies bf16 in fp32; fp32 inputs multiply in full fp32 (no TF32)."""
    return K.INTERPRET and dtype != torch.float32, dtype == torch.float32


_BACKWARD_FNS: dict[object, object] = {}


def _backward_fn(fn, t: torch.Tensor):
    """``fn`` compiled (CUDA: the backward's elementwise math in a few fused kernels, shapes dynamic), else as is.
    Re-running the forward under autograd for these gradients cost ~130 eager launches a layer, which left the exact
    trainer's GPU idle 90% of a step (H100, 7ca65d2: docs/benchmarks.md "Exact mode")."""
    if t.device.type != "cuda":
        return fn
    if fn not in _BACKWARD_FNS:
        _BACKWARD_FNS[fn] = torch.compile(fn, dynamic=True)
    return _BACKWARD_FNS[fn]


def rms_norm_backward(x, w, grad, eps: float):
    """(d x, d w) of ``w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` over the last dim, in fp32, rounded to the
    inputs' dtypes: the gradient of ``rms_norm`` (and of the norm in ``rms_norm_rope``)."""
    x32, g32 = x.float(), grad.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    xhat = x32 * r
    gw = (g32 * xhat.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
    gxhat = g32 * w.float()
    gx = r * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
    return gx.to(x.dtype), gw.to(w.dtype)


def rms_norm_rope_backward(x, w, grad, eps: float, cos, sin):
    """(d x, d w) of ``rotate(rms_norm(x, w), cos, sin)`` for x [..., H, Dh], cos/sin [..., 1, Dh] (each token's rows):
    RoPE's transpose, then the norm's gradient. rotate(y) = y cos + [-y2, y1] sin, so
    d y = g cos + [s2, -s1] with s = g sin."""
    g32 = grad.float()
    s = g32 * sin.float()
    half = s.shape[-1] // 2
    gy = g32 * cos.float() + torch.cat((s[..., half:], -s[..., :half]), dim=-1)
    return rms_norm_backward(x, w, gy, eps)


def silu_mul_backward(g, u, grad):
    """(d g, d u) of ``F.silu(g) * u`` in fp32, rounded to the inputs' dtypes."""
    g32, u32, d32 = g.float(), u.float(), grad.float()
    sig = torch.sigmoid(g32)
    dg = d32 * u32 * sig * (1 + g32 * (1 - sig))
    return dg.to(g.dtype), (d32 * g32 * sig).to(u.dtype)


def _use_split(M: int, N: int, split: bool | None) -> bool:
    """Split-K (chunk partials + reduce kernel) or fused: split for launches of one M tile whose N tiles are few
    (kernel.MM_SPLIT_MAX_M, MM_SPLIT_MAX_N_TILES); ``split`` forces one (tests). The two give the same bits."""
    if split is not None:
        return split
    return M <= K.MM_SPLIT_MAX_M and triton_cdiv(N, K.MM_BLOCK_N) < K.MM_SPLIT_MAX_N_TILES


def _num_chunks(Kd: int) -> int:
    return max(1, triton_cdiv(Kd, K.MM_CHUNK_K))


def _mm_meta(dtype: torch.dtype, Kd: int, split: bool) -> dict:
    """The constexprs and launch options every matmul launch shares: one tile config, fused or split."""
    upcast, ieee = _flags(dtype)
    return dict(
        SPLIT=split, UPCAST=upcast, IEEE=ieee, EVEN_K=Kd % K.MM_BLOCK_K == 0, BLOCK_M=K.MM_BLOCK_M,
        BLOCK_N=K.MM_BLOCK_N, BLOCK_K=K.MM_BLOCK_K, CHUNK_K=K.MM_CHUNK_K, num_warps=K.MM_WARPS,
        num_stages=K.MM_STAGES,
    )  # fmt: skip


def _launch_linear(
    x_MK: torch.Tensor,
    w_NK: torch.Tensor,
    b_N: torch.Tensor | None,
    out_dtype,
    res_MN: torch.Tensor | None = None,
    split: bool | None = None,
) -> torch.Tensor:
    """out [M, N] (contiguous) = x @ w.T (+ b) (+ res) in ``out_dtype``: ``matmul_kernel`` fused, or split over K
    chunks into an fp32 workspace [S, M, N] then ``matmul_reduce_kernel`` (``_use_split``)."""
    M, Kd = x_MK.shape
    N = w_NK.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=x_MK.device)
    if M == 0:
        return out
    split = _use_split(M, N, split)
    S = _num_chunks(Kd) if split else 1
    work = torch.empty(S, M, N, dtype=torch.float32, device=x_MK.device) if split else out
    b = b_N if b_N is not None else x_MK
    res = res_MN if res_MN is not None else out
    K.matmul_kernel[(triton_cdiv(M, K.MM_BLOCK_M), triton_cdiv(N, K.MM_BLOCK_N), S)](
        x_MK, w_NK, b, res, out, work, M, N, Kd, x_MK.stride(0), x_MK.stride(1), w_NK.stride(0), w_NK.stride(1),
        res_MN.stride(0) if res_MN is not None else 0, out.stride(0), out.stride(1),
        HAS_BIAS=b_N is not None, HAS_RES=res_MN is not None, **_mm_meta(x_MK.dtype, Kd, split),
    )  # fmt: skip
    if split:
        K.matmul_reduce_kernel[(triton_cdiv(M * N, K.MM_REDUCE_BLOCK),)](
            work, b, res, out, out, out, M, N, 0, 0, S, res_MN.stride(0) if res_MN is not None else 0,
            NSEG=1, HAS_BIAS=b_N is not None, HAS_RES=res_MN is not None, BLOCK=K.MM_REDUCE_BLOCK,
        )  # fmt: skip
    return out


def _launch_segments(x_MK: torch.Tensor, ws_NK: tuple[torch.Tensor, ...], split: bool | None = None):
    """[x @ w.T for w in ws_NK] (2 or 3 weights, x's dtype, each [M, N_i] contiguous) in one
    ``matmul_segments_kernel`` launch, fused or split (then one ``matmul_reduce_kernel``), as ``_launch_linear``."""
    M, Kd = x_MK.shape
    outs = [torch.empty(M, w.shape[0], dtype=x_MK.dtype, device=x_MK.device) for w in ws_NK]
    if M == 0:
        return outs
    split = _use_split(M, sum(w.shape[0] for w in ws_NK), split)
    S = _num_chunks(Kd) if split else 1
    pad = (ws_NK + (ws_NK[0],) * 3)[:3]
    opad = (tuple(outs) + (outs[0],) * 3)[:3]
    ns = ([w.shape[0] for w in ws_NK] + [0])[:3]  # N2 = 0 for two segments: the workspace has N0 + N1 + N2 columns
    work = torch.empty(S, M, sum(ns), dtype=torch.float32, device=x_MK.device) if split else outs[0]
    tiles = sum(triton_cdiv(n, K.MM_BLOCK_N) for n in ns)
    K.matmul_segments_kernel[(triton_cdiv(M, K.MM_BLOCK_M), tiles, S)](
        x_MK, *pad, *opad, work, M, *ns, Kd, x_MK.stride(0), x_MK.stride(1), *(w.stride(0) for w in pad), 1,
        NSEG=len(ws_NK), **_mm_meta(x_MK.dtype, Kd, split),
    )  # fmt: skip
    if split:
        K.matmul_reduce_kernel[(triton_cdiv(M * sum(ns), K.MM_REDUCE_BLOCK),)](
            work, work, work, *opad, M, *ns, S, 0, NSEG=len(ws_NK), HAS_BIAS=False, HAS_RES=False,
            BLOCK=K.MM_REDUCE_BLOCK,
        )  # fmt: skip
    return outs


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, out_dtype, res):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        x_MK = x.reshape(-1, x.shape[-1])
        res_MN = None if res is None else res.reshape(-1, res.shape[-1]).contiguous()
        return _launch_linear(x_MK, w, b, out_dtype or x.dtype, res_MN).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        gx = (g.to(w.dtype) @ w).view(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.T.to(x.dtype) @ x.reshape(-1, x.shape[-1])).to(w.dtype) if ctx.needs_input_grad[1] else None
        gb = g.sum(0).to(w.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, grad if ctx.needs_input_grad[4] else None


class _LinearSegments(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *ws):
        ctx.save_for_backward(x, *ws)
        outs = _launch_segments(x.reshape(-1, x.shape[-1]), ws)
        return tuple(o.view(*x.shape[:-1], o.shape[1]) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *ws = ctx.saved_tensors
        x_MK = x.reshape(-1, x.shape[-1])
        gx, gws = None, []
        for i, (w, g) in enumerate(zip(ws, grads, strict=True)):
            g_MN = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[0]:
                part = g_MN.to(w.dtype) @ w
                gx = part if gx is None else gx + part
            gws.append((g_MN.T.to(x.dtype) @ x_MK).to(w.dtype) if ctx.needs_input_grad[1 + i] else None)
        return (None if gx is None else gx.view(x.shape).to(x.dtype)), *gws


def linear_segments(x: torch.Tensor, *ws_NK: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x, w) for w in ws_NK)`` (2 or 3 weights, no bias, x's dtype) in one launch: each output column
    is summed exactly as ``linear`` sums it (the same tile reduction), with more programs a launch (q/k/v, gate/up
    of a decode step). Weights [N_i, K] with contiguous rows."""
    check_device(x)
    if not 2 <= len(ws_NK) <= 3 or any(w.stride(1) != 1 for w in ws_NK):
        raise ValueError(
            f"linear_segments: 2 or 3 weights with contiguous rows, got {[tuple(w.stride()) for w in ws_NK]}"
        )
    return _LinearSegments.apply(x, *ws_NK)


def linear(
    x: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None = None, out_dtype=None, residual=None
) -> torch.Tensor:
    """``x @ w.T + b`` for x [..., K] -> [..., N] in ``out_dtype`` (default x's), fp32 accumulation; with
    ``residual`` (x's leading shape, [..., N]) ``residual + (x @ w.T + b)`` rounded as torch rounds it, in the same
    launch; batch-invariant."""
    check_device(x)
    return _Linear.apply(x, w_NK, b_N, out_dtype, residual)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        x_RD = x.reshape(-1, x.shape[-1])
        R, D = x_RD.shape
        out = torch.empty_like(x_RD)
        if R:
            block_d = max(16, _pow2(D))
            block_r = max(1, K.ROW_ELEMS // block_d)
            K.rms_norm_kernel[(triton_cdiv(R, block_r),)](
                x_RD, w, out, R, D, x_RD.stride(0), out.stride(0), eps, BLOCK_R=block_r, BLOCK_D=block_d
            )  # fmt: skip
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gx, gw = _backward_fn(rms_norm_backward, x)(x, w, grad, ctx.eps)
        return gx, gw, None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rms_norm(x: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm over the last dim of x [..., D] (contiguous last dim), in x's dtype; batch-invariant."""
    check_device(x)
    return _RMSNorm.apply(x.contiguous(), w_D, eps)


class _RMSNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps, cos_PDh, sin_PDh, pos_T):
        ctx.save_for_backward(x, w, cos_PDh, sin_PDh, pos_T)
        ctx.eps = eps
        H, D = x.shape[-2], x.shape[-1]
        x_RD = x.reshape(-1, D)
        R = x_RD.shape[0]
        out = torch.empty_like(x_RD)
        if R:
            block_d = max(16, _pow2(D))
            block_r = max(1, K.ROW_ELEMS // block_d)
            K.rms_norm_rope_kernel[(triton_cdiv(R, block_r),)](
                x_RD, w, cos_PDh, sin_PDh, pos_T.reshape(-1).contiguous(), out, R, H, D, x_RD.stride(0),
                out.stride(0), cos_PDh.stride(0), eps, BLOCK_R=block_r, BLOCK_D=block_d,
            )  # fmt: skip
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, w, cos_PDh, sin_PDh, pos_T = ctx.saved_tensors
        cos, sin = cos_PDh[pos_T][..., None, :], sin_PDh[pos_T][..., None, :]
        gx, gw = _backward_fn(rms_norm_rope_backward, x)(x, w, grad, ctx.eps, cos, sin)
        return gx, gw, None, None, None, None


def rms_norm_rope(
    x: torch.Tensor, w_Dh: torch.Tensor, eps: float, cos_PDh: torch.Tensor, sin_PDh: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """Qwen3's per-head q/k RMSNorm then RoPE, in one launch: x [..., H, Dh] (contiguous), the token at index i of
    ``pos`` (int64, x's leading shape) at position pos[i]; cos/sin tables [P, Dh] in x's dtype (row p: position p).
    Rounds as ``rotate(rms_norm(x), cos, sin)`` in torch; batch-invariant."""
    check_device(x)
    return _RMSNormRope.apply(x.contiguous(), w_Dh, eps, cos_PDh, sin_PDh, pos)


SILU_BLOCK_C = 256


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        g2, u2 = g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1])
        R, C = g2.shape
        out = torch.empty(R, C, dtype=g.dtype, device=g.device)
        if R:
            block_r = K.ROW_ELEMS // SILU_BLOCK_C
            grid = (triton_cdiv(R, block_r), triton_cdiv(C, SILU_BLOCK_C))
            K.silu_mul_kernel[grid](g2, u2, out, R, C, g2.stride(0), u2.stride(0), out.stride(0),
                                    BLOCK_R=block_r, BLOCK_C=SILU_BLOCK_C)  # fmt: skip
        return out.view(g.shape)

    @staticmethod
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        return _backward_fn(silu_mul_backward, g)(g, u, grad)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``F.silu(g) * u`` (SwiGLU's gate) for g, u [..., C] with a contiguous last dim; batch-invariant."""
    check_device(g)
    return _SiluMul.apply(g, u)


def _launch_attention(q, k, v, start_B, scale):
    B, Tq, N, Dh = q.shape
    Nkv = k.shape[1]
    G = N // Nkv
    out = torch.empty(B, Tq, N, Dh, dtype=q.dtype, device=q.device)
    upcast, ieee = _flags(q.dtype)
    grid = (B, Nkv, triton_cdiv(Tq, K.ATTN_BLOCK_T))
    K.attention_kernel[grid](
        q, k, v, out, start_B, B, Tq, G, Dh, scale, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        UPCAST=upcast, IEEE=ieee, BLOCK_T=K.ATTN_BLOCK_T, BLOCK_G=max(1, _pow2(G)), BLOCK_N=K.ATTN_BLOCK_N,
        BLOCK_D=max(16, _pow2(Dh)),
    )  # fmt: skip
    return out


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, start_B, scale, from_zero):
        ctx.save_for_backward(q, k, v, start_B)
        ctx.scale = scale
        ctx.from_zero = from_zero
        return _launch_attention(q, k, v, start_B, scale)

    @staticmethod
    def backward(ctx, grad):
        # torch's SDPA recomputes it for the gradient: plain causal attention for rows the caller says start at
        # position 0 with Tq == Tk (whole documents), else the mask "key j <= start + t" (suffix rows of exact mode's
        # prompt sharing). start_B is never read on the host: a read waits for the GPU, once a layer.
        q, k, v, start_B = ctx.saved_tensors
        Tq, Tk = q.shape[1], k.shape[2]
        causal = Tq == Tk and ctx.from_zero
        mask = None
        if not causal:
            qpos = start_B[:, None] + torch.arange(Tq, device=q.device)
            mask = (torch.arange(Tk, device=q.device)[None, None, :] <= qpos[:, :, None])[:, None]
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(
                qd.transpose(1, 2), kd, vd, attn_mask=mask, is_causal=causal, scale=ctx.scale, enable_gqa=True
            ).transpose(1, 2)
            gq, gk, gv = torch.autograd.grad(out, (qd, kd, vd), grad)
        return gq, gk, gv, None, None, None


def attention(
    q_BTqNDh: torch.Tensor,
    k_BNkvTkDh: torch.Tensor,
    v_BNkvTkDh: torch.Tensor,
    start_B: torch.Tensor,
    scale: float,
    from_zero: bool = False,
) -> torch.Tensor:
    """Causal GQA: query t of row b at position start_B[b] + t attends keys [0, position] of row b; k/v may be strided
    views (a KV cache's slots, or [B, Tk, Nkv, Dh] transposed). -> [B, Tq, N, Dh] in q's dtype; batch-invariant.
    The backward recomputes it with torch's SDPA: causal where ``from_zero`` (the caller knows every start is 0) and
    Tq == Tk, else masked to keys <= start + t (the same gradient, a slower SDPA)."""
    check_device(q_BTqNDh)
    return _Attention.apply(q_BTqNDh, k_BNkvTkDh, v_BNkvTkDh, start_B, scale, from_zero)


@torch.no_grad()
def logprobs(logits_RV: torch.Tensor, targets_R: torch.Tensor, temperature_R: torch.Tensor):
    """fp32 (log_softmax(logits / T)[target], entropy) [R] of fp32 logits [R, V] (contiguous last dim) at fp32
    temperatures [R] (> 0); batch-invariant: the vocab is walked in fixed chunks."""
    check_device(logits_RV)
    R, V = logits_RV.shape
    lp = torch.empty(R, dtype=torch.float32, device=logits_RV.device)
    ent = torch.empty_like(lp)
    if R:
        K.logprob_kernel[(R,)](
            logits_RV, temperature_R.float().contiguous(), targets_R.contiguous(), lp, ent, R, V, logits_RV.stride(0),
            BLOCK_V=K.LOGPROB_BLOCK_V,
        )  # fmt: skip
    return lp, ent


LM_HEAD_CHUNK_TOKENS = 2048
"""Tokens per chunk of ``lm_head_logprobs``: bounds its fp32 logits to 2048 x V (1.2 GiB at Qwen3's 151936 vocab)."""


class _LMHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TD, w_VD, targets_T, temperature_T):
        lps, ents, lses = [], [], []
        for i in range(0, hidden_TD.shape[0], LM_HEAD_CHUNK_TOKENS):
            sl = slice(i, i + LM_HEAD_CHUNK_TOKENS)
            logits = _launch_linear(hidden_TD[sl], w_VD, None, torch.float32)
            lp, ent = logprobs(logits, targets_T[sl], temperature_T[sl])
            lps.append(lp)
            ents.append(ent)
            lses.append(logits.gather(1, targets_T[sl, None].long()).squeeze(1) / temperature_T[sl] - lp)
        if not lps:
            empty = hidden_TD.new_zeros(0, dtype=torch.float32)
            return empty, empty.clone()
        lp, ent = torch.cat(lps), torch.cat(ents)
        ctx.save_for_backward(hidden_TD, w_VD, targets_T, temperature_T, torch.cat(lses), ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        # the trainer's LM-head backward kernel (kernels/lm_logprob; Triton, interpreted on the CPU): no [T, V] logits
        from prime_spmd.kernels.lm_logprob.op import lm_logprob_bwd

        hidden_TD, w_VD, targets_T, temperature_T, lse_T, ent_T = ctx.saved_tensors
        gh, gw = lm_logprob_bwd(
            g_lp.float().contiguous(), g_ent.float().contiguous(), hidden_TD.contiguous(), w_VD.contiguous(),
            targets_T.long().contiguous(), temperature_T, lse_T, ent_T,
        )  # fmt: skip
        return gh, gw, None, None


def lm_head_logprobs(
    hidden_TD: torch.Tensor, w_VD: torch.Tensor, targets_T: torch.Tensor, temperature: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable fp32 (logprob, entropy) [T] of ``targets`` under softmax(hidden @ w.T / temperature): the fp32
    logits of ``linear`` and the log-softmax of ``logprobs``, the same two kernels the engine samples with."""
    check_device(hidden_TD)
    T = hidden_TD.shape[0]
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.full((T,), float(temperature), dtype=torch.float32, device=hidden_TD.device)
    return _LMHeadLogprobs.apply(hidden_TD, w_VD, targets_T, temperature.float())
