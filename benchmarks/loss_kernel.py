"""Benchmark the LM-head logprob + entropy implementations: time, peak memory, TFLOP/s vs the matmul ceiling.

GPU (H200, bf16):  python benchmarks/loss_kernel.py --out benchmarks/results/loss_kernel.json
CPU smoke check:   python benchmarks/loss_kernel.py --device cpu --small

Implementations: naive torch (full [N, V] logits + log_softmax), chunked torch (kernels/lm_logprob/chunked.py),
Liger's fused linear cross-entropy when `liger_kernel` imports (it computes CE only, no entropy, and its
gradients during the forward), and ours (impl="triton"). FLOPs count 2*N*H*V per GEMM pass: 1 pass for the
forward, 3 for forward+backward, whatever an implementation really recomputes. Peak memory is
max_memory_allocated during the call minus the memory allocated before it (inputs excluded, grads included).

Shape legend: N tokens, H hidden size, V vocabulary size.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="tiny shapes (for a CPU check under the interpreter)")
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per measurement (median reported)")
    parser.add_argument("--impls", default="naive,chunked,liger,triton", help="comma-separated subset to run")
    return parser.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.lm_logprob.chunked import chunked_logprobs  # noqa: E402
from kernels.lm_logprob.op import lm_head_logprobs  # noqa: E402
from kernels.lm_logprob.reference import reference_logprobs  # noqa: E402


def naive_logprobs(hidden_NH, weight_VH, targets_N, temperature_N):
    logits_NV = (hidden_NH @ weight_VH.T).float() / temperature_N[:, None]
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return logp_NV.gather(1, targets_N[:, None]).squeeze(1), entropy_N


def build_impls(device: str) -> dict:
    impls = {
        "naive torch": naive_logprobs,
        "chunked torch": chunked_logprobs,
        "ours (triton)": lambda h, w, t, temp: lm_head_logprobs(h, w, t, temp, impl="triton"),
    }
    wanted = set(ARGS.impls.split(","))
    names = {"naive torch": "naive", "chunked torch": "chunked", "ours (triton)": "triton"}
    impls = {k: v for k, v in impls.items() if names[k] in wanted}
    if "liger" in wanted and device == "cuda":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError as err:
            print(f"liger_kernel not importable ({err}); skipping Liger")
        else:
            liger_loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
            impls["liger FLCE (CE only)"] = lambda h, w, t, temp: (liger_loss(w, h, t), None)
    return impls


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device: str, iters: int) -> float:
    """Median wall time of fn() in ms (CUDA events on GPU)."""
    fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mib(fn, device: str) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def matmul_ceiling_tflops(device: str, dtype: torch.dtype) -> float:
    size = 8192 if device == "cuda" else 512
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, device, max(ARGS.iters, 20) if device == "cuda" else 3)
    return 2 * size**3 / (ms * 1e-3) / 1e12


def bench_shape(impl, num_tokens, hidden_size, vocab, dtype, device, ceiling):
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = (torch.randn(num_tokens, hidden_size, device=device, generator=gen) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device=device, generator=gen) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), device=device, generator=gen)
    temperature = torch.ones(num_tokens, device=device)
    grad_lp = torch.randn(num_tokens, device=device, generator=gen)
    grad_ent = torch.randn(num_tokens, device=device, generator=gen) * 0.01

    def fwd():
        return impl(hidden, weight, targets, temperature)

    def fwd_bwd():
        logprob, entropy = fwd()
        loss = (logprob * grad_lp).sum() if logprob.dim() else logprob
        if entropy is not None:
            loss = loss + (entropy * grad_ent).sum()
        return torch.autograd.grad(loss, (hidden, weight))

    flops = 2 * num_tokens * hidden_size * vocab
    row = {"N": num_tokens, "H": hidden_size, "V": vocab}
    try:
        row["fwd_ms"] = time_ms(fwd, device, ARGS.iters)
        row["fwd_peak_mib"] = peak_mib(fwd, device)
        row["fwd_bwd_ms"] = time_ms(fwd_bwd, device, ARGS.iters)
        row["fwd_bwd_peak_mib"] = peak_mib(fwd_bwd, device)
    except torch.cuda.OutOfMemoryError:
        row["error"] = "OOM"
        return row
    row["fwd_tflops"] = flops / (row["fwd_ms"] * 1e-3) / 1e12
    row["fwd_bwd_tflops"] = 3 * flops / (row["fwd_bwd_ms"] * 1e-3) / 1e12
    row["fwd_bwd_pct_ceiling"] = 100 * row["fwd_bwd_tflops"] / ceiling
    logprob = fwd()[0].detach()
    if logprob.dim():  # accuracy on the first 256 tokens against the fp32 reference
        rows = min(256, num_tokens)
        with torch.no_grad():
            want, _ = reference_logprobs(hidden[:rows], weight, targets[:rows], temperature[:rows])
        row["lp_max_abs_err"] = (logprob[:rows] - want).abs().max().item()
    return row


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(results: list[dict], ceiling: float, dtype: torch.dtype) -> None:
    print(f"\n{dtype} matmul ceiling (8192^3 on GPU, 512^3 on CPU), this run: {ceiling:.3g} TFLOP/s\n")
    print(
        "| N | H | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s (3 passes) | % ceiling"
        " | fwd peak MiB | fwd+bwd peak MiB | lp max abs err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['N']} | {r['H']} | {r['impl']} | {r['error']} |||||||")
            continue
        print(
            f"| {r['N']} | {r['H']} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.3g} | {r['fwd_bwd_ms']:.2f}"
            f" | {r['fwd_bwd_tflops']:.3g} | {r['fwd_bwd_pct_ceiling']:.3g}% | {fmt(r['fwd_peak_mib'], '.0f')}"
            f" | {fmt(r['fwd_bwd_peak_mib'], '.0f')} | {fmt(r.get('lp_max_abs_err'), '.1e')} |"
        )


def main() -> None:
    device = ARGS.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available; use --device cpu --small")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # bf16 matmul on CPU is slow and not the target
    if ARGS.small:
        shapes = [(n, h, 500) for n in (32, 64) for h in (32, 64)]
    else:
        shapes = [(n, h, 151936) for n in (4096, 16384) for h in (1024, 4096)]
    ceiling = matmul_ceiling_tflops(device, dtype)
    impls = build_impls(device)
    results = []
    for num_tokens, hidden_size, vocab in shapes:
        for name, impl in impls.items():
            row = bench_shape(impl, num_tokens, hidden_size, vocab, dtype, device, ceiling)
            row["impl"] = name
            results.append(row)
            print(json.dumps(row), flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    print_table(results, ceiling, dtype)
    if ARGS.out is not None:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        meta = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": commit or None,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "dtype": str(dtype),
            "matmul_ceiling_tflops": ceiling,
        }
        ARGS.out.parent.mkdir(parents=True, exist_ok=True)
        ARGS.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        print(f"wrote {ARGS.out}")


if __name__ == "__main__":
    main()
