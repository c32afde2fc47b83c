"""First-use costs of one RL step at the Qwen3-0.6B shape: where the native engine's and the trainer's
warm-up time goes, cold and with warm compile caches.

Issue 18's run 1 (docs/benchmarks.md) lost its first RL step to 23.7 s of warm-up (generate 16.3 s, train
7.4 s). This probe times each first-use cost separately, each part in its own fresh process (as
``prime_spmd rl`` and ``prime_spmd eval`` run in benchmarks/rl_e2e.py), twice: ``cold`` with empty
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, then ``warm`` in a second process on the same two dirs.
TRITON_CACHE_AUTOTUNING=1 also keeps the Triton autotuner's choices there (Triton versions that read it).

- ``engine:custom`` (our Qwen3 through ``load_model``, what ``rl`` and ``eval`` run) and ``engine:hf``
  (transformers' Qwen3, benchmarks/engine.py's model; ``fused_decode`` in the JSON says whether the
  runner's fused decode layer, torch.compiled on CUDA, served it):
  ``NativeEngine`` construction; then the RL pattern, 16 prompts x 8 samples (--prompt-len tokens,
  shared prefill) with up to --new-tokens tokens: request i may generate ``new_tokens - i * new_tokens //
  rows`` tokens (at least 1), so the running slots shrink and every batch bucket is touched once (a
  trained model's stops touch them in some order too); then the same requests again (warm); then a new
  engine of --eval-slots slots and the eval pattern (64 prompts x 4 samples), twice. Before each second
  generate, ``load_weights`` with the model's own weights (what the RL loop's weight sync calls). Per phase: wall
  time, the first prefill and the first decode step of each (rows, length, sampler flags) bucket (on
  CUDA, its CUDA-graph capture: two warm-up runs, which compile, then the capture), and torch._dynamo's
  counters and compile times (``unique_graphs``: graphs compiled; ``recompiles``: the "Recompiling
  function" lines that TORCH_LOGS=recompiles writes to the worker's log, each with its failed guard).
  The requests ignore eos, so their lengths are as set.
- ``trainer``: our Qwen3 in bf16 (no FSDP: one device, no collectives), ``PolicyModel`` with the trainer's
  loss impl (``auto``: the loss-fused Triton kernels on CUDA, the reference on CPU) and the DPPO loss,
  forward + backward on one packed row of --train-tokens tokens (documents of prompt + new tokens),
  calls 1 and 2; then twice at ~2x the tokens (the loss kernels' autotuner keys on tokens rounded to a
  power of two, so a new size can re-tune); the first and second fused AdamW step.

Every phase is synchronized before and after (the times include the kernels). The workers run with
``TORCH_LOGS=recompiles``; their logs and JSON go beside --out, which is rewritten after each worker.
The script asserts nothing about timings.

    python benchmarks/engine_warmup.py --device cuda --budget-s 150 --out $OUT/engine_warmup.json
    python benchmarks/engine_warmup.py --device cpu --shape tiny --out /tmp/warmup.json      # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
PARTS = ("engine:custom", "engine:hf", "trainer")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="qwen3-0.6b", help="benchmarks/engine.py shape (qwen3-0.6b; tiny on CPU)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--prompts", type=int, default=16, help="RL pattern: distinct prompts")
    p.add_argument("--group-size", type=int, default=8, help="RL pattern: samples per prompt")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (the digit task's chat prompts)")
    p.add_argument("--new-tokens", type=int, default=20)
    p.add_argument("--max-model-len", type=int, default=128, help="the RL engine's KV length (--trainer.seq_len)")
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--eval-slots", type=int, default=64, help="configs/reverse_text/eval.toml max_batch_size")
    p.add_argument("--train-tokens", type=int, default=1024)
    p.add_argument("--worker-limit-s", type=float, default=150, help="time limit of each worker process")
    p.add_argument(
        "--budget-s",
        type=float,
        default=float("inf"),
        help="wall-clock budget of all workers: each worker's limit is cut to what is left, none under 15 s",
    )
    p.add_argument("--cache-dir", type=Path, help="keep the compile caches here (default: a fresh temp dir)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args()


# ---- worker side ---------------------------------------------------------------------------------------
class Clock:
    """Synchronized wall times of named phases, in seconds."""

    def __init__(self, device) -> None:
        self.device, self.times = device, {}

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time(self, name: str, fn):
        self.sync()
        t = time.perf_counter()
        out = fn()
        self.sync()
        self.times[name] = time.perf_counter() - t
        return out


def dynamo_counters() -> dict:
    """torch._dynamo's counters as plain dicts, ``unique_graphs`` (graphs compiled so far) at the top level,
    and ``compile_times_s``: seconds per timed compile phase, summed (torch._dynamo.utils.compile_times)."""
    from torch._dynamo.utils import compile_times, counters

    c = {k: dict(v) for k, v in counters.items() if v}
    c["unique_graphs"] = c.get("stats", {}).get("unique_graphs", 0)
    names, values = compile_times(repr="csv", aggregate=True)
    c["compile_times_s"] = {k: float(v) for k, v in zip(names, values)}
    return c


def instrument(engine, clock: Clock) -> dict:
    """Time ``engine``'s prefills and each decode bucket's first step (CUDA: its graph capture) in place."""
    log: dict = {"prefill_s": [], "first_decode_s": {}}

    def timed(fn, record):
        def wrapper(*a):
            clock.sync()
            t = time.perf_counter()
            out = fn(*a)
            clock.sync()
            record(a, time.perf_counter() - t)
            return out

        return wrapper

    engine._prefill = timed(engine._prefill, lambda a, s: log["prefill_s"].append(s))

    def first(a, s):
        log["first_decode_s"].setdefault(",".join(str(int(x)) for x in a), s)

    if engine.use_graphs:
        engine._capture = timed(engine._capture, first)
    else:
        engine._decode_step = timed(engine._decode_step, first)
    return log


def requests(num_prompts: int, samples: int, prompt_len: int, new_tokens: int, vocab: int, seed: int) -> list:
    from benchmarks.engine import prompts
    from prime_spmd.inference.engine import Request, SamplingParams

    ids = prompts(num_prompts + seed, prompt_len, vocab)[seed:]
    rows = num_prompts * samples
    out = []
    for i in range(rows):
        n = max(1, new_tokens - i * new_tokens // rows)
        sp = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i)
        out.append(Request(prompt_ids=ids[i // samples], sampling=sp, request_id=i))
    return out


def engine_pattern(engine, reqs: list, clock: Clock, name: str, res: dict) -> None:
    """Generate ``reqs`` twice in ``engine``, a weight load between (as the RL loop's weight sync does
    between batches); record wall times, per-bucket first steps and compile counters."""
    log = instrument(engine, clock)
    for call in ("first", "second"):
        if call == "second":
            weights = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]
            clock.time(f"{name}_load_weights", lambda w=weights: engine.load_weights(w))
        before = dynamo_counters()["unique_graphs"]
        outs = clock.time(f"{name}_generate_{call}", lambda: engine.generate(list(reqs)))
        assert sum(len(o.token_ids) for o in outs) == sum(r.sampling.max_tokens for r in reqs)
        res[f"{name}_new_graphs_{call}"] = dynamo_counters()["unique_graphs"] - before
    res[f"{name}_first_prefill_s"] = log["prefill_s"][0]
    res[f"{name}_prefill_s"] = log["prefill_s"]
    res[f"{name}_first_decode_s"] = log["first_decode_s"]
    res[f"{name}_generated_tokens"] = sum(r.sampling.max_tokens for r in reqs)


def worker_engine(impl: str, args: argparse.Namespace, clock: Clock, res: dict) -> None:
    import torch

    from benchmarks.engine import build_model
    from prime_spmd.inference.native import NativeEngine

    device = clock.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_len = args.max_model_len
    model = clock.time("build_model", lambda: build_model(args.shape, max_len, device, dtype))
    if impl == "custom":  # our Qwen3 through load_model, the path `prime_spmd rl` and `eval` take; same weights
        from prime_spmd.config.sections import ModelConfig
        from prime_spmd.models.loading import load_model

        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            del model
            model = clock.time("load_custom", lambda: load_model(ModelConfig(path=d, impl="custom"), device, dtype))
        model.eval()
    vocab = model.args.vocab_size if hasattr(model, "args") else model.config.vocab_size
    n_rl = args.prompts * args.group_size
    eng = clock.time("engine_init_rl", lambda: NativeEngine(model, None, max_batch_size=n_rl, max_model_len=max_len))
    res["model_class"] = type(model).__name__
    res["fused_decode"] = getattr(eng.runner, "layer_args", None) is not None  # runner.py's fused decode layer
    res["decode_attention"] = getattr(eng.runner, "attention", None)
    res["cuda_graphs"] = eng.use_graphs
    rl = requests(args.prompts, args.group_size, args.prompt_len, args.new_tokens, vocab, seed=0)
    engine_pattern(eng, rl, clock, "rl", res)
    eval_len = args.prompt_len + args.new_tokens + 1  # eval.py: longest prompt + max_tokens + 1
    del eng
    eng = clock.time(
        "engine_init_eval", lambda: NativeEngine(model, None, max_batch_size=args.eval_slots, max_model_len=eval_len)
    )
    ev = requests(args.eval_prompts, args.eval_samples, args.prompt_len, args.new_tokens, vocab, seed=1)
    engine_pattern(eng, ev, clock, "eval", res)


def worker_trainer(args: argparse.Namespace, clock: Clock, res: dict) -> None:
    import torch

    from benchmarks.engine import build_model as build_hf
    from prime_spmd.config.rl_sections import LossConfig
    from prime_spmd.config.sections import ModelConfig
    from prime_spmd.models.loading import load_model
    from prime_spmd.rl.loss import make_rl_loss
    from prime_spmd.trainer.policy import PolicyModel, resolve_loss_impl

    device = clock.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as d:  # our Qwen3 through load_model, as build_trainer loads it
        build_hf(args.shape, args.max_model_len, device, dtype).save_pretrained(d)
        lm = clock.time("load_custom", lambda: load_model(ModelConfig(path=d, impl="custom"), device, dtype))
    vocab = lm.args.vocab_size
    impl = resolve_loss_impl("auto", device)
    policy = PolicyModel(lm, impl)
    res["loss_impl"] = impl
    loss = make_rl_loss(LossConfig())
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-6, betas=(0.9, 0.95), fused=device.type == "cuda")
    doc = args.prompt_len + args.new_tokens
    g = torch.Generator().manual_seed(0)

    def batch(num_tokens: int):
        n = max(1, num_tokens // doc) * doc
        ids = torch.randint(0, vocab, (1, n), generator=g)
        pos = (torch.arange(n) % doc)[None]
        fields = dict(advantages=torch.randn(n, generator=g), inference_logprobs=-torch.rand(n, generator=g) * 5,
                      loss_mask=(pos[0] >= args.prompt_len).float())  # fmt: skip
        return [x.to(device) for x in (ids, pos, ids[0].roll(-1))], {k: v.to(device) for k, v in fields.items()}

    def fwd_bwd(b):
        (ids, pos, targets), fields = b
        loss_sum = policy(ids, pos, targets, 1.0, loss, fields).loss_sum
        loss_sum.backward()

    small, large = batch(args.train_tokens), batch(2 * args.train_tokens)
    res["train_tokens"] = [small[0][0].shape[1], large[0][0].shape[1]]
    for name, b in (("fwd_bwd_1", small), ("fwd_bwd_2", small), ("fwd_bwd_2x_1", large), ("fwd_bwd_2x_2", large)):
        clock.time(name, lambda b=b: fwd_bwd(b))
        if name == "fwd_bwd_1":
            clock.time("adamw_1", opt.step)
        if name == "fwd_bwd_2":
            clock.time("adamw_2", opt.step)
        opt.zero_grad(set_to_none=True)


def worker(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.init()
    clock = Clock(device)
    res: dict = dict(part=args.worker, import_s=time.perf_counter() - T_START)
    if args.worker == "trainer":
        worker_trainer(args, clock, res)
    else:
        worker_engine(args.worker.split(":")[1], args, clock, res)
    res["times_s"] = clock.times
    res["dynamo_counters"] = dynamo_counters()
    if device.type == "cuda":
        res["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["process_s"] = time.perf_counter() - T_START
    args.worker_out.write_text(json.dumps(res, indent=1) + "\n")


# ---- orchestrator --------------------------------------------------------------------------------------
def run_part(part: str, cache: Path, state: str, args: argparse.Namespace, limit: float) -> dict:
    """One worker process on ``cache`` (per part, so that each part's cold pass is cold), ``limit`` s at most."""
    out = args.out.parent / f"{args.out.stem}_{part.replace(':', '_')}_{state}"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
           "TORCH_LOGS": "recompiles", "TRITON_CACHE_AUTOTUNING": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    if args.device == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")
    fwd = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
           if v is not None and k not in ("out", "worker", "worker_out", "cache_dir", "parts", "budget_s")]  # fmt: skip
    cmd = [sys.executable, str(Path(__file__).resolve()), *fwd, f"--out={args.out}", f"--worker={part}",
           f"--worker-out={out}.json"]  # fmt: skip
    t = time.perf_counter()
    with open(f"{out}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=limit).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.perf_counter() - t
    res = json.loads(Path(f"{out}.json").read_text()) if rc == 0 else {"part": part}
    # TORCH_LOGS=recompiles prints one "Recompiling function" line per recompile, with the guard that failed
    recompiles = Path(f"{out}.log").read_text(errors="replace").count("Recompiling function")
    res.update(cache=state, rc=rc, wall_s=wall, log=f"{out}.log", recompiles=recompiles)
    print(f"[engine_warmup] {summary_line(res)}", flush=True)
    return res


def summary_line(r: dict) -> str:
    if r["rc"] != 0:
        return f"{r['part']:14s} {r['cache']:4s}: rc {r['rc']} (see {r['log']})"
    t = r["times_s"]
    if r["part"] == "trainer":
        keys = ("fwd_bwd_1", "fwd_bwd_2", "fwd_bwd_2x_1", "fwd_bwd_2x_2", "adamw_1", "adamw_2")
        body = ", ".join(f"{k} {t[k]:.2f}" for k in keys)
    else:
        caps = r["rl_first_decode_s"]
        body = (f"init {t['engine_init_rl']:.2f}, first prefill {r['rl_first_prefill_s']:.2f}, RL generate "
                f"{t['rl_generate_first']:.2f}, load_weights {t['rl_load_weights']:.2f}, again {t['rl_generate_second']:.2f} "
                f"({len(caps)} buckets, "
                f"{sum(caps.values()):.2f} s in their first steps), eval generate {t['eval_generate_first']:.2f} "
                f"then {t['eval_generate_second']:.2f}, graphs {r['dynamo_counters']['unique_graphs']}, "
                f"recompiles {r['recompiles']}")  # fmt: skip
    return f"{r['part']:14s} {r['cache']:4s}: process {r['process_s']:.1f} s (imports {r['import_s']:.1f}); {body}"


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    parts = args.parts.split(",")
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SystemExit(f"--parts: unknown {bad}; choose from {list(PARTS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget_s
    root = args.cache_dir or Path(tempfile.mkdtemp(prefix="engine_warmup_cache_"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    meta = dict(date=time.strftime("%Y-%m-%d"), commit=commit.stdout.strip() or None, command=" ".join(sys.argv),
                args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, cache_root=str(root))  # fmt: skip
    results = []
    for part in parts:
        cache = root / part.replace(":", "_")
        for state in ("cold", "warm"):
            limit = min(args.worker_limit_s, deadline - time.perf_counter())
            if limit < 15:
                print(f"[engine_warmup] {part} {state}: skipped, {limit:.0f} s of --budget-s left", flush=True)
                continue
            results.append(run_part(part, cache, state, args, limit))
            args.out.write_text(json.dumps(dict(meta=meta, results=results), indent=1) + "\n")  # kept if cut short
    print(f"[engine_warmup] wrote {args.out}")


if __name__ == "__main__":
    main()
