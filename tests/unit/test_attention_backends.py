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
