"""The summary side of benchmarks/rl_e2e.py: metrics rows -> steps and evals, per-run rates and start-up split,
the sides' ratios to TRL, the learning comparison, and the plots (``rl_e2e.py --plot-only DIR`` redraws them;
``rl_e2e.py --merge OUT A.json B.json ...`` joins the sides of several calls into one results.json and plot)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


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
    # the engine's and the trainer's own rates (tokens over their phase's time), and the median step: a step that
    # meets a new input kind recompiles the trainer's blocks once (seconds) and moves the mean, not the median
    s["step_time_median_s"] = statistics.median(r["step_time_s"] for r in rows)
    if s["gen_time_s"]:
        s["gen_tokens_per_gen_s"] = mean("generated_tokens") / s["gen_time_s"]
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
        if first.get("engine_capture_s") is not None:  # the engine's CUDA-graph captures by the end of step 0
            out["graphs_captured_by_first_step_end"] = first.get("engine_graphs_captured")
            out["graph_capture_by_first_step_end_s"] = first["engine_capture_s"]
    if info:
        out["python_started_s"] = info.get("python_started_s")
        if "imports_done_s" in info:
            out["imports_done_s"] = info["imports_done_s"]
        for name, a, b in info.get("spans", []):
            out[f"{name}_s"] = out.get(f"{name}_s", 0.0) + (b - a)
            out.setdefault(f"{name}_starts_at_s", a)
    stacks = run.get("startup_stacks")
    if stacks and Path(stacks).is_file() and "time_to_first_step_s" in out:  # PRIME_BENCH_SAMPLE_S: where it went
        from benchmarks.stack_sampler import summarize

        out["profile_to_first_step"] = summarize(json.loads(Path(stacks).read_text()), 0.0, out["time_to_first_step_s"])
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
    held-out reward first reached TRL's final after a trained step (the step-0 eval of the SFT weights does not
    count: where TRL's final is below its start, the start would reach it at once), as a fraction of TRL's clock
    at its end, with ``trl_gained`` (TRL's mean margin > 0) beside it."""
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
                    t = next((e["clock_s"] for e in r["evals"]
                              if e["step"] > 0 and e["reward"] is not None and e["reward"] >= target), None)  # fmt: skip
                    hits.append(t)
            out[side].update(clock_s_to_trl_final=hits, trl_final_heldout=target, trl_clock_s_at_end=trl_end,
                             trl_gained=out["TRL GRPOTrainer"]["margin_mean"] > 0,
                             fraction_of_trl_time=[None if t is None else t / trl_end for t in hits])  # fmt: skip
    return out


def merge(out: Path, paths: list[Path]) -> dict:
    """One results.json (and its plots) in ``out`` from the results.json of several calls that each ran some sides
    from the same model (the GPU suite's ``SFT_REUSE=1``): their runs and summaries in the order given, the ratios
    and the learning comparison recomputed over all of them; meta from the first, with every file's commit and
    device. Files from different devices are refused: their timings do not compare."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    devices = {r["meta"]["device"] for r in parts}
    if len(devices) > 1:
        raise SystemExit(f"--merge: results from different devices ({sorted(devices)}) do not compare: {paths}")
    res = dict(meta=dict(parts[0]["meta"]), args=parts[0]["args"], phases={}, runs=[], summary=[])
    res["merged_from"] = [dict(file=str(p), commit=r["meta"].get("commit"), date=r["meta"].get("date"),
                               sides=[s["side"] for s in r["summary"]], sft_model=r["args"].get("sft_model"))
                          for p, r in zip(paths, parts)]  # fmt: skip
    for r in parts:
        res["runs"] += r["runs"]
        res["summary"] += r["summary"]
        for name, phase in r.get("phases", {}).items():
            res["phases"].setdefault(name, phase)
    res["ratios"] = ratios(res["summary"])
    res["learning"] = learning(res["runs"], res["summary"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(out)
    return res
