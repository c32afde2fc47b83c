"""Where a native-engine decode step's time goes: wall time per step vs GPU kernel time, kernel counts.

Runs the native engine on a random-weight model (same model as benchmarks/engine.py), warms it up,
then profiles ``--steps`` engine steps (each one launch of ``decode_steps_per_launch`` decode steps, 4 by default with
CUDA graphs at small batch) with torch.profiler and reports, per engine step: host wall time,
summed GPU kernel time, the number of kernels launched, and the top kernels. GPU busy < wall means
the step is bound by host work or launch gaps, not by the kernels. Then one whole ``generate`` timed step by step
(``generate`` in the JSON: the first step with the prefill, the decode steps, the total), which splits the
end-to-end tokens/s of benchmarks/engine.py into prefill and decode.

    python benchmarks/engine_profile.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64 --out-dir $OUT

``--groups N``: also time the prefill of N prompts x ``--group-size`` samples (GRPO groups) with and
without prefill sharing (max_tokens ``--group-new-tokens``, default 1; median of 3), with the KV caches of ``--kv-cache`` (slot, paged): time,
tokens through the model, and the KV memory the sequences hold.
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
    from prime_spmd.inference.runner import prefill_choice

    ids = prompts(bs, args.prompt_len, model.config.vocab_size)
    eng = NativeEngine(
        model,
        None,
        max_batch_size=bs,
        max_model_len=args.prompt_len + args.new_tokens,
        device=device,
        decode_attention=args.decode_attention,
        sampler=args.sampler,
        kv_cache=args.profile_kv_cache,
        pdl=args.pdl == "on",
        prefill_layer_fn=prefill_choice(args.prefill),
        decode_steps_per_launch=args.decode_steps,
    )

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
    t0, tokens0 = time.perf_counter(), eng.num_generated_tokens
    for _ in range(args.steps):
        eng.step()
    common.sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    tokens_per_launch = (eng.num_generated_tokens - tokens0) / args.steps / bs  # decode steps a launch ran
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step()
        common.sync(device)
    while eng.has_unfinished():
        eng.step()
    phases = generate_phases(eng, requests(), device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kern = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    gpu_ms = sum(e.device_time for e in kern) / 1e3 / args.steps
    by_name: dict[str, list[float]] = {}
    for e in kern:
        by_name.setdefault(e.name, []).append(e.device_time)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    timeline = step_timeline(kern, args.steps)
    res = dict(
        batch=bs,
        generate=phases,
        wall_ms_per_step=wall_ms,
        gpu_kernel_ms_per_step=gpu_ms,
        kernels_per_step=len(kern) / args.steps,
        decode_steps_per_launch=tokens_per_launch,
        tok_s_decode=bs * tokens_per_launch / wall_ms * 1e3,
        top=[dict(name=n[:120], calls_per_step=len(t) / args.steps, us_per_step=sum(t) / args.steps) for n, t in top],
        gaps=timeline["gaps"],
    )
    if out_dir is not None:
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
        (out_dir / f"profile_b{bs}.txt").write_text(table)
        (out_dir / f"timeline_b{bs}.txt").write_text(timeline["text"])
    return res


def step_timeline(kern, steps: int) -> dict:
    """The kernels of one profiled step in launch order (the middle step: ``len(kern) // steps`` kernels from the
    middle one on), each with its start, duration and the idle gap since the previous kernel ended; and, over all
    profiled steps, the idle time before each kernel name summed per step (``gaps``: where launch gaps, not kernels,
    cost time; PDL kernels overlap the previous one's tail, so their gap can be negative)."""
    kern = sorted(kern, key=lambda e: e.time_range.start)
    per = max(1, len(kern) // max(1, steps))
    lines, gap_by_name = [], {}
    for i in range(1, len(kern)):
        gap = kern[i].time_range.start - kern[i - 1].time_range.end
        gap_by_name.setdefault(kern[i].name[:80], []).append(gap)
    mid = kern[(steps // 2) * per : (steps // 2 + 1) * per]
    t0 = mid[0].time_range.start if mid else 0
    prev_end = None
    for e in mid:
        gap = 0.0 if prev_end is None else e.time_range.start - prev_end
        lines.append(f"{e.time_range.start - t0:9.1f} {e.device_time:7.1f} gap {gap:6.1f}  {e.name[:100]}")
        prev_end = e.time_range.end
    total_gap = sum(max(0.0, g) for gs in gap_by_name.values() for g in gs) / max(1, steps)
    gaps = sorted(
        (
            dict(name=n, calls_per_step=len(g) / steps, idle_us_per_step=sum(max(0.0, x) for x in g) / steps)
            for n, g in gap_by_name.items()
        ),
        key=lambda d: -d["idle_us_per_step"],
    )[:20]
    text = f"idle between kernels: {total_gap:.1f} us a step\n" + "\n".join(lines) + "\n"
    return dict(gaps=dict(idle_us_per_step=total_gap, by_kernel=gaps), text=text)


def generate_phases(eng, reqs, device: torch.device) -> dict:
    """One whole ``generate`` of ``reqs`` (graphs already captured), timed step by step from the host: the first
    ``step`` (admission + prefill + the first decode launch), the later steps (median, and their sum; the last
    ones drain the steps already launched), and the total, so an end-to-end tokens/s (benchmarks/engine.py) can be split
    into prefill and decode. A step's time is host time between returns: with the engine one step ahead, the GPU
    time of step t is paid in the step that waits for it."""
    common.sync(device)
    t0 = time.perf_counter()
    for r in reqs:
        eng.add_request(r)
    marks = []
    while eng.has_unfinished():
        eng.step()
        marks.append(time.perf_counter())
    common.sync(device)
    end = time.perf_counter()
    steps = [b - a for a, b in zip([t0] + marks[:-1], marks, strict=True)]
    decode = sorted(steps[1:]) or [0.0]
    tokens = sum(r.sampling.max_tokens for r in reqs)
    res = dict(
        steps=len(steps),
        first_step_ms=steps[0] * 1e3,
        decode_step_median_ms=decode[len(decode) // 2] * 1e3,
        decode_steps_sum_ms=sum(steps[1:]) * 1e3,
        total_ms=(end - t0) * 1e3,
        tok_s=tokens / (end - t0),
    )
    print(
        f"generate: {res['steps']} steps, first (prefill) {res['first_step_ms']:.2f} ms, decode steps median "
        f"{res['decode_step_median_ms']:.3f} ms (sum {res['decode_steps_sum_ms']:.1f} ms), total {res['total_ms']:.1f} "
        f"ms, {res['tok_s']:.0f} tok/s",
        flush=True,
    )
    return res


def measure_prefill_sharing(model, args, device: torch.device) -> list[dict]:
    """Prefill of ``--groups`` prompts x ``--group-size`` samples (max_tokens ``--group-new-tokens``), shared vs not,
    for each KV cache of ``--kv-cache``. KV held: the slot cache holds a whole slot per sequence; the paged cache,
    its peak blocks in use (with max_tokens 1 a prefill chunk's sequences finish and free their blocks before the
    next chunk is admitted: give a few new tokens to hold every sequence at once)."""
    from prime_spmd.inference.engine import Request, SamplingParams
    from prime_spmd.inference.native import NativeEngine

    n = args.groups * args.group_size
    base = prompts(args.groups, args.group_prompt_len, model.config.vocab_size)
    rows = []
    sp = dict(temperature=1.0, max_tokens=args.group_new_tokens, ignore_eos=True)
    max_len = args.group_prompt_len + max(8, args.group_new_tokens)
    for kv_cache in args.kv_cache.split(","):
        for share in (False, True):
            eng = NativeEngine(
                model,
                None,
                max_batch_size=n,
                max_model_len=max_len,
                device=device,
                share_prefill=share,
                kv_cache=kv_cache,
            )
            reqs = lambda: [  # noqa: E731
                Request(prompt_ids=base[i // args.group_size], sampling=SamplingParams(**sp, seed=i), request_id=i)
                for i in range(n)
            ]
            eng.generate(reqs())
            eng.num_prefill_tokens = eng.num_prompt_tokens = 0
            times = []
            for _ in range(3):
                common.sync(device)
                t0 = time.perf_counter()
                eng.generate(reqs())
                common.sync(device)
                times.append(time.perf_counter() - t0)
            secs = sorted(times)[1]
            kv_tok = eng.runner.cache.nbytes_per_token()
            stats = eng.kv_cache_stats()
            held = stats.get("kv_peak_bytes_in_use", n * max_len * kv_tok)
            rows.append(
                dict(
                    kv_cache=kv_cache,
                    share_prefill=share,
                    requests=n,
                    group_size=args.group_size,
                    prompt_len=args.group_prompt_len,
                    seconds=secs,
                    prompt_tok_s=n * args.group_prompt_len / secs,
                    model_prefill_tokens=eng.num_prefill_tokens // 3,
                    kv_written_by_prefill_GiB=eng.num_prefill_tokens // 3 * kv_tok / 2**30,
                    kv_held_GiB=held / 2**30,
                    kv_allocated_GiB=stats["kv_bytes_allocated"] / 2**30,
                )
            )
            r = rows[-1]
            print(
                f"prefill {kv_cache} share={share}: {r['prompt_tok_s']:.0f} prompt tok/s ({secs * 1e3:.1f} ms), model "
                f"ran {r['model_prefill_tokens']} tokens, KV written {r['kv_written_by_prefill_GiB']:.3f} GiB, held "
                f"{r['kv_held_GiB']:.3f} GiB, allocated {r['kv_allocated_GiB']:.3f} GiB",
                flush=True,
            )
            del eng
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-shape", default="qwen3-0.6b", choices=SHAPES)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out-dir", default="")
    ap.add_argument("--decode-attention", default="auto", help="decode profile: the engine's attention")
    ap.add_argument("--sampler", default="auto", help="decode profile: the engine's sampler")
    ap.add_argument("--profile-kv-cache", default="slot", help="decode profile: the engine's KV cache")
    common.add_on_off(ap, "--pdl", "decode profile: PDL (kernels/pdl)")
    ap.add_argument(
        "--prefill", default="auto", choices=["auto", "layer_fn", "modules"], help="decode profile: the prefill path"
    )
    ap.add_argument(
        "--decode-steps", type=int, default=0, help="decode profile: decode steps a launch (0: auto, 4 with graphs)"
    )
    ap.add_argument("--groups", type=int, default=0, help="prefill-sharing measurement: prompts (0: skip)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--group-prompt-len", type=int, default=1024)
    ap.add_argument("--group-new-tokens", type=int, default=1, help="prefill-sharing measurement: max_tokens")
    ap.add_argument("--kv-cache", default="slot", help="prefill-sharing measurement: comma list of slot, paged")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out_dir = Path(args.out_dir) if args.out_dir else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(args.model_shape, args.prompt_len + args.new_tokens, device, dtype)
    results = []
    sharing = measure_prefill_sharing(model, args, device) if args.groups else []
    for bs in [int(b) for b in args.batch_sizes.split(",") if b]:
        r = profile_batch(model, bs, args, device, out_dir)
        results.append(r)
        print(
            f"batch {bs}: wall {r['wall_ms_per_step']:.3f} ms/step ({r['decode_steps_per_launch']:.1f} decode steps a "
            f"launch), GPU kernels {r['gpu_kernel_ms_per_step']:.3f} ms ({r['kernels_per_step']:.0f} kernels), decode "
            f"{r['tok_s_decode']:.0f} tok/s",
            flush=True,
        )
        for t in r["top"][:12]:
            print(f"   {t['us_per_step']:9.1f} us  x{t['calls_per_step']:5.0f}  {t['name'][:90]}")
        print(f"  idle between kernels {r['gaps']['idle_us_per_step']:.1f} us a step; before:")
        for g in r["gaps"]["by_kernel"][:10]:
            print(f"   {g['idle_us_per_step']:9.1f} us  x{g['calls_per_step']:5.0f}  {g['name']}")
    meta = common.run_metadata(device, model_shape=args.model_shape, command=" ".join(sys.argv))
    if out_dir is not None:
        (out_dir / f"profile_{args.model_shape}.json").write_text(
            json.dumps(dict(meta=meta, results=results, prefill_sharing=sharing), indent=2)
        )


if __name__ == "__main__":
    main()
