"""Decode linears alone: the engine's torch ops (compiled, as in its decode layer) vs the fused Triton kernel.

The four linears of a decoder layer at a decode step's M rows, each with what the kernel folds in:
qkv (RMSNorm + GEMM), o (GEMM + residual), gate_up (RMSNorm + GEMM + SiLU-gate), down (GEMM + residual).
Each op runs over ``copies`` distinct weight copies (together > 256 MB, so weights come from HBM, not
L2, as in a real step), captured in one CUDA graph, median over replays. Reports us per op and the
bandwidth over its weight bytes (what bounds decode), for the kernel's default config and, with
``--sweep full``, a grid of (BLOCK_N, BLOCK_K, warps, stages); ``--gemv`` adds, at M = 1, a grid of the
one-row GEMV kernel's (BLOCK_N, BLOCK_K, warps); plus the best config found per op and M. The default config is
what the engine runs (the GEMV kernel at one row, kernel.GEMV_MAX_ROWS); the tile kernel's default runs too.

Legend (docs/conventions.md, kernels/decode_linear/reference.py): M rows, K in, N out features of w.

    python benchmarks/decode_linear.py --model-shape qwen3-0.6b --rows 1,4,16,64 --out decode_linear.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prime_spmd.kernels.decode_linear import kernel  # noqa: E402

from benchmarks import common  # noqa: E402
from prime_spmd.models.common.norm import rms_norm  # noqa: E402

# hidden D, q heads x head dim, kv heads x head dim, intermediate I (the Qwen3 configs of benchmarks/engine.py)
SHAPES = {"qwen3-0.6b": (1024, 16 * 128, 8 * 128, 3072), "qwen3-8b": (4096, 32 * 128, 8 * 128, 12288)}
EPS = 1e-6


def ops(shape: str) -> dict[str, tuple[int, int, bool, bool, bool]]:
    """name -> (K, N, norm, residual, silu_mul) for one layer of ``shape``."""
    d, nq, nkv, inter = SHAPES[shape]
    return {
        "qkv": (d, nq + 2 * nkv, True, False, False),
        "o": (nq, d, False, True, False),
        "gate_up": (d, 2 * inter, True, False, True),
        "down": (inter, d, False, True, False),
    }


def torch_op(x, w, norm_w, residual, silu_mul: bool):
    """The engine's unfused ops for one linear (runner.make_decode_layer, torch linears)."""
    h = rms_norm(x, norm_w, EPS) if norm_w is not None else x
    y = F.linear(h, w)
    if silu_mul:
        inter = y.shape[1] // 2
        y = F.silu(y[:, :inter]) * y[:, inter:]
    return residual + y if residual is not None else y


def bench_op(name: str, spec, m: int, args, compiled) -> list[dict]:
    k, n, norm, res, silu = spec
    dev, dt = torch.device(args.device), torch.bfloat16
    w_bytes = n * k * 2
    copies = max(2, -(-256 * 2**20 // w_bytes)) if dev.type == "cuda" else 2
    torch.manual_seed(0)
    ws = [torch.randn(n, k, device=dev, dtype=dt) * k**-0.5 for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=dt)
    nw = torch.rand(k, device=dev, dtype=dt) + 0.5 if norm else None
    r = torch.randn(m, n // 2 if silu else n, device=dev, dtype=dt) if res else None
    ref = torch_op(x, ws[0], nw, r, silu)
    us = common.time_graph(lambda i: compiled(x, ws[i], nw, r, silu), copies, args.reps)
    base = dict(shape=args.model_shape, op=name, M=m, K=k, N=n)
    rows = [dict(base, impl="torch", us=us, GBps=w_bytes / us / 1e3)]
    no = n // 2 if silu else n
    tiles = kernel.default_config(m, no, k, silu, 2)
    default = kernel.gemv_config(no, k, silu) if kernel.uses_gemv(m, k) else tiles
    configs = [default, tiles]
    if m == 1 and args.gemv:  # the one-row kernel's (BLOCK_N, BLOCK_K, warps)
        configs += [("gemv", bn, bk, wp) for bn in (2, 4, 8, 16) for bk in (512, 1024) for wp in (2, 4)]
    if args.sweep == "full":
        bm = default[0]
        grid = itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 4))
        configs += [(bm, bn, bk, wp, st) for bn, bk, wp, st in grid]
    for cfg in dict.fromkeys(configs):

        def run(i, cfg=cfg):
            return kernel.decode_linear(x, ws[i], None, nw, EPS, r, silu, config=cfg)

        try:
            out0 = run(0)
        except triton.runtime.errors.OutOfResources as e:  # these tiles x stages do not fit in shared memory
            print(f"{name} M {m} config {cfg}: skipped ({e})", file=sys.stderr)
            continue
        err = ((out0.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        us = common.time_graph(run, copies, args.reps)
        rows.append(dict(base, impl="triton", config=list(cfg), default=cfg == default, us=us,
                         GBps=w_bytes / us / 1e3, rel_err_vs_torch=err))  # fmt: skip
    best = min(rows[1:], key=lambda row: row["us"])
    print(f"{name:8s} M {m:3d}: torch {rows[0]['us']:7.2f} us, triton default {rows[1]['us']:7.2f} us, "
          f"best {best['us']:7.2f} us {best['config']}", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,4,16,64", help="comma list of M (a decode step's rows)")
    ap.add_argument("--ops", default="qkv,o,gate_up,down")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", default="full", choices=["full", "default"])
    ap.add_argument("--gemv", action="store_true", help="at M = 1 also sweep the GEMV kernel's configs")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64  # the torch baseline compiles once per (op, M)
    if args.device == "cpu":  # a smoke run under TRITON_INTERPRET=1: tiny shapes
        SHAPES[args.model_shape] = (64, 64, 32, 96)
    table_ops = ops(args.model_shape)
    bad = [o for o in args.ops.split(",") if o not in table_ops]
    if bad:
        raise SystemExit(f"--ops: unknown {bad}; choose from {list(table_ops)}")
    compiled = torch.compile(torch_op, fullgraph=True, dynamic=False) if args.device == "cuda" else torch_op
    rows = []
    for name in args.ops.split(","):
        for m in (int(v) for v in args.rows.split(",")):
            rows += bench_op(name, table_ops[name], m, args, compiled)
    dev = torch.device(args.device)
    meta = common.run_metadata(dev, dtype="torch.bfloat16", command=" ".join(sys.argv), args=vars(args))
    print(f"\n{meta['device']}, torch {meta['torch']}, commit {meta['commit']}, {meta['date']}, {args.model_shape}\n")
    table = []
    for (op, m), group in itertools.groupby(rows, key=lambda row: (row["op"], row["M"])):
        group = list(group)
        t, d = group[0], next((row for row in group if row.get("default")), None)
        if d is None:  # the default did not fit (skipped above): a bug in default_config
            d = dict(us=float("nan"), GBps=float("nan"), rel_err_vs_torch=float("nan"))
        best = min(group[1:], key=lambda row: row["us"])
        table.append([op, m, f"{t['us']:.2f}", f"{t['GBps']:.0f}", f"{d['us']:.2f}", f"{d['GBps']:.0f}",
                      f"{best['us']:.2f}", "/".join(map(str, best["config"])), f"{d['rel_err_vs_torch']:.1e}"])  # fmt: skip
    cols = ["op", "M", "torch us", "torch GB/s", "triton us", "triton GB/s", "best us", "best BM/BN/BK/w/s", "rel err"]
    common.print_markdown_table(cols, table)
    if args.out:
        common.write_json(args.out, dict(meta=meta, rows=rows))


if __name__ == "__main__":
    main()
