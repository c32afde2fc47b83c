"""FP8 decode linears alone (kernels/fp8): what each of a decoder layer's four linears costs at a decode step's M rows
on each path the engine can take, beside the bf16 torch ops.

Paths (kernels/fp8/op.py): "gemv" (one row: the FP8 Triton GEMV at its default config, and with ``--gemv`` a grid of
(BLOCK_N, BLOCK_K, warps, preload)), "tile" (the FP8 Triton tile kernel: ``TILE_ROWS_IMPL`` "triton"), "scaled_mm"
(``fp8_fused_linear`` with ``TILE_ROWS_IMPL`` "scaled_mm": RMSNorm, the per-row activation quantize, ``torch._scaled_mm``,
SiLU-gate and residual, compiled as the decode layer compiles them), "scaled_mm_t" (the same with the GEMM's operands
swapped, not an engine path: does a skinny M lose to CUTLASS's tile choice? M a multiple of 16; not yet run on a GPU),
"bf16" (the engine's torch ops on the bf16 weight,
compiled: what ``--inference.quantization none`` runs at the 8B shape). Each runs over enough weight copies (> 256 MB)
that the weights come from HBM, captured in one CUDA graph (benchmarks/common.time_graph), median over replays. GB/s
counts the weight bytes (e4m3 plus fp32 scales for FP8, bf16 for the baseline).

Legend (docs/conventions.md): M rows, K in, N out features of w.

    python benchmarks/fp8_linear.py --model-shape qwen3-8b --rows 1,16,64 --gemv --out fp8_linear.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prime_spmd.kernels.decode_linear.reference import finish_output, norm_input  # noqa: E402
from prime_spmd.kernels.fp8 import kernel, op  # noqa: E402
from prime_spmd.kernels.fp8.reference import quantize_fp8_reference, quantize_rows_fp8_reference  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.decode_linear import EPS, SHAPES, ops, torch_op  # noqa: E402

GEMV_GRID = [(bn, bk, wp, pre) for bn in (2, 4, 8) for bk in (1024, 2048) for wp in (4, 8) for pre in (False, True)]


def scaled_mm_path(x, q, s, nw, r, silu):
    """``op.fp8_fused_linear`` on its "scaled_mm" path (compiled in ``main``, as the decode layer compiles it)."""
    return op.fp8_fused_linear(x, q, s, None, nw, EPS, r, silu, tile_rows="scaled_mm")


def scaled_mm_t_path(x, q, s, nw, r, silu):
    """The "scaled_mm" path with the GEMM's operands swapped, (w xq^T)^T: the weight's N rows are the GEMM's M and the
    step's few rows its N (CUTLASS picks its tile by the problem's shape; an experiment, not an engine path: M a
    multiple of 16)."""
    xq, sx = quantize_rows_fp8_reference(norm_input(x, nw, EPS))
    y = torch._scaled_mm(q, xq.T, s[:, None], sx.T, out_dtype=x.dtype).T
    return finish_output(y, "silu_mul" if silu else "none", r, name="scaled_mm_t")


def tile_path(x, q, s, nw, r, silu):
    """The FP8 Triton tile kernel at its default config, at any M (one row included: where K > the GEMV's bound)."""
    no = q.shape[0] // 2 if silu else q.shape[0]
    cfg = kernel.dl.default_config(x.shape[0], no, x.shape[1], silu, x.element_size())
    return kernel.fp8_decode_linear(x, q, s, None, nw, EPS, r, silu, cfg)


def bench_op(name: str, spec, m: int, args, compiled: dict) -> list[dict]:
    k, n, norm, res, silu = spec
    dev, dt = torch.device("cuda"), torch.bfloat16
    copies = max(2, -(-256 * 2**20 // (n * k)))
    torch.manual_seed(0)
    ws = [torch.randn(n, k, device=dev, dtype=dt) * k**-0.5 for _ in range(copies)]
    qs = [quantize_fp8_reference(w) for w in ws]
    x = torch.randn(m, k, device=dev, dtype=dt)
    nw = torch.rand(k, device=dev, dtype=dt) + 0.5 if norm else None
    r = torch.randn(m, n // 2 if silu else n, device=dev, dtype=dt) if res else None
    ref = torch_op(x, ws[0], nw, r, silu).float()
    base = dict(shape=args.model_shape, op=name, M=m, K=k, N=n)
    rows = []

    def add(path: str, fn, nbytes: int, config=None) -> None:
        try:
            err = ((fn(0).float() - ref).abs().max() / ref.abs().max()).item()
        except Exception as e:  # noqa: BLE001  a config that does not compile or fit is reported and skipped
            print(f"{name} M {m} {path} {config}: skipped ({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
            return
        us = common.time_graph(fn, copies, args.reps)
        rows.append(dict(base, path=path, config=config, us=us, GBps=nbytes / us / 1e3, rel_err_vs_bf16=err))

    fp8_bytes = n * k + 4 * n
    add("bf16", lambda i: compiled["bf16"](x, ws[i], nw, r, silu), 2 * n * k)
    if op.uses_gemv(m, k):
        no = n // 2 if silu else n
        configs = [None] + ([("gemv", *c) for c in GEMV_GRID] if args.gemv else [])
        for cfg in configs:
            add("gemv", lambda i, c=cfg: kernel.fp8_decode_linear(x, *qs[i], None, nw, EPS, r, silu, c), fp8_bytes,
                list(cfg or kernel.gemv_config(no, k, silu)) + ([] if cfg else ["default"]))  # fmt: skip
    add("tile", lambda i: tile_path(x, *qs[i], nw, r, silu), fp8_bytes)
    if op.tile_rows_impl(m, k, dt, "scaled_mm") == "scaled_mm":
        add("scaled_mm", lambda i: compiled["scaled_mm"](x, *qs[i], nw, r, silu), fp8_bytes)
        if m % 16 == 0:
            add("scaled_mm_t", lambda i: compiled["scaled_mm_t"](x, *qs[i], nw, r, silu), fp8_bytes)
    by = {row["path"]: row for row in rows if row.get("config") is None or "default" in row["config"]}
    best = min((row for row in rows if row["path"] != "bf16"), key=lambda row: row["us"], default=None)
    print(f"{name:8s} M {m:3d}: " + ", ".join(f"{p} {row['us']:7.2f} us" for p, row in by.items())
          + (f"; best FP8 {best['path']} {best['config']} {best['us']:.2f} us" if best else ""),
          file=sys.stderr, flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,16,64", help="comma list of M (a decode step's rows)")
    ap.add_argument("--ops", default="qkv,o,gate_up,down")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--gemv", action="store_true", help="at M = 1 also sweep the FP8 GEMV's configs (GEMV_GRID)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_linear.py needs CUDA (sm >= 8.9)")
    torch._dynamo.config.recompile_limit = 256  # one compile per (path, op, M)
    compiled = {
        name: torch.compile(fn, fullgraph=True, dynamic=False)
        for name, fn in (("bf16", torch_op), ("scaled_mm", scaled_mm_path), ("scaled_mm_t", scaled_mm_t_path))
    }
    table_ops = ops(args.model_shape)
    rows = []
    for name in args.ops.split(","):
        for m in (int(v) for v in args.rows.split(",")):
            rows += bench_op(name, table_ops[name], m, args, compiled)
    meta = common.run_metadata(
        torch.device("cuda"), dtype="torch.bfloat16", command=" ".join(sys.argv), args=vars(args)
    )
    print(f"\n{meta['device']}, torch {meta['torch']}, commit {meta['commit']}, {meta['date']}, {args.model_shape}\n")
    table = [[r["op"], r["M"], r["path"], "/".join(map(str, r["config"] or [])), f"{r['us']:.2f}", f"{r['GBps']:.0f}",
              f"{r['rel_err_vs_bf16']:.1e}"] for r in rows]  # fmt: skip
    common.print_markdown_table(["op", "M", "path", "config", "us", "GB/s (weights)", "rel err vs bf16"], table)
    if args.out:
        common.write_json(args.out, dict(meta=meta, rows=rows))


if __name__ == "__main__":
    main()
