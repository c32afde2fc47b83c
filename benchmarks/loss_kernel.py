"""Benchmark the LM-head logprob + entropy implementations: time, peak memory, TFLOP/s vs the matmul ceiling.

GPU (H200, bf16):  python benchmarks/loss_kernel.py --out benchmarks/results/loss_kernel.json
CPU smoke check:   python benchmarks/loss_kernel.py --device cpu --small

Implementations: naive torch (full [N, V] logits + log_softmax),
Liger's fused linear cross-entropy when `liger_kernel` imports (it computes CE only, no entropy, and its
gradients during the forward), ours (impl="triton", 4 GEMM passes for fwd+bwd), and the loss-fused variant
`fused_lm_head_loss` (kernels/lm_logprob/fused_loss.py, impl "torch" and "triton", 3 passes: gradients are
computed in the forward). Every impl is trained on the same loss, sum(lp * a + ent * b) with fixed random
per-token a and b (Liger: sum of cross-entropy). The loss-fused rows time "fwd" under torch.no_grad (logprob
and entropy only, 1 pass: what they do when no gradient is needed), and "fwd+bwd" as the fused call plus
backward. FLOPs count 2*N*H*V per GEMM pass: 1 pass for the forward, 3 for forward+backward, whatever an
implementation really recomputes. Peak memory is max_memory_allocated during the call minus the memory
allocated before it (inputs excluded, grads included). Accuracy on the first 256 tokens against the fp32
reference: max |lp error| and max |d hidden error| / max |d hidden| (d hidden of a token depends only on its
own row, so a 256-row reference gives the exact answer for those rows).

Shape legend: N tokens, H hidden size, V vocabulary size.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="tiny shapes (for a CPU check under the interpreter)")
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per measurement (median reported)")
    parser.add_argument(
        "--impls",
        default="naive,liger,triton,fused_torch,fused_triton",
        help="comma-separated subset to run",
    )
    parser.add_argument(
        "--fused-chunk-tokens",
        default="auto,4096,8192",
        help="fused_triton rows, one per entry: 'auto' (library defaults: <= 4096 tokens and C*V <= 2**30) or a"
        " chunk size in tokens (the C*V budget is raised to fit it)",
    )
    return parser.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prime_spmd.kernels.lm_logprob.fused_loss import fused_lm_head_loss  # noqa: E402
from prime_spmd.kernels.lm_logprob.op import lm_head_logprobs  # noqa: E402
from prime_spmd.kernels.lm_logprob.reference import reference_logprobs  # noqa: E402

from benchmarks import common  # noqa: E402


def naive_logprobs(hidden_NH, weight_VH, targets_N, temperature_N):
    logits_NV = (hidden_NH @ weight_VH.T).float() / temperature_N[:, None]
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return logp_NV.gather(1, targets_N[:, None]).squeeze(1), entropy_N


def weighted_token_loss(lp, ent, fields):
    """The benchmark's per-token loss: lp * a + ent * b (so every impl trains on the same objective)."""
    return lp * fields["grad_lp"] + ent * fields["grad_ent"]


def fused_impl(impl: str, chunk_tokens: int | None = None):
    """Loss-fused impl as (hidden, weight, targets, temperature, fields) -> (loss_sum, lp, ent).

    chunk_tokens None: the defaults (4096 tokens capped by TRITON_LOGITS_BUFFER_ELEMENTS); else exactly that chunk.
    """

    def run(h, w, t, temp, fields):
        kwargs = (
            {}
            if chunk_tokens is None
            else {"chunk_tokens": chunk_tokens, "max_logits_elements": chunk_tokens * w.shape[0]}
        )
        return fused_lm_head_loss(h, w, t, temp, weighted_token_loss, fields, impl=impl, **kwargs)

    return run


def build_impls(device: str) -> dict:
    """name -> (kind, fn). kind "logprobs": fn(h, w, t, temp) -> (lp, ent or None), or a CE loss scalar;
    kind "fused": fn(h, w, t, temp, fields) -> (loss_sum, lp, ent)."""
    impls = {
        "naive": ("naive torch", "logprobs", naive_logprobs),
        "triton": (
            "ours (triton, 4 passes)",
            "logprobs",
            lambda h, w, t, temp: lm_head_logprobs(h, w, t, temp, "triton"),
        ),
        "fused_torch": ("loss-fused (torch)", "fused", fused_impl("torch")),
    }
    for chunk in ARGS.fused_chunk_tokens.split(","):
        name, size = (
            ("loss-fused (triton)", None) if chunk == "auto" else (f"loss-fused (triton, C={chunk})", int(chunk))
        )
        impls[f"fused_triton_{chunk}"] = (name, "fused", fused_impl("triton", size))
    wanted = set(ARGS.impls.split(","))
    if "fused_triton" in wanted:
        wanted |= {key for key in impls if key.startswith("fused_triton_")}
    unknown = wanted - set(impls) - {"liger", "fused_triton"}
    if unknown:
        raise ValueError(f"--impls: unknown {sorted(unknown)}; choose from {sorted(set(impls) | {'liger'})}")
    out = {name: (kind, fn) for key, (name, kind, fn) in impls.items() if key in wanted}
    if "liger" in wanted and device == "cuda":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError as err:
            print(f"liger_kernel not importable ({err}); skipping Liger")
        else:
            liger_loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
            out["liger FLCE (CE only)"] = ("logprobs", lambda h, w, t, temp: (liger_loss(w, h, t), None))
    return out


def bench_shape(kind, impl, num_tokens, hidden_size, vocab, dtype, device, ceiling):
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = (torch.randn(num_tokens, hidden_size, device=device, generator=gen) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device=device, generator=gen) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), device=device, generator=gen)
    temperature = torch.ones(num_tokens, device=device)
    fields = {
        "grad_lp": torch.randn(num_tokens, device=device, generator=gen),
        "grad_ent": torch.randn(num_tokens, device=device, generator=gen) * 0.01,
    }

    if kind == "fused":

        def fwd():
            with torch.no_grad():
                return impl(hidden, weight, targets, temperature, fields)[1:]

        def fwd_bwd():
            return torch.autograd.grad(impl(hidden, weight, targets, temperature, fields)[0], (hidden, weight))

    else:

        def fwd():
            return impl(hidden, weight, targets, temperature)

        def fwd_bwd():
            logprob, entropy = fwd()
            if not logprob.dim():  # Liger: a CE loss scalar
                return torch.autograd.grad(logprob, (hidden, weight))
            loss = weighted_token_loss(logprob, entropy, fields).sum()
            return torch.autograd.grad(loss, (hidden, weight))

    flops = 2 * num_tokens * hidden_size * vocab
    row = {"N": num_tokens, "H": hidden_size, "V": vocab}
    try:
        row["fwd_ms"] = common.time_ms(fwd, device, ARGS.iters)
        row["fwd_peak_mib"] = common.peak_mib(fwd, device)
        row["fwd_bwd_ms"] = common.time_ms(fwd_bwd, device, ARGS.iters)
        row["fwd_bwd_peak_mib"] = common.peak_mib(fwd_bwd, device)
    except torch.cuda.OutOfMemoryError:
        row["error"] = "OOM"
        return row
    row["fwd_tflops"] = flops / (row["fwd_ms"] * 1e-3) / 1e12
    row["fwd_bwd_tflops"] = 3 * flops / (row["fwd_bwd_ms"] * 1e-3) / 1e12
    row["fwd_bwd_pct_ceiling"] = 100 * row["fwd_bwd_tflops"] / ceiling
    logprob = fwd()[0].detach()
    if logprob.dim():  # accuracy on the first 256 tokens against the fp32 reference
        rows = min(256, num_tokens)
        hidden_rows = hidden[:rows].detach().requires_grad_()
        want_lp, want_ent = reference_logprobs(hidden_rows, weight.detach(), targets[:rows], temperature[:rows])
        sub_fields = {k: v[:rows] for k, v in fields.items()}
        want_dh = torch.autograd.grad(weighted_token_loss(want_lp, want_ent, sub_fields).sum(), hidden_rows)[0]
        got_dh = fwd_bwd()[0][:rows].float()
        row["lp_max_abs_err"] = (logprob[:rows] - want_lp.detach()).abs().max().item()
        row["dh_rel_err"] = ((got_dh - want_dh.float()).abs().max() / want_dh.float().abs().max()).item()
    return row


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(results: list[dict], ceiling: float, dtype: torch.dtype) -> None:
    print(f"\n{dtype} matmul ceiling (8192^3 on GPU, 512^3 on CPU), this run: {ceiling:.3g} TFLOP/s\n")
    columns = ["N", "H", "impl", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s (3 passes)", "% ceiling"]
    columns += ["fwd peak MiB", "fwd+bwd peak MiB", "lp max abs err", "d hidden rel err"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["N"], r["H"], r["impl"], r["error"]] + [""] * (len(columns) - 4))
            continue
        rows.append([
            r["N"], r["H"], r["impl"], f"{r['fwd_ms']:.2f}", f"{r['fwd_tflops']:.3g}", f"{r['fwd_bwd_ms']:.2f}",
            f"{r['fwd_bwd_tflops']:.3g}", f"{r['fwd_bwd_pct_ceiling']:.3g}%", fmt(r["fwd_peak_mib"], ".0f"),
            fmt(r["fwd_bwd_peak_mib"], ".0f"), fmt(r.get("lp_max_abs_err"), ".1e"), fmt(r.get("dh_rel_err"), ".1e"),
        ])  # fmt: skip
    common.print_markdown_table(columns, rows)


def main() -> None:
    device = ARGS.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available; use --device cpu --small")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # bf16 matmul on CPU is slow and not the target
    if ARGS.small:
        shapes = [(n, h, 500) for n in (32, 64) for h in (32, 64)]
    else:
        shapes = [(n, h, 151936) for n in (4096, 16384) for h in (1024, 4096)]
    ceiling = common.matmul_ceiling_tflops(device, dtype, max(ARGS.iters, 20) if device == "cuda" else 3)
    impls = build_impls(device)
    results = []
    for num_tokens, hidden_size, vocab in shapes:
        for name, (kind, impl) in impls.items():
            row = bench_shape(kind, impl, num_tokens, hidden_size, vocab, dtype, device, ceiling)
            row["impl"] = name
            results.append(row)
            print(json.dumps(row), flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    print_table(results, ceiling, dtype)
    if ARGS.out is not None:
        meta = common.run_metadata(
            device, triton=__import__("triton").__version__, dtype=str(dtype), matmul_ceiling_tflops=ceiling
        )
        common.write_json(ARGS.out, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
