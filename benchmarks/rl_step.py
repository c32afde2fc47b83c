"""Steps/s of the RL job at max_async k = 0 and k = 1 in disjoint mode, and their ratio.

Runs ``torchrun -m prime_spmd rl`` twice (1 trainer rank + 1 inference rank by default) on the
same model, config and seed, and reads ``step_time_s`` from each run's metrics.jsonl (the
controller's wall time per step: waiting for the batch, training, weight sync). The first
``--warmup`` steps are left out. With k = 1 generation of batch j+1 overlaps training of step j,
so the ratio should exceed 1 when both take comparable time.

    python benchmarks/rl_step.py                       # CPU, tiny model, writes a markdown table
    python benchmarks/rl_step.py --device cuda --nproc 2 --preset qwen3-1m --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(k: int, args: argparse.Namespace, model: Path, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
        "-m", "prime_spmd", "rl",
        "--config", str(ROOT / "configs/reverse_text/rl.toml"),
        "--output_dir", str(out),
        "--model.path", str(model),
        "--trainer.max_steps", str(args.steps),
        "--rollout.max_async", str(k),
        "--rollout.prompts_per_step", str(args.prompts),
        "--rollout.group_size", str(args.group_size),
        "--trainer.batch_size", str(args.prompts * args.group_size),
        "--sampling.max_tokens", str(args.max_tokens),
        "--trainer.seq_len", str(args.seq_len),
        "--inference.max_batch_size", str(args.prompts * args.group_size),
        "--topology.num_inference_ranks", str(args.nproc // 2),
        "--topology.backend", "nccl" if args.device == "cuda" else "gloo",
        "--ckpt.interval_steps", "0", "--ckpt.no_save_hf", "--log.no_plots", "--log.no_progress",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL if args.quiet else None)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[args.warmup :]
    total = sum(r["step_time_s"] for r in timed)
    return {
        "k": k,
        "steps_per_s": len(timed) / total,
        "gen_time_s": sum(r["gen_time_s"] for r in timed) / len(timed),
        "train_time_s": sum(r["train_time_s"] for r in timed) / len(timed),
        "weight_sync_s": sum(r["weight_sync_s"] for r in timed) / len(timed),
        "wait_s": sum(r["wait_s"] for r in timed) / len(timed),
        "reward_last": rows[-1]["reward_mean"],
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--nproc", type=int, default=2, help="ranks; half train, half infer")
    p.add_argument("--preset", default="qwen3-micro", help="tiny model preset (prime_spmd.models.tiny.PRESETS)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from prime_spmd.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", args.preset, seed=0, initializer_range=0.3)
        results = [run(k, args, model, Path(tmp) / f"k{k}") for k in (0, 1)]
    ratio = results[1]["steps_per_s"] / results[0]["steps_per_s"]
    print(
        f"\nRL step throughput, disjoint ({args.nproc // 2} trainer + {args.nproc - args.nproc // 2} inference ranks), "
        f"{args.device}, preset {args.preset}, {args.prompts}x{args.group_size} samples, {args.max_tokens} new tokens\n"
    )
    print("| max_async | steps/s | gen s/step | train s/step | sync s/step | wait s/step |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['k']} | {r['steps_per_s']:.3f} | {r['gen_time_s']:.3f} | {r['train_time_s']:.3f} | "
            f"{r['weight_sync_s']:.4f} | {r['wait_s']:.3f} |"
        )
    print(f"\nratio k=1 / k=0: {ratio:.2f}x  ({platform.node()}, {platform.processor() or platform.machine()})")
    if args.out:
        args.out.write_text(
            json.dumps({"results": results, "ratio": ratio, "args": vars(args) | {"out": str(args.out)}}, indent=1)
        )


if __name__ == "__main__":
    main()
