"""Model runners: the forward passes the native engine schedules (prefill and decode).

A runner owns the KV cache and reads the model's own parameters at every call, so an in-place
weight update (``NativeEngine.load_weights``) is seen at once, also by captured CUDA graphs.

- ``LlamaStyleRunner``: HF Qwen3 / Qwen2 / Llama / Mistral style decoders (``model.model.layers[i]``
  with ``self_attn.{q,k,v,o}_proj``, optional ``q_norm``/``k_norm``, ``mlp``, two RMSNorms). We run
  attention against the slot KV cache ourselves and call the HF submodules for everything else.
- ``GenericRunner``: any HF causal LM, no KV cache: every decode step re-runs the whole sequence.
  Slow, but correct; it exists so that unsupported architectures still work.

Which runner and decode path a model gets, its shapes and its RoPE tables come from its adapter
(``models/adapter.py``): ``supports_slot_cache``, ``supports_fused_decode``, ``dims``, ``rope_tables``.

Legend (docs/conventions.md): B rows of a prefill or decode step (a decode step's rows are slots 0..B-1),
T prompt length, D hidden, N query heads, Nkv kv heads, G = N / Nkv, Dh head dim, V vocab, Bc cache slots,
Tc positions per slot; local letter of this file: Tkv the positions a decode step attends (``kv_len``, its
length bucket, Tkv <= Tc).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from prime_spmd.inference import exact as exact_mode
from prime_spmd.inference import quant
from prime_spmd.inference.kv_cache import KVCacheDtype, PagedKVCache, SlotKVCache, read_positions, write_token
from prime_spmd.models.common.norm import rms_norm
from prime_spmd.models.common.rope import rotate
from prime_spmd.models.registry import adapter_for

DecodeAttention = Literal["auto", "bmm", "triton", "triton_qkv"]
DecodeLinear = Literal["auto", "torch", "triton"]
KVCacheKind = Literal["slot", "paged"]
# Rows up to which the fused decode linears (kernels/decode_linear) replace F.linear: the norm-prologue ones
# (qkv, gate_up + SiLU-gate) up to DECODE_LINEAR_MAX_ROWS, the residual-epilogue ones (o, down) up to
# DECODE_LINEAR_MAX_ROWS_RESIDUAL. From the H200 sweep at the Qwen3-0.6B shape (docs/benchmarks.md): at 64 rows
# cuBLAS beat the kernel on qkv / gate_up (7.0 / 9.3 us vs 10.6 / 13.0 at the best tiles) while the kernel
# beat it on o / down (6.0 / 7.6 vs 7.1 / 9.4 us, residual add included).
DECODE_LINEAR_MAX_ROWS = 16
DECODE_LINEAR_MAX_ROWS_RESIDUAL = 64


def resolve_decode_attention(attention: str, device: torch.device) -> str:
    """The decode attention to run on ``device``: "auto" is "triton_qkv" on CUDA (the decode layer function's; the runner
    takes "triton" where that layer does not apply) and "bmm" elsewhere (Triton on CPU runs only under the
    interpreter). On an H200 at the Qwen3-0.6B shape (docs/benchmarks.md, 2026-12-05) triton_qkv beat triton at batch
    1 / 16 / 64 / 256 (815 vs 750, 11.3k vs 11.1k, 32.9k vs 29.3k, 56.7k vs 56.6k tok/s, sampler triton_lm_head) and triton
    beat bmm (2026-12-04). "bmm", "triton" and "triton_qkv" (the Triton kernel with the q/k norm, RoPE and the new token's
    cache write folded in) are kept. ValueError for any other name."""
    if attention not in ("auto", "bmm", "triton", "triton_qkv"):
        raise ValueError(f"decode attention {attention!r}: choose auto, bmm, triton or triton_qkv")
    if attention == "auto":
        return "triton_qkv" if device.type == "cuda" else "bmm"
    return attention


# "auto" takes the fused decode linears on CUDA up to this hidden size: on an H200 (docs/benchmarks.md,
# 2026-12-04) they were faster at the Qwen3-0.6B shape (hidden 1024: batch 1 671 vs 549 tok/s, batch 64 29.5k vs
# 28.8k) and slower at the Qwen3-8B shape (hidden 4096: batch 1 177 vs 187, batch 64 8.7k vs 9.4k); sizes in
# between are not measured.
DECODE_LINEAR_AUTO_MAX_HIDDEN = 1024


def resolve_decode_linear(linear: str, device: torch.device, hidden_size: int) -> str:
    """The fused decode path's linears on ``device``: "triton" (kernels/decode_linear: RMSNorm, bias,
    SiLU-gate and residual folded into the GEMM, for steps within the row bounds above) or "torch"
    (F.linear and separate elementwise ops). "auto" is "triton" on CUDA for models of hidden size <=
    ``DECODE_LINEAR_AUTO_MAX_HIDDEN`` and "torch" otherwise (Triton on CPU runs only under the
    interpreter). ValueError for any other name."""
    if linear not in ("auto", "torch", "triton"):
        raise ValueError(f"decode linear {linear!r}: choose auto, torch or triton")
    if linear == "auto":
        return "triton" if device.type == "cuda" and hidden_size <= DECODE_LINEAR_AUTO_MAX_HIDDEN else "torch"
    return linear


_OUT_DTYPE_OK: dict[str, bool] = {}


def fp32_out_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with fp32 accumulation and output (``torch.mm(out_dtype=)`` where supported, else upcast)."""
    key = x.device.type
    if key not in _OUT_DTYPE_OK:
        try:  # probe once per device type: older torch builds lack out_dtype for this GEMM
            torch.mm(x[:1].reshape(1, -1), w[:1].T, out_dtype=torch.float32)
            _OUT_DTYPE_OK[key] = True
        except (TypeError, RuntimeError):
            _OUT_DTYPE_OK[key] = False
    x2 = x.reshape(-1, x.shape[-1])
    if _OUT_DTYPE_OK[key]:
        out = torch.mm(x2, w.T, out_dtype=torch.float32)
    else:
        out = F.linear(x2.float(), w.float())
    return out.reshape(*x.shape[:-1], w.shape[0])


PREFILL_CHOICES = {"auto": None, "layer_fn": True, "modules": False}
"""``--inference.native.prefill`` (and the benchmarks' ``--prefill``) -> the runner's ``prefill_layer_fn`` argument."""


def prefill_choice(name: str) -> bool | None:
    """``PREFILL_CHOICES[name]``, or ValueError naming the bad value."""
    if name not in PREFILL_CHOICES:
        raise ValueError(f"prefill {name!r}: choose one of {sorted(PREFILL_CHOICES)}")
    return PREFILL_CHOICES[name]


def compile_exact(fn, **kwargs):
    """``torch.compile(fn)`` that rounds where the code casts: inductor otherwise keeps a fused kernel's intermediates
    in fp32 across explicit ``.to(bf16)`` casts (``emulate_precision_casts`` is off by default), so a compiled RMSNorm
    (``rms_norm``: fp32 statistics, cast back, then scale) differs from HF's eager one in ~1 of 4 bf16 outputs by an
    ulp (CPU, 2026-12-05) and the engine's logprobs drift from the trainer's. With it they are bit-equal."""
    return torch.compile(fn, options={"emulate_precision_casts": True}, **kwargs)


def make_decode_layer(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    scale: float,
    attention: DecodeAttention = "bmm",
    linear: DecodeLinear = "torch",
):
    """One decoder layer of a decode step as a pure function of tensors (``torch.compile`` fuses it).

    Args per call: ``x_BD`` residual [B, D], the layer's weights (aliases of the model's
    parameters: ``qkv_w`` [(N + 2 Nkv) Dh, D], ``gate_up_w`` [2 * intermediate, D]), the layer's cache
    (written in place at ``pos_B``): slot layout ``k_BcNkvTcDh`` / ``v_BcNkvTcDh`` [Bc, Nkv, Tc, Dh] with
    ``table_BcMb`` None, or a paged pool [Nb, Nkv, Sb, Dh] and its block table int32 [Bc, Mb] (``PagedKVCache``),
    ``cos_BDh``/``sin_BDh`` at ``pos_B``, then what ``attention`` reads: "bmm": ``mask_BTkv`` additive float32 [B, Tkv] (the two
    matmuls read all Tkv positions of every row); "triton": ``lens_B`` int [B] (row b attends
    positions [0, lens_B[b])) and ``kv_len`` = Tkv, a static bound sizing the kernel's grid
    (kernels/decode_attention); last, for a float8 cache (``--inference.kv_cache_dtype fp8``), the layer's scales
    ``k_scale``/``v_scale`` (the cache's layout without Dh): the new k/v are quantized as they are written, bmm reads
    the positions dequantized, triton dequantizes in the kernel ("triton_qkv" takes no float8 cache).
    ``linear``: "torch" (F.linear, separate norms, SiLU and residual adds) or
    "triton" (fused kernels of kernels/decode_linear: norm+QKV and norm+gate/up+SiLU-gate for steps of
    B <= ``DECODE_LINEAR_MAX_ROWS`` rows, O+residual and down+residual for B <= ``DECODE_LINEAR_MAX_ROWS_RESIDUAL``;
    same rounding as the torch ops).
    Returns the new residual [B, D].
    """
    g = num_heads // num_kv_heads
    nq, nk = num_heads * head_dim, num_kv_heads * head_dim

    def attend(qkv, q_norm_w, k_norm_w, k_cache, v_cache, table_BcMb, cos_BDh, sin_BDh, pos_B, mask_BTkv, lens_B,
               kv_len, k_scale, v_scale):  # fmt: skip
        """Split the QKV projection, q/k norm, RoPE, write the new k/v, attend ("bmm" or "triton"): o [B, N Dh]."""
        b = qkv.shape[0]
        q = qkv[:, :nq].view(b, num_heads, head_dim)
        k = qkv[:, nq : nq + nk].view(b, num_kv_heads, head_dim)
        v = qkv[:, nq + nk :].view(b, num_kv_heads, head_dim)
        if q_norm_w is not None:
            q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
        q, k = rotate(q, cos_BDh[:, None], sin_BDh[:, None]), rotate(k, cos_BDh[:, None], sin_BDh[:, None])
        write_token(k_cache, table_BcMb, pos_B, k, k_scale)  # [B, Nkv, Dh] at (slot b, position pos_B[b])
        write_token(v_cache, table_BcMb, pos_B, v, v_scale)
        if attention == "triton":
            o = attend_triton(q.contiguous(), k_cache, v_cache, table_BcMb, lens_B, kv_len, scale, k_scale, v_scale)
            return o.reshape(b, nq)
        tkv = mask_BTkv.shape[1]
        # [B, Nkv, Tkv, Dh]: views of slots, gathered blocks (dequantized copies of a float8 cache)
        kc = read_positions(k_cache, table_BcMb, b, tkv, k_scale, q.dtype)
        vc = read_positions(v_cache, table_BcMb, b, tkv, v_scale, q.dtype)
        scores = torch.matmul(q.view(b, num_kv_heads, g, head_dim), kc.transpose(-1, -2)).float() * scale
        p = torch.softmax(scores + mask_BTkv[:, None, None], dim=-1).to(vc.dtype)
        return torch.matmul(p, vc).reshape(b, nq)  # [B, Nkv, G, Dh] -> [B, N Dh]

    def layer(x_BD, ln1_w, qkv_w, qkv_b, q_norm_w, k_norm_w, o_w, o_b, ln2_w, gate_up_w, down_w,
              k_BcNkvTcDh, v_BcNkvTcDh, table_BcMb, cos_BDh, sin_BDh, pos_B, mask_BTkv, lens_B, kv_len,
              k_scale=None, v_scale=None):  # fmt: skip
        b = x_BD.shape[0]
        # guards when compiled: one graph per side of each bound
        fused = linear == "triton" and b <= DECODE_LINEAR_MAX_ROWS
        fused_res = linear == "triton" and b <= DECODE_LINEAR_MAX_ROWS_RESIDUAL
        if fused:
            qkv = quant.fused_linear(x_BD, qkv_w, qkv_b, ln1_w, eps, None, False)
        else:
            qkv = quant.linear(rms_norm(x_BD, ln1_w, eps), qkv_w, qkv_b)
        if attention == "triton_qkv":  # q/k norm, RoPE, the cache write and attention in one kernel
            o = torch.ops.prime_spmd.fused_decode_attention(
                qkv, num_heads, q_norm_w, k_norm_w, cos_BDh, sin_BDh, pos_B, k_BcNkvTcDh, v_BcNkvTcDh, table_BcMb,
                lens_B, kv_len, scale, eps, 0,
            ).reshape(b, nq)  # fmt: skip
        else:
            o = attend(qkv, q_norm_w, k_norm_w, k_BcNkvTcDh, v_BcNkvTcDh, table_BcMb, cos_BDh, sin_BDh, pos_B,
                       mask_BTkv, lens_B, kv_len, k_scale, v_scale)  # fmt: skip
        if fused_res:
            x_BD = quant.fused_linear(o, o_w, o_b, None, eps, x_BD, False)
        else:
            x_BD = x_BD + quant.linear(o, o_w, o_b)
        if fused:
            h = quant.fused_linear(x_BD, gate_up_w, None, ln2_w, eps, None, True)
        else:
            gu = quant.linear(rms_norm(x_BD, ln2_w, eps), gate_up_w)
            inter = gu.shape[1] // 2
            h = F.silu(gu[:, :inter]) * gu[:, inter:]
        if fused_res:
            return quant.fused_linear(h, down_w, None, None, eps, x_BD, False)
        return x_BD + quant.linear(h, down_w)

    return layer


def make_prefill_layer(num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float):
    """One decoder layer of a prefill as a pure function of tensors (``torch.compile`` fuses its norms, q/k norm, RoPE
    and elementwise ops: the module path is ~50 kernels a layer), the op-for-op math of ``LlamaStyleRunner.prefill``'s
    module path with the fused QKV and gate/up weights of ``layer_args``.

    Args per call: ``x_BTD`` [B, T, D], the layer's weights (as ``make_decode_layer``), ``cos/sin_11TDh`` [1, 1, T, Dh].
    Returns the new residual [B, T, D] and the layer's k, v [B, Nkv, T, Dh] (after norm and RoPE) for the cache."""
    nq, nk = num_heads * head_dim, num_kv_heads * head_dim

    def layer(x_BTD, ln1_w, qkv_w, qkv_b, q_norm_w, k_norm_w, o_w, o_b, ln2_w, gate_up_w, down_w, cos_11TDh,
              sin_11TDh):  # fmt: skip
        b, t, _ = x_BTD.shape
        qkv = quant.linear(rms_norm(x_BTD, ln1_w, eps), qkv_w, qkv_b)
        q = qkv[..., :nq].view(b, t, num_heads, head_dim)
        k = qkv[..., nq : nq + nk].view(b, t, num_kv_heads, head_dim)
        v = qkv[..., nq + nk :].view(b, t, num_kv_heads, head_dim)
        if q_norm_w is not None:
            q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, N or Nkv, T, Dh]
        q, k = rotate(q, cos_11TDh, sin_11TDh), rotate(k, cos_11TDh, sin_11TDh)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        x_BTD = x_BTD + quant.linear(o.transpose(1, 2).reshape(b, t, nq), o_w, o_b)
        gu = quant.linear(rms_norm(x_BTD, ln2_w, eps), gate_up_w)
        inter = gu.shape[-1] // 2
        return x_BTD + quant.linear(F.silu(gu[..., :inter]) * gu[..., inter:], down_w), k, v

    return layer


def attend_triton(q_BNDh, k_cache, v_cache, table_BcMb, lens_B, kv_len: int, scale: float, k_scale=None,
                  v_scale=None) -> torch.Tensor:  # fmt: skip
    """The Triton decode attention over either cache layout (``make_decode_layer``'s cache arguments)."""
    if table_BcMb is None:
        return torch.ops.prime_spmd.decode_attention(q_BNDh, k_cache, v_cache, lens_B, kv_len, scale, 0, k_scale,
                                                     v_scale)  # fmt: skip
    return torch.ops.prime_spmd.paged_decode_attention(q_BNDh, k_cache, v_cache, table_BcMb, lens_B, kv_len, scale, 0,
                                                       k_scale, v_scale)  # fmt: skip


def fuse_linears(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` along the output dim and re-point each
    parameter's ``.data`` at its slice, so one GEMM computes all of them and an in-place weight
    update (``copy_``, what ``load_weights`` does) lands in the fused buffer. Parameter objects and
    names are unchanged; their storage moves once, here."""
    w = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    assert all(has_bias) or not any(has_bias), "mixed biases"
    b = torch.cat([m.bias.detach() for m in linears]) if has_bias[0] else None
    o = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = w[o : o + n]
        if b is not None:
            m.bias.data = b[o : o + n]
        o += n
    return w, b


class LlamaStyleRunner:
    """Prefill and decode for HF Llama-style decoders with a ``SlotKVCache``.

    Dense models of plain shape (``ModelAdapter.supports_fused_decode``: HF Llama-style decoders and our dense
    Qwen3) decode through ``make_decode_layer`` with fused QKV and gate/up weights, compiled on CUDA
    (``compile_decode``); others (MoE) decode through the model's own submodules. ``attention`` picks the decode attention of both
    paths: "bmm" (two batched matmuls + softmax over the whole length bucket), "triton" (the
    flash-decoding kernel of kernels/decode_attention, which reads each row's own positions only), "triton_qkv" (that
    kernel taking the QKV projection: q/k norm, RoPE and the new token's cache write inside it; fused decode layer
    only, the submodule path runs "triton") or "auto" (``resolve_decode_attention``: triton on CUDA, bmm elsewhere);
    ``self.attention`` holds the resolved name. ``linear`` picks the fused path's linears (``resolve_decode_linear``; held in
    ``self.linear``; the model's own submodules, used otherwise, ignore it). ``kv_cache`` picks the cache
    (``build_kv_cache``): "slot" (a whole slot per sequence) or "paged" (blocks of ``kv_block_size`` positions
    from a pool of ``kv_cache_tokens`` tokens; shared prompt blocks), read by both decode paths and both attentions.
    ``prefill_layer_fn``: prefill runs ``make_prefill_layer`` (packed QKV / gate-up weights, compiled on CUDA) instead of
    the model's modules (dense Llama-style models only, else ValueError); None: on CUDA where the model allows it.
    ``exact`` (``--model.exact``): prefill and decode run the batch-invariant kernels (``inference/exact.py``; slot
    cache, dense models); ``attention``, ``linear``, ``prefill_layer_fn`` and compiling are then unused.
    ``quantization`` "fp8" (``--inference.quantization``, quant.py): the layer functions read FP8 copies of the layer
    weights (``self.fp8``, refreshed by ``NativeEngine.load_weights``); dense Llama-style models only, prefill through
    the layer function, decode linears "auto" -> "triton" on CUDA at any hidden size. ``kv_cache_dtype``
    (``--inference.kv_cache_dtype``): "auto" keeps K/V in the model dtype; "fp8" stores them in float8 e4m3 with a
    scale per (position, kv head) (kv_cache.py), quantized as they are written (prefill and decode); prefill attends
    its fresh K/V in the model dtype, decode reads the cache (bmm dequantizes, triton dequantizes in the kernel;
    "triton_qkv", whose cache write is in the kernel, becomes "triton"). Not with ``exact``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int,
        max_len: int,
        device: torch.device,
        compile_decode: bool = True,
        attention: DecodeAttention = "auto",
        linear: DecodeLinear = "auto",
        kv_cache: KVCacheKind = "slot",
        kv_block_size: int = 16,
        kv_cache_tokens: int = 0,
        prefill_layer_fn: bool | None = None,
        quantization: quant.Quantization = "none",
        exact: bool = False,
        kv_cache_dtype: KVCacheDtype = "auto",
    ) -> None:
        if exact and kv_cache_dtype != "auto":
            raise ValueError(
                f"--inference.kv_cache_dtype {kv_cache_dtype} with --model.exact: exact mode needs the trainer's K/V "
                "bit for bit; use --inference.kv_cache_dtype auto"
            )
        attention = resolve_decode_attention(attention, device)
        if kv_cache_dtype == "fp8" and attention == "triton_qkv":
            attention = "triton"  # the fused kernel writes the new k/v itself, in the model dtype only
        if attention in ("triton", "triton_qkv"):
            import prime_spmd.kernels.decode_attention.op  # noqa: F401  registers torch.ops.prime_spmd.*decode_attention
        self.attention = attention
        self.adapter = adapter_for(model)
        dims = self.adapter.dims()
        self.linear = resolve_decode_linear(linear, device, dims.hidden_size)
        if quantization == "fp8" and linear == "auto" and device.type == "cuda":
            self.linear = "triton"  # auto's hidden-size bound was measured in bf16; FP8 kernels read half the bytes
        if self.linear == "triton":
            import prime_spmd.kernels.decode_linear.op  # noqa: F401  registers torch.ops.prime_spmd.decode_linear
        self.model, self.inner = model, model.model
        self.num_layers = dims.num_layers
        self.num_heads = dims.num_heads
        self.num_kv_heads = dims.num_kv_heads
        self.head_dim = dims.head_dim
        self.vocab_size = dims.vocab_size
        self.scale, self.qk_norm, self.eps = dims.attn_scale, dims.qk_norm, dims.rms_norm_eps
        self.dtype = next(model.parameters()).dtype
        self.device = device
        self.cache = build_kv_cache(
            kv_cache,
            num_layers=self.num_layers,
            num_slots=num_slots,
            max_len=max_len,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=device,
            block_size=kv_block_size,
            num_tokens=kv_cache_tokens,
            kv_dtype=kv_cache_dtype,
        )
        self.rebuild_rope()
        self.exact = exact
        if exact:  # prefill and decode run inference/exact.py: no fused, compiled or Triton-glue decode path
            exact_mode.setup(self, kv_cache)
            prefill_layer_fn = False
        self.layer_args: list[tuple] | None = None
        if self.adapter.supports_fused_decode() and not exact:
            self._setup_fused_decode(model, compile_decode and device.type == "cuda")
        elif self.attention == "triton_qkv":  # the models' own modules compute q/k: the kernel cannot take them over
            self.attention = "triton"
        self.fp8 = self._setup_quantization(quantization)
        self._setup_glue()
        self.prefill_layer = None
        if prefill_layer_fn is None:
            prefill_layer_fn = (device.type == "cuda" or self.fp8 is not None) and self.layer_args is not None
        if self.fp8 is not None and not prefill_layer_fn:
            raise ValueError(
                "--inference.quantization fp8 prefills through the layer function: --inference.native.prefill layer_fn"
            )
        if prefill_layer_fn:
            if self.layer_args is None:
                raise ValueError(f"prefill layer_fn needs a dense Llama-style decoder, not {type(model).__name__}")
            fn = make_prefill_layer(self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale)
            self.prefill_layer = compile_exact(fn) if compile_decode and device.type == "cuda" else fn

    def _setup_glue(self) -> None:
        """The Triton decode path (the fused layer with decode linears triton: CUDA's default at hidden size <= 1024)
        also takes the step's inputs and the engine's state advance from kernels/decode_glue: one launch each instead
        of five and four (``self.glue``, ``self.step_inputs``)."""
        self.glue = (
            self.layer_args is not None
            and self.linear == "triton"
            and self.attention in ("triton", "triton_qkv")
            and type(self.inner.embed_tokens) is torch.nn.Embedding
        )
        if self.glue:
            from prime_spmd.kernels.decode_glue.kernel import step_inputs

            self.step_inputs = step_inputs

    def _setup_fused_decode(self, model: torch.nn.Module, compile_decode: bool) -> None:
        layers = model.model.layers
        fn = make_decode_layer(
            self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale, self.attention, self.linear
        )
        # one compiled graph serves all layers (same shapes, weights passed as arguments); B and Tkv
        # become dynamic after the first recompile, so every (rows, length) bucket reuses it
        self.decode_layer = compile_exact(fn, fullgraph=True) if compile_decode else fn
        # the final norm, compiled with the layers: eager, HF's RMSNorm is ~6 kernels a step (0.6B, batch 1, H200:
        # ~2 us each, next to a ~0.85 ms step)
        final = model.model.norm
        self.final_norm_args = (final.weight, getattr(final, "variance_epsilon", getattr(final, "eps", self.eps)))
        self.final_norm = compile_exact(rms_norm) if compile_decode else rms_norm
        self.layer_args = []
        with torch.no_grad():
            for layer in layers:
                attn, mlp = layer.self_attn, layer.mlp
                qkv_w, qkv_b = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
                gate_up_w, _ = fuse_linears([mlp.gate_proj, mlp.up_proj])
                qn = attn.q_norm.weight if self.qk_norm else None
                kn = attn.k_norm.weight if self.qk_norm else None
                ln1, ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
                o = attn.o_proj
                self.layer_args.append(
                    (ln1, qkv_w, qkv_b, qn, kn, o.weight, o.bias, ln2, gate_up_w, mlp.down_proj.weight)
                )

    def _setup_quantization(self, quantization: str) -> quant.Fp8Weights | None:
        """``quantization`` "fp8": the layer weights' FP8 copies, put in ``layer_args`` in place of the bf16 weights
        (ValueError, naming the flag, for a model without the fused decode layer, a GPU below compute capability 8.9
        or shapes the FP8 GEMMs cannot take); "none": None."""
        if quantization == "none":
            return None
        if quantization != "fp8":
            raise ValueError(f"--inference.quantization {quantization!r}: choose none or fp8")
        if self.layer_args is None:
            raise ValueError(
                f"--inference.quantization fp8 needs a dense Llama-style decoder (the fused decode layer), not "
                f"{type(self.model).__name__}: use --inference.quantization none"
            )
        quant.check_fp8_supported(self.device, quant.weight_dims(self.layer_args[0]))
        fp8 = quant.Fp8Weights(self.layer_args, self.device)
        self.layer_args = fp8.layer_args(self.layer_args)
        return fp8

    def rebuild_rope(self) -> None:
        """cos/sin tables [Tc, Dh] from the model's own rotary module (any rope_type it supports)."""
        with torch.no_grad():
            cos_TcDh, sin_TcDh = self.adapter.rope_tables(self.cache.max_len, self.device, self.dtype)
        old = getattr(self, "cos_TcDh", None)
        if (
            old is not None
            and old.shape == cos_TcDh.shape
            and old.device == cos_TcDh.device
            and old.dtype == cos_TcDh.dtype
        ):
            # In place: captured CUDA graphs read these exact buffers. Replacing them after a weight
            # update left the graphs reading freed memory (NaN rollouts on the H200, 2026-12-02).
            self.cos_TcDh.copy_(cos_TcDh)
            self.sin_TcDh.copy_(sin_TcDh)
        else:
            self.cos_TcDh, self.sin_TcDh = cos_TcDh, sin_TcDh

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits. With bf16 weights the GEMM accumulates and writes in fp32 (as the trainer's
        logprob kernels do): rounding logits to bf16 first put the mismatch KL at 2.7e-3 on an H200
        (random Qwen3-0.6B shape, docs/benchmarks.md), above the 1e-3 goal."""
        w = self.adapter.lm_head_weight()
        if x.dtype == torch.float32:
            return F.linear(x, w)
        return fp32_out_linear(x, w)

    def _qkv(self, attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections (+ Qwen3's per-head q/k RMSNorm) -> q [..., N, Dh], k and v [..., Nkv, Dh]."""
        lead = x.shape[:-1]
        q = attn.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    @torch.no_grad()
    def prefill(self, ids_BT: torch.Tensor, slots_B: torch.Tensor, last_B: torch.Tensor) -> torch.Tensor:
        """Run right-padded prompts ``ids_BT`` into ``slots_B``; return float logits [B, V] at ``last_B``.

        Padding sits after each prompt, so causal attention keeps real positions exact; the K/V
        written at padded positions are overwritten by decode before they are ever attended.
        """
        if self.exact:
            return exact_mode.prefill(self, ids_BT, slots_B, last_B)
        b, t = ids_BT.shape
        x = self.inner.embed_tokens(ids_BT)
        cos = self.cos_TcDh[:t][None, None]
        sin = self.sin_TcDh[:t][None, None]
        if self.prefill_layer is not None:  # the layer function (compiled on CUDA)
            for li, args in enumerate(self.layer_args):
                x, k, v = self.prefill_layer(x, *args, cos, sin)
                self.cache.write_prefill(li, slots_B, k, v)
            x_BD = x[torch.arange(b, device=x.device), last_B]
            return self._lm_head(self.final_norm(x_BD, *self.final_norm_args))
        for li, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(attn, h)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, N or Nkv, T, Dh]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            self.cache.write_prefill(li, slots_B, k, v)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x_BD = x[torch.arange(b, device=x.device), last_B]
        return self._lm_head(self.inner.norm(x_BD))

    @torch.no_grad()
    def decode(self, ids_B: torch.Tensor, pos_B: torch.Tensor, kv_len: int, head: bool = True) -> torch.Tensor:
        """One token for each of slots 0..B-1 at ``pos_B``; attends positions [0, kv_len); float logits [B, V],
        or with ``head=False`` the LM head's input [B, D] (the final norm's output, model dtype)."""
        if self.exact:
            return exact_mode.decode(self, ids_B, pos_B, head)
        if self.layer_args is not None:
            return self._decode_fused(ids_B, pos_B, kv_len, head)
        b = ids_B.shape[0]
        g = self.num_heads // self.num_kv_heads
        x = self.inner.embed_tokens(ids_B)[:, None]  # [B, 1, D]: MoE blocks want 3-D input
        rope_pos_B = self._rope_positions(pos_B)
        cos = self.cos_TcDh[rope_pos_B][:, None]  # [B, 1, Dh]
        sin = self.sin_TcDh[rope_pos_B][:, None]
        # attend to positions <= pos; additive mask [B, 1, 1, Tkv] in float32
        visible = torch.arange(kv_len, device=ids_B.device)[None, :] <= pos_B[:, None]
        mask = torch.zeros(visible.shape, device=ids_B.device).masked_fill(~visible, float("-inf"))[:, None, None]
        lens_B = (pos_B + 1).clamp(max=kv_len)
        for li, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)[:, 0]
            q, k, v = self._qkv(attn, h)  # [B, N, Dh], [B, Nkv, Dh]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            self.cache.write_decode(li, pos_B, k, v)
            if self.attention == "triton":
                kc, vc, table = self.cache.k[li], self.cache.v[li], self.cache.block_table
                o = attend_triton(q.contiguous(), kc, vc, table, lens_B, kv_len, self.scale, *self.cache.scales(li))
            else:
                kc, vc = self.cache.read(li, b, kv_len)  # [B, Nkv, Tkv, Dh]
                q = q.view(b, self.num_kv_heads, g, self.head_dim)
                scores = torch.matmul(q, kc.transpose(-1, -2)).float() * self.scale + mask  # [B, Nkv, G, Tkv]
                p = torch.softmax(scores, dim=-1).to(vc.dtype)
                o = torch.matmul(p, vc)  # [B, Nkv, G, Dh]
            x = x + attn.o_proj(o.reshape(b, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self.inner.norm(x[:, 0])
        return self._lm_head(h) if head else h

    def _rope_positions(self, pos_B: torch.Tensor) -> torch.Tensor:
        """The rotary position of each decoded row's token: its cache position (vision_kv_runner shifts it)."""
        return pos_B

    def _decode_fused(self, ids_B: torch.Tensor, pos_B: torch.Tensor, kv_len: int, head: bool) -> torch.Tensor:
        if self.glue:  # the embedding / RoPE rows and lengths in one launch (kernels/decode_glue)
            x, cos, sin, lens_B = self.step_inputs(ids_B, pos_B, self.inner.embed_tokens.weight, self.cos_TcDh,
                                              self.sin_TcDh, kv_len)  # fmt: skip
            mask_BTkv, tkv = None, kv_len
        else:
            x = self.inner.embed_tokens(ids_B)  # [B, D]
            rope_pos_B = self._rope_positions(pos_B)
            cos, sin = self.cos_TcDh[rope_pos_B], self.sin_TcDh[rope_pos_B]  # [B, Dh]
            if self.attention in ("triton", "triton_qkv"):
                # row b attends positions <= pos_B[b]; rows past the bucket (free slots) are clamped to it
                mask_BTkv, lens_B, tkv = None, (pos_B + 1).clamp(max=kv_len), kv_len
            else:
                visible = torch.arange(kv_len, device=ids_B.device)[None, :] <= pos_B[:, None]
                mask_BTkv = torch.zeros(visible.shape, device=ids_B.device).masked_fill(~visible, float("-inf"))
                lens_B, tkv = None, 0  # a constant: the bmm path reads Tkv from the mask's shape
        k, v, table = self.cache.k, self.cache.v, self.cache.block_table
        for li, args in enumerate(self.layer_args):
            x = self.decode_layer(x, *args, k[li], v[li], table, cos, sin, pos_B, mask_BTkv, lens_B, tkv,
                                  *self.cache.scales(li))  # fmt: skip
        h = self.final_norm(x, *self.final_norm_args)
        return self._lm_head(h) if head else h


class GenericRunner:
    """Any HF causal LM: keeps each slot's token ids and re-runs the full sequences every step."""

    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int, device: torch.device) -> None:
        self.model, self.device, self.max_len = model, device, max_len
        self.vocab_size = model.config.vocab_size
        self.seqs: list[list[int]] = [[] for _ in range(num_slots)]
        self.cache = None

    def rebuild_rope(self) -> None:
        pass

    @torch.no_grad()
    def _last_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        t = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), t, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, device=self.device)
        # right padding + causal attention: real positions see only real tokens
        logits = self.model(input_ids=ids, use_cache=False).logits
        last = torch.tensor([len(s) - 1 for s in seqs], device=self.device)
        return logits[torch.arange(len(seqs), device=self.device), last].float()

    def prefill(self, ids_BT: torch.Tensor, slots_B: torch.Tensor, last_B: torch.Tensor) -> torch.Tensor:
        rows = ids_BT.tolist()
        for slot, row, last in zip(slots_B.tolist(), rows, last_B.tolist()):
            self.seqs[slot] = row[: last + 1]
        return self._last_logits([self.seqs[s] for s in slots_B.tolist()])

    def decode(self, ids_B: torch.Tensor, pos_B: torch.Tensor, kv_len: int) -> torch.Tensor:
        for slot, (tok, pos) in enumerate(zip(ids_B.tolist(), pos_B.tolist())):
            self.seqs[slot] = self.seqs[slot][:pos] + [tok] if pos > 0 else [tok]
        return self._last_logits(self.seqs[: ids_B.shape[0]])


def build_kv_cache(kind: KVCacheKind, *, block_size: int, num_tokens: int, **dims) -> SlotKVCache | PagedKVCache:
    """The ``kind`` KV cache (``dims``: the keyword arguments of ``SlotKVCache``, ``kv_dtype`` among them).
    ``block_size`` and ``num_tokens`` (pool capacity in tokens, 0: slots x max length) size the paged cache; the slot
    cache takes neither."""
    if kind == "slot":
        if num_tokens:
            raise ValueError(f"--inference.native.kv_cache_tokens={num_tokens} needs --inference.native.kv_cache=paged")
        return SlotKVCache(**dims)
    if kind == "paged":
        return PagedKVCache(**dims, block_size=block_size, num_tokens=num_tokens)
    raise ValueError(f"KV cache {kind!r}: choose slot or paged")


def build_runner(
    model: torch.nn.Module,
    num_slots: int,
    max_len: int,
    device: torch.device,
    compile_decode: bool = True,
    attention: DecodeAttention = "auto",
    linear: DecodeLinear = "auto",
    kv_cache: KVCacheKind = "slot",
    kv_block_size: int = 16,
    kv_cache_tokens: int = 0,
    prefill_layer_fn: bool | None = None,
    quantization: quant.Quantization = "none",
    exact: bool = False,
    kv_cache_dtype: KVCacheDtype = "auto",
):
    """The fastest runner that supports ``model`` (``attention``, ``linear``, ``kv_cache``,
    ``prefill_layer_fn``, ``quantization``, ``kv_cache_dtype``: see ``LlamaStyleRunner``; the generic runner keeps
    token ids, no KV cache, and ignores the first three; ``prefill_layer_fn`` None is off there; ``quantization`` and
    ``kv_cache_dtype`` must be "none" / "auto" there and for vision-language models)."""
    adapter = adapter_for(model)
    if kv_cache_dtype != "auto" and (adapter.family == "vlm" or not adapter.supports_slot_cache()):
        raise ValueError(
            f"--inference.kv_cache_dtype {kv_cache_dtype} needs a text decoder with the native KV cache (Llama-style), "
            f"not {type(model).__name__}: use --inference.kv_cache_dtype auto"
        )
    if quantization != "none" and not adapter.supports_fused_decode():
        raise ValueError(
            f"--inference.quantization {quantization} needs a dense Llama-style decoder (the native engine's fused "
            f"decode layer), not {type(model).__name__}: use --inference.quantization none"
        )
    # the KV-cache runners' shared arguments (VisionKVRunner is a LlamaStyleRunner taking no others)
    kv_args = (model, num_slots, max_len, device, compile_decode, attention, linear, kv_cache, kv_block_size,
               kv_cache_tokens)  # fmt: skip
    if adapter.family == "vlm":  # images in the prompt, then the KV-cache decode: vision_kv_runner.py
        from prime_spmd.inference.vision_kv_runner import VisionKVRunner

        return VisionKVRunner(*kv_args)
    if adapter.supports_slot_cache():
        return LlamaStyleRunner(
            *kv_args, prefill_layer_fn, quantization=quantization, exact=exact, kv_cache_dtype=kv_cache_dtype
        )
    if exact:
        raise ValueError(f"--model.exact needs a Llama-style decoder with a KV cache, not {type(model).__name__}")
    if prefill_layer_fn:
        raise ValueError(f"prefill layer_fn needs a Llama-style decoder with a KV cache, not {type(model).__name__}")
    return GenericRunner(model, num_slots, max_len, device)
