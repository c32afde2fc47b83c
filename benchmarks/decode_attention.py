"""Decode attention alone: the bmm path (as compiled in the engine's decode layer) vs the Triton kernel.

One "step" is one attention call per layer over each layer's own cache, captured in a CUDA graph
(as the engine replays it), timed over replays. Reports us per layer and the bandwidth over the
bytes a step must read (each row's own K/V positions, not the bucket), for a sweep of the kernel's
tile / warps / stages / splits. Shapes default to Qwen3-0.6B (16 q heads, 8 kv heads, Dh 128,
28 layers), bf16, rows at length ``--len`` in a cache bucket of ``--bucket`` positions.

``--block-size Sb`` also times the paged kernel (``kernel.paged_decode_attention``) on the same K/V, moved into
pools [L, Nb, Nkv, Sb, Dh] (one tensor for all layers, as the engine's) in a random block order, so no row's
blocks are contiguous; each config is timed for the slot and the paged layout (rows ``triton`` and
``triton-paged``), kernel alone. Nothing is asserted about the times.

Legend (docs/conventions.md): B rows, N query heads, Nkv kv heads, Dh head dim, Bc cache slots, Tc positions
per slot, Nb pool blocks, Sb positions per block, Mb table entries per row; local letter of this file (as in
prime_spmd/inference/runner.py): Tkv the positions the bmm path reads (``--bucket``, Tkv <= Tc). Each layer's
cache here has Bc = B slots and Tc = Tkv positions; its pool Nb = B * Mb blocks, Mb = ceil(Tkv / Sb).

    python benchmarks/decode_attention.py --batch-sizes 1,64,256 --out decode_attention.json
    python benchmarks/decode_attention.py --batch-sizes 1,64,256 --block-size 16 --sweep default
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prime_spmd.kernels.decode_attention import kernel  # noqa: E402

from benchmarks import common  # noqa: E402


def bmm_attention(q_BNDh, k_BcNkvTcDh, v_BcNkvTcDh, mask_BTkv, scale: float):
    """The engine's bmm path (runner.make_decode_layer), alone: o [B, N, Dh]."""
    b, n, dh = q_BNDh.shape
    nkv, tkv = k_BcNkvTcDh.shape[1], mask_BTkv.shape[1]
    kc, vc = k_BcNkvTcDh[:b, :, :tkv], v_BcNkvTcDh[:b, :, :tkv]  # [B, Nkv, Tkv, Dh] views
    scores = torch.matmul(q_BNDh.view(b, nkv, n // nkv, dh), kc.transpose(-1, -2)).float() * scale
    p = torch.softmax(scores + mask_BTkv[:, None, None], dim=-1).to(vc.dtype)
    return torch.matmul(p, vc).reshape(b, n, dh)


def bench_batch(b: int, args: argparse.Namespace, bmm) -> list[dict]:
    """The bmm path and each kernel config at batch ``b``: us per layer, GB/s, error vs bmm."""
    dev, dt = torch.device(args.device), torch.bfloat16
    n, nkv, dh, tkv = args.heads, args.kv_heads, args.head_dim, args.bucket
    scale = dh**-0.5
    torch.manual_seed(0)
    # per layer: k/v_BcNkvTcDh [B, Nkv, Tkv, Dh] (Bc = B, Tc = Tkv)
    ks = [torch.randn(b, nkv, tkv, dh, device=dev, dtype=dt) for _ in range(args.layers)]
    vs = [torch.randn(b, nkv, tkv, dh, device=dev, dtype=dt) for _ in range(args.layers)]
    q_BNDh = torch.randn(b, n, dh, device=dev, dtype=dt)
    lens_B = torch.full((b,), args.len, device=dev, dtype=torch.long)
    visible = torch.arange(tkv, device=dev)[None] < lens_B[:, None]
    mask_BTkv = torch.zeros(b, tkv, device=dev).masked_fill(~visible, float("-inf"))
    need_bytes = 2 * b * nkv * args.len * dh * 2  # K and V of each row's own positions
    ref = bmm(q_BNDh, ks[0], vs[0], mask_BTkv, scale)
    us = common.time_graph(lambda li: bmm(q_BNDh, ks[li], vs[li], mask_BTkv, scale), args.layers, args.reps)
    rows = [dict(batch=b, impl="bmm", us_per_layer=us, GBps=need_bytes / us / 1e3)]
    bn0 = kernel.default_block_tc(dh)
    auto = kernel.pick_num_splits(b, nkv, tkv, dev, bn0)
    configs = [(bn0, 4, 2, 0)]
    if args.sweep == "full":
        configs += [(t, w, 2, 0) for t, w in itertools.product((32, 64, 128), (4, 8))] + [(bn0, 4, 3, 0)]
        configs += [(bn0, 4, 2, n) for n in sorted({1, 2, 4, 8, 2 * auto} - {auto})]
    layouts = {"triton": functools.partial(_triton_layer, q_BNDh, ks, vs)}
    if args.block_size:
        k_pool, v_pool, table_BcMb = _to_pools(ks, vs, args.block_size)
        layouts["triton-paged"] = functools.partial(_paged_layer, q_BNDh, k_pool, v_pool, table_BcMb)
    for tile, warps, stages, ns in dict.fromkeys(configs):
        for impl, layer in layouts.items():
            run = functools.partial(layer, lens_B, tkv, scale, ns, warps, stages, tile)
            err = ((run(0).float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            us = common.time_graph(run, args.layers, args.reps)
            splits = ns or kernel.pick_num_splits(b, nkv, tkv, dev, tile)
            rows.append(
                dict(batch=b, impl=impl, tile=tile, warps=warps, stages=stages, splits=splits,
                     block_size=args.block_size if impl == "triton-paged" else 0,
                     us_per_layer=us, GBps=need_bytes / us / 1e3, rel_err_vs_bmm=err)
            )  # fmt: skip
            print(f"b {b:4d} {impl:12s} tile {tile:3d} w {warps} s {stages} splits {splits:2d}: {us:7.2f} us",
                  file=sys.stderr)  # fmt: skip
    return rows


def _to_pools(ks, vs, sb: int):
    """Each layer's slot cache [B, Nkv, Tkv, Dh] moved into pools k/v_LNbNkvSbDh [L, Nb, Nkv, Sb, Dh] (Nb = B * Mb)
    in one random block order shared by the layers, and its table int32 [B, Mb]: row b's blocks are scattered
    over the pool, so the paged kernel reads the same K/V as the slot one, from non-contiguous blocks."""
    b, nkv, tkv, dh = ks[0].shape
    mb = -(-tkv // sb)
    perm = torch.randperm(b * mb, generator=torch.Generator().manual_seed(0)).to(ks[0].device)

    def pool(caches):
        out = torch.empty(len(caches), b * mb, nkv, sb, dh, device=caches[0].device, dtype=caches[0].dtype)
        for li, c_BNkvTkvDh in enumerate(caches):
            c_BNkvMbSbDh = torch.nn.functional.pad(c_BNkvTkvDh, (0, 0, 0, mb * sb - tkv)).view(b, nkv, mb, sb, dh)
            out[li, perm] = c_BNkvMbSbDh.transpose(1, 2).reshape(b * mb, nkv, sb, dh)
        return out

    return pool(ks), pool(vs), perm.view(b, mb).to(torch.int32)


def _triton_layer(q_BNDh, ks, vs, lens_B, tkv, scale, ns, warps, stages, tile, li):
    return kernel.decode_attention(
        q_BNDh, ks[li], vs[li], lens_B, tkv, scale, ns, num_warps=warps, num_stages=stages, tile=tile
    )


def _paged_layer(q_BNDh, k_LNbNkvSbDh, v_LNbNkvSbDh, table_BcMb, lens_B, tkv, scale, ns, warps, stages, tile, li):
    return kernel.paged_decode_attention(
        q_BNDh, k_LNbNkvSbDh[li], v_LNbNkvSbDh[li], table_BcMb, lens_B, tkv, scale, ns,
        num_warps=warps, num_stages=stages, tile=tile,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--len", type=int, default=256, help="positions each row attends")
    ap.add_argument("--bucket", type=int, default=384, help="cache length the bmm path reads (the engine's bucket)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", default="full", choices=["full", "default"])
    ap.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="also time the paged kernel with blocks of this many positions (0: no)",
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    bmm = torch.compile(bmm_attention, fullgraph=True, dynamic=False)
    rows = [r for b in args.batch_sizes.split(",") for r in bench_batch(int(b), args, bmm)]
    dev = torch.device(args.device)
    meta = common.run_metadata(dev, dtype="torch.bfloat16", command=" ".join(sys.argv), args=vars(args))
    print(f"\n{meta['device']}, torch {meta['torch']}, commit {meta['commit']}, {meta['date']}")
    print(
        f"N {args.heads}, Nkv {args.kv_heads}, Dh {args.head_dim}, rows at length {args.len} in a {args.bucket} bucket, "
        f"{args.layers} layers per graph\n"
    )
    table = []
    for r in rows:
        cfg = "-" if r["impl"] == "bmm" else f"{r['tile']}/{r['warps']}/{r['stages']}/{r['splits']}"
        if r.get("block_size"):
            cfg += f", Sb {r['block_size']}"
        err = f"{r['rel_err_vs_bmm']:.1e}" if "rel_err_vs_bmm" in r else "-"
        table.append([r["batch"], r["impl"], cfg, f"{r['us_per_layer']:.2f}", f"{r['GBps']:.0f}", err])
    common.print_markdown_table(["batch", "impl", "tile/warps/stages/splits", "us/layer", "GB/s", "rel err"], table)
    if args.out:
        common.write_json(args.out, dict(meta=meta, rows=rows))


if __name__ == "__main__":
    main()
