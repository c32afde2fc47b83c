"""Benchmark a whole MoE layer (route, permute, gate/up GEMM + SwiGLU, down GEMM, weighted un-permute).

GPU (H200, bf16):  python benchmarks/moe.py --out benchmarks/results/moe.json
CPU smoke check:   python benchmarks/moe.py --device cpu --small
First use:         TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/moe.py --first_call --tokens 4096

Shapes: Qwen3-30B-A3B experts (D 2048, I 768, E 128, top-8) at 16k and 32k tokens. Routing:
``uniform`` (random router, near-balanced) and ``skewed`` (router bias -alpha*log(1+e): a few hot
experts, many nearly idle; max/mean expert load is reported). Impls: the per-expert loop (reference),
``torch._grouped_mm``, and ours (Triton). FLOPs: 6*M*D*I for the experts (M = T*K rows) plus
2*T*D*E for the router, times 3 for fwd+bwd (grads for x, router and expert weights).
Timing: CUDA events, median of --iters after a warmup. Before that, each row times its first fwd+bwd
(wall clock, compile included: ``first_fwd_bwd_s``, cold only in the first row of each config mode).
``--configs heuristic,autotune`` times ours with the default launch configs (kernels/moe/configs.py
TABLE) and with full autotuning, and records what the autotuner picked next to the table's row.
``--first_call``: only the first and second fwd+bwd of ours in this process (run it in a fresh process
with an empty TRITON_CACHE_DIR for the cold number).

Legend: T tokens, K top-k, D hidden, E experts, I expert intermediate.
"""

import time

PROCESS_START = time.perf_counter()  # before the heavy imports: first-call times count from here too

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU check under the Triton interpreter)")
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (median reported)")
    p.add_argument("--impls", default="reference,grouped_mm,triton", help="comma-separated subset")
    p.add_argument("--tokens", default="16384,32768", help="comma-separated token counts")
    p.add_argument("--skew_alpha", type=float, default=2.0, help="router bias -alpha*log(1+e) for skewed routing")
    p.add_argument(
        "--configs",
        default="heuristic",
        help="comma-separated launch-config modes for ours: heuristic (the default table), autotune (full sweep)",
    )
    p.add_argument("--first_call", action="store_true", help="time only ours' first and second fwd+bwd (see above)")
    return p.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prime_spmd.kernels.moe import configs, kernel  # noqa: E402
from prime_spmd.kernels.moe.op import moe_experts  # noqa: E402

from benchmarks import common  # noqa: E402

NAMES = {"reference": "per-expert loop", "grouped_mm": "torch._grouped_mm", "triton": "ours (triton)"}


def make_layer(T, D, E, inter, dtype, device, routing):
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, std):
        return (torch.randn(*shape, generator=gen) * std).to(device=device, dtype=dtype).requires_grad_()

    x = rand(T, D, std=1.0)
    router = rand(E, D, std=D**-0.5)
    bias = torch.zeros(E) if routing == "uniform" else -ARGS.skew_alpha * torch.log1p(torch.arange(E).float())
    bias = bias.to(device=device, dtype=torch.float32)
    w13 = rand(E, 2 * inter, D, std=D**-0.5)
    w2 = rand(E, D, inter, std=inter**-0.5)
    return x, router, bias, w13, w2


def moe_layer(x, router, bias, w13, w2, top_k, impl):
    """The whole layer: router softmax/top-k (norm_topk_prob) then the experts."""
    probs = torch.softmax(torch.nn.functional.linear(x, router).float() + bias, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    return moe_experts(x, ids, weights, w13, w2, impl=impl), ids


def bench(impl, T, D, E, inter, K, routing, dtype, device, ceiling, mode="heuristic") -> dict:
    configs.AUTOTUNE = mode == "autotune"
    x, router, bias, w13, w2 = make_layer(T, D, E, inter, dtype, device, routing)
    params = (x, router, w13, w2)
    with torch.no_grad():
        _, ids = moe_layer(x, router, bias, w13, w2, K, impl)
        load = torch.bincount(ids.flatten(), minlength=E).float()
    dout = torch.randn(T, D, device=device, dtype=dtype)

    def fwd():
        with torch.no_grad():
            moe_layer(x, router, bias, w13, w2, K, impl)

    def fwd_bwd():
        y, _ = moe_layer(x, router, bias, w13, w2, K, impl)
        torch.autograd.grad(y, params, dout)

    flops = 6 * T * K * D * inter + 2 * T * D * E
    name = NAMES[impl] + (", autotune" if impl == "triton" and mode == "autotune" else "")
    row = dict(impl=name, tokens=T, routing=routing, max_over_mean_load=(load.max() / load.mean()).item())
    if impl == "triton":
        row["configs"] = mode
    t0 = time.perf_counter()
    fwd_bwd()
    common.sync(device)
    row["first_fwd_bwd_s"] = time.perf_counter() - t0
    row["fwd_ms"] = common.time_ms(fwd, device, ARGS.iters)
    row["fwd_bwd_ms"] = common.time_ms(fwd_bwd, device, ARGS.iters)
    row["fwd_tflops"] = flops / (row["fwd_ms"] * 1e-3) / 1e12
    row["fwd_bwd_tflops"] = 3 * flops / (row["fwd_bwd_ms"] * 1e-3) / 1e12
    row["fwd_bwd_pct_ceiling"] = 100 * row["fwd_bwd_tflops"] / ceiling
    if device == "cuda":
        row["fwd_bwd_peak_mib"] = common.peak_mib(fwd_bwd, device)
    return row


def check_close(T, D, E, inter, K, dtype, device) -> None:
    """Sanity: each impl's forward agrees with the loop on one small batch before timing."""
    x, router, bias, w13, w2 = make_layer(min(T, 512), D, E, inter, dtype, device, "uniform")
    with torch.no_grad():
        ref = moe_layer(x, router, bias, w13, w2, K, "reference")[0].float()
        for impl in ARGS.impls.split(","):
            got = moe_layer(x, router, bias, w13, w2, K, impl)[0].float()
            rel = ((got - ref).abs().max() / ref.abs().max()).item()
            print(f"check {NAMES[impl]}: max rel diff vs loop {rel:.2e}")
            assert rel < 5e-2, impl


def config_report() -> dict:
    """The launch configs this process used: the table's picks, and each autotune key's winner next to the
    TABLE row that the same launch takes by default (what to copy into TABLE if the autotuner was faster)."""
    picks = [
        dict(kernel=k[0], N=k[1], K=k[2], MW=k[3], elem_bytes=k[5], config=configs.describe(c))
        for k, c in configs.PICKS.items()
    ]
    tuned = []
    for name, tuner in kernel.TUNED.items():
        for key, c in tuner.cache.items():
            N = key[1] if name == "grouped_wgrad" else key[0]  # keys: (MW, N, ...) / (N, K, ...), then dtypes
            wide = N >= configs.WIDE_N
            tuned.append(
                dict(kernel=name, key=[str(v) for v in key], table_row=[name, wide],
                     autotuned=configs.describe(c), table=configs.TABLE[(name, wide)])
            )  # fmt: skip
    print("launch configs (table picks, then autotune winners):")
    for entry in picks + tuned:
        print(" ", json.dumps(entry))
    return dict(heuristic_picks=picks, autotuned=tuned)


def first_call(T, D, E, inter, K, dtype, device) -> dict:
    """Wall time of ours' first fwd+bwd in this process (compile and any autotuning included) and of the
    second; uniform routing. Cold only in a fresh process with an empty TRITON_CACHE_DIR."""
    configs.AUTOTUNE = ARGS.configs.split(",")[0] == "autotune"
    x, router, bias, w13, w2 = make_layer(T, D, E, inter, dtype, device, "uniform")
    dout = torch.randn(T, D, device=device, dtype=dtype)
    common.sync(device)
    row = dict(tokens=T, configs="autotune" if configs.AUTOTUNE else "heuristic")
    row["triton_cache_dir"] = os.environ.get("TRITON_CACHE_DIR", "(default)")
    for which in ("first", "second"):
        t0 = time.perf_counter()
        y, _ = moe_layer(x, router, bias, w13, w2, K, "triton")
        torch.autograd.grad(y, (x, router, w13, w2), dout)
        common.sync(device)
        row[f"{which}_fwd_bwd_s"] = time.perf_counter() - t0
    row["process_start_to_end_of_first_s"] = time.perf_counter() - PROCESS_START - row["second_fwd_bwd_s"]
    print(json.dumps(row))
    row["launch_configs"] = config_report()
    return row


def main() -> None:
    device = ARGS.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if ARGS.small:
        D, E, inter, K, token_counts = 64, 8, 32, 2, [64]
    else:
        D, E, inter, K, token_counts = 2048, 128, 768, 8, [int(t) for t in ARGS.tokens.split(",")]
    modes = ARGS.configs.split(",")
    if bad := [m for m in modes if m not in ("heuristic", "autotune")]:
        raise ValueError(f"--configs: unknown mode(s) {bad}; choose heuristic and/or autotune")
    if ARGS.first_call:
        row = first_call(token_counts[0], D, E, inter, K, dtype, device)
        if ARGS.out:
            common.write_json(ARGS.out, dict(meta=common.run_metadata(device, dtype=str(dtype)), first_call=row))
        return
    ceiling = common.matmul_ceiling_tflops(device, dtype, 20 if device == "cuda" else 3)
    print(f"matmul ceiling ({common.matmul_size(device)}^3, {dtype}): {ceiling:.1f} TFLOP/s")
    check_close(token_counts[0], D, E, inter, K, dtype, device)
    results = []
    for T in token_counts:
        for routing in ("uniform", "skewed"):
            for impl in ARGS.impls.split(","):
                for mode in modes if impl == "triton" else ["heuristic"]:
                    row = bench(impl, T, D, E, inter, K, routing, dtype, device, ceiling, mode)
                    results.append(row)
                    print(json.dumps(row))
    launch_configs = config_report() if "triton" in ARGS.impls.split(",") else None
    columns = ["impl", "tokens", "routing", "max/mean load", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s"]
    table = [
        [r["impl"], r["tokens"], r["routing"], f"{r['max_over_mean_load']:.1f}", f"{r['fwd_ms']:.2f}",
         f"{r['fwd_tflops']:.0f}", f"{r['fwd_bwd_ms']:.2f}", f"{r['fwd_bwd_tflops']:.0f}", f"{r['fwd_bwd_pct_ceiling']:.0f}%"]
        for r in results
    ]  # fmt: skip
    print()
    common.print_markdown_table(columns + [f"% of {ceiling:.0f}"], table)
    for T in token_counts:
        for routing in ("uniform", "skewed"):
            by = {r["impl"]: r for r in results if r["tokens"] == T and r["routing"] == routing}
            if NAMES["triton"] in by and NAMES["grouped_mm"] in by:
                s = by[NAMES["grouped_mm"]]["fwd_bwd_ms"] / by[NAMES["triton"]]["fwd_bwd_ms"]
                print(f"speedup ours vs torch._grouped_mm, fwd+bwd, {T} tokens, {routing}: {s:.2f}x (goal >= 1.1x)")
            tuned = by.get(NAMES["triton"] + ", autotune")
            if NAMES["triton"] in by and tuned:
                fb, fw = (tuned[k] / by[NAMES["triton"]][k] for k in ("fwd_bwd_ms", "fwd_ms"))
                print(f"autotune ms / heuristic ms, {T} tokens, {routing}: fwd+bwd {fb:.3f}, fwd {fw:.3f}")
    for mode in modes:
        first = next((r for r in results if r.get("configs") == mode), None)
        if first:
            print(f"first fwd+bwd of ours in this process, {mode}: {first['first_fwd_bwd_s']:.1f} s")
    if ARGS.out:
        meta = common.run_metadata(
            device, dtype=str(dtype), matmul_ceiling_tflops=ceiling, shape=dict(D=D, E=E, I=inter, K=K)
        )
        common.write_json(ARGS.out, dict(meta=meta, results=results, launch_configs=launch_configs))


if __name__ == "__main__":
    main()
