"""Compile the decode-path and LM-head logprob Triton kernels for an H100/H200 (sm_90) on a machine without a GPU: the frontend,
the TTIR/TTGIR passes, LLVM and ptxas (bundled with triton) all run on the CPU. This catches what the interpreter
(TRITON_INTERPRET=1, how CPU tests run kernels) does not: code that is valid Python but not valid Triton, e.g. a
non-constexpr module global read inside a kernel (kernels/gumbel_sample, 2026-12-04). Run by
tests/kernels/test_sm90_compile.py in a subprocess without TRITON_INTERPRET (under it ``@triton.jit`` gives
interpreter functions that cannot be compiled). Prints one line per kernel variant with its registers and spill
bytes (cuobjdump, bundled with triton); exits 1 if any failed, or if a ``NO_SPILLS`` kernel spills.

    python tests/kernels/sm90_compile.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") != "1", "compile with the interpreter off"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
warnings.filterwarnings("ignore")

import triton  # noqa: E402
from prime_spmd.kernels.batch_invariant import kernel as batch_invariant  # noqa: E402
from prime_spmd.kernels.decode_attention import kernel as attention  # noqa: E402
from prime_spmd.kernels.decode_glue import kernel as glue  # noqa: E402
from prime_spmd.kernels.decode_linear import kernel as linear  # noqa: E402
from prime_spmd.kernels.gumbel_sample import kernel as sampler  # noqa: E402
from prime_spmd.kernels.lm_logprob import fused_kernel as lm_fused  # noqa: E402
from prime_spmd.kernels.lm_logprob import kernel as lm  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def sig(names: str, types: str) -> dict[str, str]:
    """``"a b c"`` and ``"*fp32 i32 i32"`` -> {a: *fp32, ...}."""
    return dict(zip(names.split(), types.split(), strict=True))


# the model-dtype launch: scale pointers None and their strides 1 are constexprs (kernel.decode_attention)
NO_FP8 = {**attention.NO_FP8, "ss_bc": 1, "ss_nkv": 1, "ss_tc": 1}


def variants():
    """(name, jit function, runtime-argument signature, constexprs, compile options), as the launchers call them."""

    def gumbel_sig(dtype: str) -> dict[str, str]:
        return sig("src_ptr w_ptr temp_ptr seeds_ptr steps_ptr part_f_ptr part_i_ptr B V D CHUNK S s_src swv stt sts stp",
                   f"*{dtype} *{dtype} *fp32 *i64 *i64 *fp32 *i32 " + "i32 " * 10)  # fmt: skip

    yield (
        "gumbel_sample partials",
        sampler._partials_kernel,
        gumbel_sig("fp32"),
        {"BLOCK_B": 1, "BLOCK_V": 1024, "BLOCK_D": 16, "FROM_HIDDEN": False, "UPCAST": False, "IEEE": False},
        {"num_warps": 4, "num_stages": 3},
    )
    yield (
        "gumbel_sample combine",
        sampler._combine_kernel,
        sig("temp_ptr part_f_ptr part_i_ptr tokens_ptr logprobs_ptr S stt", "*fp32 *fp32 *i32 *i64 *fp32 i32 i32"),
        {"BLOCK_S": 256},
        {},
    )
    for dtype, block_b in (("bf16", 16), ("bf16", 32), ("bf16", 64), ("fp32", 16), ("fp32", 64)):
        block_v, block_d, warps, stages = sampler.lm_head_config(block_b, 2 if dtype == "bf16" else 4)
        yield (
            f"gumbel_sample lm_head {dtype} rows {block_b}",
            sampler._partials_kernel,
            gumbel_sig(dtype),
            {"BLOCK_B": block_b, "BLOCK_V": block_v, "BLOCK_D": block_d, "FROM_HIDDEN": True, "UPCAST": False,
             "IEEE": dtype == "fp32"},
            {"num_warps": warps, "num_stages": stages},
        )  # fmt: skip
    lin = sig(
        "x_ptr w_ptr b_ptr nw_ptr r_ptr o_ptr M K NO eps sxm swn srm som",
        "*bf16 *bf16 *bf16 *bf16 *bf16 *bf16 i32 i32 i32 fp32 i32 i32 i32 i32",
    )
    # pdl: the minimal form (qkv); pdl prefetch: the weight rows bulk-prefetched into L2 before the wait (one and two
    # slabs)
    for use_pdl, prefetch in ((False, False), (True, False), (True, True)):
        for name, silu, norm, res in (
            ("qkv", False, True, False),
            ("gate_up", True, True, False),
            ("o", False, False, True),
        ):
            if use_pdl and not prefetch and name != "qkv":
                continue
            yield (
                f"decode_linear {name}{' pdl' if use_pdl else ''}{' prefetch' if prefetch else ''}",
                linear._decode_linear_kernel,
                lin,
                {
                    "HAS_BIAS": False,
                    "HAS_NORM": norm,
                    "HAS_RES": res,
                    "SILU_MUL": silu,
                    "BLOCK_M": 16,
                    "BLOCK_N": 32,
                    "BLOCK_K": 256,
                    "UPCAST": False,
                    "IEEE": False,
                    "RNE_EMU": False,
                    "USE_PDL": use_pdl,
                    "PREFETCH": prefetch,
                },
                {"num_warps": 4, "num_stages": 4},
            )
    gemv = sig("x_ptr w_ptr b_ptr nw_ptr r_ptr o_ptr NO eps swn", "*bf16 *bf16 *bf16 *bf16 *bf16 *bf16 i32 fp32 i32")
    # the one-row GEMV kernel at the Qwen3-0.6B layer shapes (K is a constexpr), its default config; qkv with PDL too;
    # with PDL's preload (the whole w slab loaded before griddepcontrol.wait) for all four
    for name, k, silu, norm, res, use_pdl, preload in (
        ("qkv", 1024, False, True, False, False, False),
        ("gate_up", 1024, True, True, False, False, False),
        ("o", 2048, False, False, True, False, False),
        ("down", 3072, False, False, True, False, False),
        ("qkv", 1024, False, True, False, True, False),
        ("qkv", 1024, False, True, False, True, True),
        ("gate_up", 1024, True, True, False, True, True),
        ("o", 2048, False, False, True, True, True),
        ("down", 3072, False, False, True, True, True),
    ):
        yield (
            f"decode_linear gemv {name}{' pdl' if use_pdl else ''}{' preload' if preload else ''}",
            linear._gemv_kernel,
            gemv,
            {"K": k, "HAS_BIAS": False, "HAS_NORM": norm, "HAS_RES": res, "SILU_MUL": silu, "BLOCK_N": 2,
             "BLOCK_K": 1024, "RNE_EMU": False, "USE_PDL": use_pdl, "PRELOAD": preload,
             "KP": triton.next_power_of_2(k)},
            {"num_warps": 4, "num_stages": 1},
        )  # fmt: skip
    heads = {"NKV": 8, "G": 2, "DH": 128, "NUM_SPLITS": 4, "SPLIT_LEN": 256, "BLOCK_G": 16, "BLOCK_DH": 128}
    split_args = (
        "q_ptr k_ptr v_ptr lens_ptr o_ptr acc_ptr ml_ptr sq_b sq_n sk_bc sk_nkv sk_tc sv_bc sv_nkv sv_tc so_b so_n "
    )
    split_types = "*bf16 *bf16 *bf16 *i64 *bf16 *fp32 *fp32 " + "i32 " * 10
    yield (
        "decode_attention split",
        attention._split_kernel,
        sig(split_args + "max_len qk_scale", split_types + "i32 fp32"),
        # the slot launch's table None and stride 1 are constexprs (kernel.decode_attention)
        {
            **heads,
            "BLOCK_TC": 64,
            "UPCAST": False,
            "IEEE": False,
            "SB": 0,
            "table_ptr": None,
            "st_b": 1,
            **attention.UNFUSED,
            **NO_FP8,
        },  # fmt: skip
        {"num_warps": 4, "num_stages": 2},
    )
    # FP8 K/V (--inference.kv_cache_dtype fp8): e4m3 k/v, fp32 scales per (position, kv head), slot and paged
    for sb in (0, 16):
        table = {"table_ptr": None, "st_b": 1} if sb == 0 else {}
        yield (
            f"decode_attention split fp8 kv{' paged Sb 16' if sb else ''}",
            attention._split_kernel,
            sig(
                split_args + "max_len qk_scale" + ("" if sb == 0 else " table_ptr st_b") + " ks_ptr vs_ptr ss_bc ss_nkv ss_tc",
                "*bf16 *fp8e4nv *fp8e4nv *i64 *bf16 *fp32 *fp32 " + "i32 " * 10 + "i32 fp32"
                + ("" if sb == 0 else " *i32 i32") + " *fp32 *fp32 i32 i32 i32",
            ),
            {**heads, "BLOCK_TC": 64, "UPCAST": False, "IEEE": False, "SB": sb, **table, **attention.UNFUSED,
             "KV_FP8": True},
            {"num_warps": 4, "num_stages": 2},
        )  # fmt: skip
    # Sb 16: the engine's default block size; 48: neither divides nor is divided by the 64-position tile. Compiled,
    # as every variant here, without the 16-divisibility a launch's pointers and strides get, so the printed
    # registers are not a launch's: with it the slot split takes 85 registers and these 86 and 87, no spills
    # (without it 254 and 255, these spilling 328 and 288 bytes), 2026-12-05
    for sb in (16, 48):
        yield (
            f"decode_attention split paged Sb {sb}",
            attention._split_kernel,
            sig(split_args + "max_len qk_scale table_ptr st_b", split_types + "i32 fp32 *i32 i32"),
            {**heads, "BLOCK_TC": 64, "UPCAST": False, "IEEE": False, "SB": sb, **attention.UNFUSED, **NO_FP8},
            {"num_warps": 4, "num_stages": 2},
        )
    # the fused form (q/k norm, RoPE and the new token's cache write in the kernel), slot and paged cache
    fused_args = "qn_ptr kn_ptr cos_ptr sin_ptr pos_ptr s_cs eps cnt_ptr"
    fused_types = "*bf16 *bf16 *bf16 *bf16 *i64 i32 fp32 *i32"
    # preload: the one-tile-a-split form (K/V tile loaded first, the new entry substituted, no barrier)
    for sb, use_pdl, preload in ((0, False, False), (16, False, False), (0, True, False), (0, False, True)):
        table = {"table_ptr": None, "st_b": 1} if sb == 0 else {}
        table_sig = "" if sb == 0 else " table_ptr st_b"
        yield (
            f"decode_attention split fused{' paged Sb 16' if sb else ''}{' pdl' if use_pdl else ''}"
            f"{' preload tile' if preload else ''}",
            attention._split_kernel,
            sig(
                split_args + "max_len qk_scale" + table_sig + " " + fused_args,
                split_types + "i32 fp32" + ("" if sb == 0 else " *i32 i32") + " " + fused_types,
            ),  # fmt: skip
            {
                **heads,
                "BLOCK_TC": 64,
                "UPCAST": False,
                "IEEE": False,
                "SB": sb,
                **table,
                "FUSE": True,
                "QK_NORM": True,
                "USE_PDL": use_pdl,
                "PRELOAD_TILE": preload,
                **NO_FP8,
                **({"SPLIT_LEN": 64} if preload else {}),
            },  # fmt: skip
            {"num_warps": 4, "num_stages": 2},
        )
    # the LM-head logprob kernels (trainer): every autotune config, bf16 inputs, fp32 statistics
    for i, cfg in enumerate(lm._cuda_configs()):
        opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        yield (
            f"lm_logprob fwd config {i}",
            lm._fwd_kernel,
            sig(
                "h_ptr w_ptr tgt_ptr temp_ptr m_ptr s_ptr a_ptr zt_ptr T D V T_BUCKET stride_ht stride_wv v_per_split",
                "*bf16 *bf16 *i64 *fp32 *fp32 *fp32 *fp32 *fp32 " + "i32 " * 7,
            ),
            {**cfg.kwargs, "EVEN_D": True, "UPCAST": False, "PRECISION": "tf32"},
            opts,
        )
        yield (
            f"lm_logprob grad config {i}",
            lm._grad_logits_kernel,
            sig(
                "h_ptr w_ptr tgt_ptr temp_ptr lse_ptr ent_ptr glp_ptr gent_ptr g_ptr T D V T_BUCKET stride_ht stride_wv "
                "stride_gt",
                "*bf16 *bf16 *i64 *fp32 *fp32 *fp32 *fp32 *fp32 *bf16 " + "i32 " * 7,
            ),
            {
                **cfg.kwargs,
                "HAS_GLP": True,
                "HAS_GENT": True,
                "EVEN_D": True,
                "GROUP_T": 8,
                "UPCAST": False,
                "PRECISION": "tf32",
            },
            opts,
        )
    fused = (
        ("stats", lm_fused._stats_tuned, lm_fused._stats_kernel, {},
         sig("x_ptr temp_ptr m_ptr s_ptr a_ptr C V C_BUCKET stride_xc v_per_split",
             "*fp32 *fp32 *fp32 *fp32 *fp32 " + "i32 " * 5)),
        ("grad", lm_fused._grad_tuned, lm_fused._grad_kernel, {"HAS_GLP": True, "HAS_GENT": True},
         sig("x_ptr g_ptr tgt_ptr temp_ptr lse_ptr ez_ptr glp_ptr gent_ptr C V C_BUCKET stride_xc stride_gc",
             "*fp32 *bf16 *i64 *fp32 *fp32 *fp32 *fp32 *fp32 " + "i32 " * 5)),
    )  # fmt: skip
    for part, tuner, fn, flags, signature in fused:
        for i, cfg in enumerate(tuner.configs):
            yield (f"lm_logprob fused {part} config {i}", fn, signature, {**cfg.kwargs, **flags},
                   {"num_warps": cfg.num_warps})  # fmt: skip
    for use_pdl in (False, True):  # the glue kernels as the engine launches them (0.6B: D 1024, Dh 128, bf16)
        yield (f"decode_glue step_inputs{' trigger' if use_pdl else ''}", glue._step_inputs_kernel,
               sig("ids_ptr pos_ptr emb_ptr cos_ptr sin_ptr x_ptr cos_out_ptr sin_out_ptr lens_ptr D DH kv_len s_emb "
                   "s_cos s_sin", "*i64 *i64 *bf16 *bf16 *bf16 *bf16 *bf16 *bf16 *i64 " + "i32 " * 6),
               {"BLOCK_D": 1024, "BLOCK_DH": 128, "USE_PDL": use_pdl}, {"num_warps": 4})  # fmt: skip
        yield (f"decode_glue advance{' pdl' if use_pdl else ''}", glue._advance_kernel,
               sig("ids_ptr pos_ptr steps_ptr out_ptr tok_ptr lp_ptr B s_out max_pos",
                   "*i64 *i64 *i64 *fp64 *i64 *fp32 i32 i32 i32"),
               {"BLOCK": 1, "USE_PDL": use_pdl}, {"num_warps": 4})  # fmt: skip
    yield ("decode_attention reduce", attention._reduce_kernel,
           sig("acc_ptr ml_ptr lens_ptr o_ptr so_b so_n max_len", "*fp32 *fp32 *i64 *bf16 i32 i32 i32"), heads,
           {"num_warps": 4})  # fmt: skip
    yield from batch_invariant_variants()
    yield from fp8_weight_variants()


def fp8_weight_variants():
    """kernels/fp8 (--inference.quantization fp8) as kernel.py launches them at the Qwen3-8B layer shapes (bf16 x, e4m3
    w) with PDL: the GEMV at its default config (``gemv_config``: preloaded up to K 4,096, chunked past it: down),
    the tile kernel at 64 rows, and the quantize. Pointers and the row stride are compiled as 16-divisible, as the JIT
    specializes them at launch (without that the e4m3 loads compile to one byte each)."""
    from prime_spmd.kernels.fp8 import kernel as fp8

    ptrs = "x_ptr w_ptr s_ptr b_ptr nw_ptr r_ptr o_ptr"
    ptr_types = "*bf16 *fp8e4nv *fp32 *bf16 *bf16 *bf16 *bf16 "
    aligned = {"divisible_by_16": tuple(ptrs.split()) + ("swn",)}
    for name, k, no, silu, norm in (
        ("qkv", 4096, 6144, False, True),
        ("gate_up", 4096, 12288, True, True),
        ("o", 4096, 4096, False, False),
        ("down", 12288, 4096, False, False),
    ):
        _, bn, bk, warps = fp8.gemv_config(no, k, silu)
        preload = k <= fp8.PRELOAD_MAX_K
        yield (f"fp8 gemv 8b {name} pdl{' preload' if preload else ''}", fp8._fp8_gemv_kernel,
               sig(f"{ptrs} NO eps swn", ptr_types + "i32 fp32 i32"),
               {"K": k, "HAS_BIAS": False, "HAS_NORM": norm, "HAS_RES": not norm, "SILU_MUL": silu, "BLOCK_N": bn,
                "BLOCK_K": bk, "RNE_EMU": False, "USE_PDL": True, "PRELOAD": preload, "KP": triton.next_power_of_2(k)},
               {"num_warps": warps, "num_stages": 1, **aligned})  # fmt: skip
        cfg = linear.default_config(64, no, k, silu, 2)
        yield (f"fp8 tile 8b {name} M 64 pdl", fp8._fp8_tile_kernel,
               sig(f"{ptrs} M K NO eps sxm swn srm som", ptr_types + "i32 i32 i32 fp32 i32 i32 i32 i32"),
               {"HAS_BIAS": False, "HAS_NORM": norm, "HAS_RES": not norm, "SILU_MUL": silu, "BLOCK_M": cfg[0],
                "BLOCK_N": cfg[1], "BLOCK_K": cfg[2], "UPCAST": False, "IEEE": False, "RNE_EMU": False,
                "USE_PDL": True},
               {"num_warps": cfg[3], "num_stages": cfg[4], **aligned})  # fmt: skip
    yield ("fp8 quantize", fp8._quantize_kernel,
           sig("w_ptr q_ptr s_ptr K sw sq", "*bf16 *fp8e4nv *fp32 i32 i32 i32"), {"BLOCK_K": 2048, "RNE_EMU": False},
           {"num_warps": 8, "divisible_by_16": ("w_ptr", "q_ptr", "s_ptr", "sw", "sq")})  # fmt: skip


def batch_invariant_variants():
    """kernels/batch_invariant (--model.exact) as op.py launches them in bf16 at the Qwen3-0.6B shape (Dh 128, G 2)."""
    bi = batch_invariant
    mm = {"BLOCK_M": bi.MM_BLOCK_M, "BLOCK_N": bi.MM_BLOCK_N, "BLOCK_K": bi.MM_BLOCK_K, "UPCAST": False, "IEEE": False,
          "EVEN_K": True, "CHUNK_K": bi.MM_CHUNK_K}  # fmt: skip
    mm_opts = {"num_warps": bi.MM_WARPS, "num_stages": bi.MM_STAGES}
    # fused (the trainer's launches) and split over K chunks (decode's), each followed by the reduce kernel below
    for split in (False, True):
        mode = " split" if split else ""
        for out, bias, res in (("bf16", False, True), ("fp32", True, False)):
            yield (f"batch_invariant matmul {out} out{mode}", bi.matmul_kernel,
                   sig("x_ptr w_ptr b_ptr res_ptr out_ptr ws_ptr M N K sxm sxk swn swk srm som son",
                       f"*bf16 *bf16 *bf16 *bf16 *{out} *fp32 " + "i32 " * 10),
                   {**mm, "HAS_BIAS": bias, "HAS_RES": res, "SPLIT": split}, mm_opts)  # fmt: skip
        for nseg in (2, 3):
            yield (f"batch_invariant matmul {nseg} segments{mode}", bi.matmul_segments_kernel,
                   sig("x_ptr w0_ptr w1_ptr w2_ptr o0_ptr o1_ptr o2_ptr ws_ptr M N0 N1 N2 K sxm sxk sw0 sw1 sw2 swk",
                       "*bf16 " * 7 + "*fp32 " + "i32 " * 11),
                   {**mm, "NSEG": nseg, "SPLIT": split}, mm_opts)  # fmt: skip
    for name, out, nseg, bias, res in (("bf16 out", "bf16", 1, False, True), ("fp32 out", "fp32", 1, True, False),
                                       ("3 segments", "bf16", 3, False, False)):  # fmt: skip
        yield (f"batch_invariant matmul reduce {name}", bi.matmul_reduce_kernel,
               sig("ws_ptr b_ptr res_ptr o0_ptr o1_ptr o2_ptr M N0 N1 N2 S srm",
                   f"*fp32 *bf16 *bf16 *{out} *{out} *{out} " + "i32 " * 6),
               {"NSEG": nseg, "HAS_BIAS": bias, "HAS_RES": res, "BLOCK": bi.MM_REDUCE_BLOCK}, {"num_warps": 4})  # fmt: skip
    for d in (128, 1024):
        yield (f"batch_invariant rms_norm D {d}", bi.rms_norm_kernel,
               sig("x_ptr w_ptr out_ptr R D sx so eps", "*bf16 *bf16 *bf16 i32 i32 i32 i32 fp32"),
               {"BLOCK_R": bi.ROW_ELEMS // d, "BLOCK_D": d}, {"num_warps": 4})  # fmt: skip
    yield ("batch_invariant rms_norm_rope Dh 128", bi.rms_norm_rope_kernel,
           sig("x_ptr w_ptr cos_ptr sin_ptr pos_ptr out_ptr R H D sx so sc eps",
               "*bf16 *bf16 *bf16 *bf16 *i64 *bf16 i32 i32 i32 i32 i32 i32 fp32"),
           {"BLOCK_R": bi.ROW_ELEMS // 128, "BLOCK_D": 128}, {"num_warps": 4})  # fmt: skip
    yield ("batch_invariant silu_mul", bi.silu_mul_kernel, sig("g_ptr u_ptr out_ptr R C sg su so", "*bf16 " * 3 + "i32 " * 5),
           {"BLOCK_R": 16, "BLOCK_C": 256}, {"num_warps": 4})  # fmt: skip
    names = "q_ptr k_ptr v_ptr out_ptr start_ptr B Tq G Dh scale sqb sqt sqh sqd skb skh skt skd svb svh svt svd sob sot soh sod"
    yield ("batch_invariant attention", bi.attention_kernel, sig(names, "*bf16 " * 4 + "*i64 i32 i32 i32 i32 fp32 " + "i32 " * 16),
           {"UPCAST": False, "IEEE": False, "BLOCK_T": bi.ATTN_BLOCK_T, "BLOCK_G": 2, "BLOCK_N": bi.ATTN_BLOCK_N,
            "BLOCK_D": 128}, {"num_warps": 4})  # fmt: skip
    yield ("batch_invariant logprob", bi.logprob_kernel,
           sig("logits_ptr temp_ptr target_ptr lp_ptr ent_ptr R V sl", "*fp32 *fp32 *i64 *fp32 *fp32 i32 i32 i32"),
           {"BLOCK_V": bi.LOGPROB_BLOCK_V}, {"num_warps": 4})  # fmt: skip


NO_SPILLS = ("gumbel_sample", "fp8 gemv")
PDL_INSTRUCTIONS = ("wait", "launch_dependents")
"""What a `` pdl`` variant (kernels/pdl: USE_PDL) must contain."""
"""Kernels whose configs were chosen to compile without register spills: a spill fails them."""


def resource_usage(cubin: bytes) -> str:
    """cuobjdump's resource line (registers, stack = spill bytes, ...) of a cubin; '' where cuobjdump is missing."""
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not tool.is_file():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return next((x.strip() for x in out.splitlines() if "REG:" in x), "")


def main() -> int:
    failed = 0
    todo = list(variants())
    print(f"variants {len(todo)}", flush=True)  # test_sm90_compile checks that each printed a line
    for name, fn, signature, constexprs, options in todo:
        # "divisible_by_16": arguments compiled as the JIT specializes 16-byte aligned pointers / 16-divisible ints
        options = dict(options)
        aligned = options.pop("divisible_by_16", ())
        source = ASTSource(
            fn=fn,
            signature={**signature, **{k: "constexpr" for k in constexprs}},
            constexprs=constexprs,
            attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned},
        )
        try:
            compiled = triton.compile(source, target=TARGET, options=options)
        except Exception as e:  # noqa: BLE001  every variant is tried; the failures are listed, then exit 1
            failed += 1
            print(f"FAILED  {name}: {type(e).__name__}: {' | '.join(str(e).splitlines())[:2000]}", flush=True)
            continue
        usage = resource_usage(compiled.asm["cubin"])  # e.g. "REG:226 STACK:0 SHARED:1024 ..."
        if name.endswith(" prefetch") and "cp.async.bulk.prefetch.L2.global" not in compiled.asm["ptx"]:
            failed += 1
            print(f"FAILED  {name}: no cp.async.bulk.prefetch.L2 in the PTX", flush=True)
            continue
        ptx = compiled.asm["ptx"]
        if name.endswith(" preload") and not -1 < ptx.find("ld.global") < ptx.find("griddepcontrol.wait"):
            failed += 1
            print(f"FAILED  {name}: no global load before griddepcontrol.wait in the PTX", flush=True)
            continue
        if name.endswith(" trigger") and "griddepcontrol.launch_dependents" not in ptx:
            failed += 1
            print(f"FAILED  {name}: no griddepcontrol.launch_dependents in the PTX", flush=True)
            continue
        if " pdl" in name and not all(f"griddepcontrol.{i}" in compiled.asm["ptx"] for i in PDL_INSTRUCTIONS):
            failed += 1
            print(f"FAILED  {name}: no griddepcontrol instructions in the PTX", flush=True)
            continue
        if name.startswith(NO_SPILLS) and usage and "STACK:0 " not in usage + " ":
            failed += 1
            print(f"FAILED  {name}: register spills ({usage})", flush=True)
            continue
        print(f"ok      {name}: {compiled.metadata.shared} B shared memory; {' '.join(usage.split()[:2])}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
