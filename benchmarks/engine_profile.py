"""Where a native-engine decode step's time goes: wall time per step vs GPU kernel time, kernel counts.

Runs the native engine on a random-weight model (same model as benchmarks/engine.py), warms it up,
then profiles ``--steps`` decode steps with torch.profiler and reports, per step: host wall time,
summed GPU kernel time, the number of kernels launched, and the top kernels. GPU busy < wall means
the step is bound by host work or launch gaps, not by the kernels.

    python benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.engine import SHAPES, build_model, prompts  # noqa: E402


def profile_batch(model, bs: int, args, device: torch.device, out_dir: Path | None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from prime_spmd.inference.engine import Request, SamplingParams
    from prime_spmd.inference.native import NativeEngine

    ids = prompts(bs, args.prompt_len, model.config.vocab_size)
    eng = NativeEngine(model, None, max_batch_size=bs, max_model_len=args.prompt_len + args.new_tokens, device=device)

    def requests():
        sp = dict(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True)
        return [Request(prompt_ids=p, sampling=SamplingParams(**sp, seed=i), request_id=i) for i, p in enumerate(ids)]

    eng.generate(requests())  # warm-up: graphs, compiles
    for r in requests():
        eng.add_request(r)
    eng.step()  # prefill + first decode
    for _ in range(4):
        eng.step()
    common.sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    common.sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step()
        common.sync(device)
    while eng.has_unfinished():
        eng.step()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kern = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    gpu_ms = sum(e.device_time for e in kern) / 1e3 / args.steps
    by_name: dict[str, list[float]] = {}
    for e in kern:
        by_name.setdefault(e.name, []).append(e.device_time)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    res = dict(
        batch=bs,
        wall_ms_per_step=wall_ms,
        gpu_kernel_ms_per_step=gpu_ms,
        kernels_per_step=len(kern) / args.steps,
        tok_s_decode=bs / wall_ms * 1e3,
        top=[dict(name=n[:120], calls_per_step=len(t) / args.steps, us_per_step=sum(t) / args.steps) for n, t in top],
    )
    if out_dir is not None:
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
        (out_dir / f"profile_b{bs}.txt").write_text(table)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-shape", default="qwen3-0.6b", choices=SHAPES)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out-dir", default="")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out_dir = Path(args.out_dir) if args.out_dir else None
    model = build_model(args.model_shape, args.prompt_len + args.new_tokens, device, dtype)
    results = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        r = profile_batch(model, bs, args, device, out_dir)
        results.append(r)
        print(
            f"batch {bs}: wall {r['wall_ms_per_step']:.3f} ms/step, GPU kernels {r['gpu_kernel_ms_per_step']:.3f} ms "
            f"({r['kernels_per_step']:.0f} kernels), decode {r['tok_s_decode']:.0f} tok/s",
            flush=True,
        )
        for t in r["top"][:12]:
            print(f"   {t['us_per_step']:9.1f} us  x{t['calls_per_step']:5.0f}  {t['name'][:90]}")
    meta = common.run_metadata(device, model_shape=args.model_shape, command=" ".join(sys.argv))
    if out_dir is not None:
        (out_dir / f"profile_{args.model_shape}.json").write_text(
            json.dumps(dict(meta=meta, results=results), indent=2)
        )


if __name__ == "__main__":
    main()
