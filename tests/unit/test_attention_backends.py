"""attention(): SDPA never runs on cuDNN (a plan build per new shape: RL micro-batches change shape every
step), and the masked and causal paths give the math backend's values. Meaningful on CUDA
(scripts/test_gpu.sh runs this file there); on CPU it checks the values and that the calls run."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from prime_spmd.models.common.attention import AttnContext, attention


def _reference(q, k, v, mask):
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    return out.transpose(1, 2)


def test_attention_avoids_cudnn_and_matches_math(device: torch.device) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    for B, T in ((3, 40), (5, 72)):  # two shapes, as two RL steps
        q = torch.randn(B, T, 8, 64, device=device, dtype=dtype, generator=g, requires_grad=True)
        k = torch.randn(B, T, 2, 64, device=device, dtype=dtype, generator=g, requires_grad=True)
        v = torch.randn(B, T, 2, 64, device=device, dtype=dtype, generator=g, requires_grad=True)
        mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        mask[T // 2 :, : T // 4] = False  # a shared-prompt-like pattern: some queries skip an early block
        for ctx in (AttnContext(), AttnContext(mask_B1TT=mask[None, None].expand(B, 1, T, T))):
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                out = attention(q, k, v, ctx)
                out.float().square().sum().backward()
            names = {e.key for e in prof.key_averages()}
            assert not any("cudnn" in n.lower() and "attention" in n.lower() for n in names), sorted(names)
            ref = _reference(q.detach(), k.detach(), v.detach(), None if ctx.mask_B1TT is None else ctx.mask_B1TT)
            tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.float(), ref, **tol)
            q.grad = k.grad = v.grad = None


def test_additive_mask_is_built_once_and_gives_the_bool_masks_values() -> None:
    """build_attn_context hands every layer one additive mask (0 / -inf in the compute dtype, rows strided to a
    multiple of MASK_ALIGN): the same outputs and gradients, bit for bit, as the bool mask, and the backward keeps one
    mask, not one per layer (SDPA converts a bool mask in every call and saves each copy). Built for the g query heads
    of a key/value head (rows repeated g times), the heads fold into the query length: the same outputs bit for bit,
    gradients within rounding (dk, dv sum the heads in another order), and no k/v expanded to every head is kept."""
    from prime_spmd.models.common.attention import MASK_ALIGN, build_attn_context

    B, T, N, Nkv, Dh, L = 2, 37, 4, 2, 16, 6
    mask = torch.ones(B, T, T, dtype=torch.bool).tril()
    mask[:, 20:, 3:11] = False  # suffix rows skipping another sample's tokens, as a shared-prompt layout
    pos = torch.arange(T).expand(B, T)
    ctx = build_attn_context(pos, torch.float32, attn_mask_BTT=mask)
    m = ctx.mask_B1TT
    assert m.dtype == torch.float32 and m.shape == (B, 1, T, T) and m.stride(2) % MASK_ALIGN == 0
    assert torch.equal(m == 0, mask[:, None]) and bool((m[~mask[:, None]] == float("-inf")).all())
    folded = build_attn_context(pos, torch.float32, attn_mask_BTT=mask, query_groups=N // Nkv)
    assert folded.mask_B1TT.shape == (B, 1, 2 * T, T) and folded.mask_B1TT.stride(2) % MASK_ALIGN == 0
    assert torch.equal(folded.mask_B1TT[:, :, :T], m) and torch.equal(folded.mask_B1TT[:, :, T:], m)

    def run(c):
        x = torch.randn(B, T, N + 2 * Nkv, Dh, generator=torch.Generator().manual_seed(2), requires_grad=True)
        saved: dict[int, int] = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = x
            for _ in range(L):
                o = attention(h[:, :, :N], h[:, :, N : N + Nkv], h[:, :, N + Nkv :], c)
                h = torch.cat([o, o[:, :, : 2 * Nkv]], dim=2)
        h.square().sum().backward()
        return h.detach(), x.grad, sum(saved.values())

    out_f, grad_f, bytes_f = run(ctx)
    out_b, grad_b, bytes_b = run(AttnContext(mask_B1TT=mask[:, None]))
    out_g, grad_g, bytes_g = run(folded)
    assert torch.equal(out_f, out_b) and torch.equal(grad_f, grad_b)
    mask_bytes = B * T * T * 4
    assert bytes_b - bytes_f >= (L - 2) * mask_bytes  # a converted mask kept a layer, against one
    assert torch.equal(out_g, out_b)
    scale = grad_b.abs().max().item()
    torch.testing.assert_close(grad_g, grad_b, rtol=1e-4, atol=1e-5 * scale)
    # a layer: k and v at every query head no longer kept; the folded q copy kept instead of a view of h
    kv_expanded, q_copy = 2 * B * N * T * Dh * 4, B * N * T * Dh * 4
    assert bytes_f - bytes_g >= (L - 1) * (kv_expanded - q_copy) - mask_bytes  # the folded mask: g times the rows
