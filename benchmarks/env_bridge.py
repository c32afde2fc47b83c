"""Rollouts/s through the verifiers bridge vs the engine called directly with the same prompts.

N concurrent single-turn rollouts of a classic ``vf.SingleTurnEnv`` (N/group_size examples x
group_size samples) on the native engine, against ``engine.generate`` on the same rendered prompts
with the same per-request seeds. Sides, interleaved in every repeat so that machine noise hits them
alike:

- ``direct``: ``engine.generate(requests)``, one call, one batch;
- ``bridge``: ``VerifiersEnvironment.run_groups``: verifiers' ``run_group`` per example, the engine stepped
  inside the event loop (``AsyncEngine``).

The bridge side also scores (one cheap reward function) and convert to ``Rollout``s.
``--lengths fixed``: greedy + ignore_eos, every rollout generates exactly max_tokens tokens.
``--lengths varied``: temperature 1 with a set of stop token ids sized so that completions end at
geometric lengths (mean ~0.43 x max_tokens), as EOS does in RL; both sides sample the same tokens.

    python benchmarks/env_bridge.py                      # CPU: qwen3-nano, 32 tokens, N=64
    python benchmarks/env_bridge.py --device cuda --preset qwen3-0.6b --max-tokens 32,128 \\
        --lengths fixed,varied --out results/env_bridge.json

Presets: the tiny CPU ones of prime_spmd/models/tiny.py (character tokenizer vocab) and the dense
shapes of prime_spmd.models.qwen3.FLAVORS (random weights, full 151,936 vocab; the character
tokenizer decodes only its own ~100 ids, so text is short while token ids stay exact).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from prime_spmd.inference.engine import Completion, InferenceEngine, Request  # noqa: E402


def build_env(num_examples: int):
    import verifiers as vf
    from datasets import Dataset

    ds = Dataset.from_list(
        [{"question": f"Reverse the word number {i}: abcdefgh", "answer": "hgfedcba"} for i in range(num_examples)]
    )

    def reward(completion, answer) -> float:
        return float(answer in (completion[-1].content or ""))

    return vf.SingleTurnEnv(dataset=ds, rubric=vf.Rubric(funcs=[reward]))


def build_model(preset: str, device: torch.device, dtype: torch.dtype, max_len: int):
    """Random-weight Qwen3 of ``preset`` on ``device`` in ``dtype`` and the character tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from prime_spmd.models.qwen3 import FLAVORS
    from prime_spmd.models.tiny import PRESETS, build_char_tokenizer, tiny_qwen3_config

    tokenizer = build_char_tokenizer()
    special = dict(
        max_position_embeddings=max(max_len, 512),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if preset in PRESETS:
        config = tiny_qwen3_config(preset, vocab_size=len(tokenizer), **special)
    elif preset in FLAVORS and FLAVORS[preset]["model_type"] == "qwen3":
        config = AutoConfig.for_model(**FLAVORS[preset], **special)
    else:
        dense = [k for k, v in FLAVORS.items() if v["model_type"] == "qwen3"]
        raise ValueError(f"--preset {preset!r}: choose one of {sorted(PRESETS)} or {dense}")
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), tokenizer


class ZeroCostEngine(InferenceEngine):
    """``--engine zero``: an engine whose step costs ~nothing (every request finishes in one step with
    ``max_tokens`` ids drawn from its seed), so a bridge side's time is its fixed Python cost alone."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len, self.vocab_size = tokenizer, max_model_len, len(tokenizer)
        self.device = torch.device("cpu")
        self.queue: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.queue.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[Completion]:
        out = []
        for r in self.queue:
            rng = random.Random(r.sampling.seed)
            ids = [rng.randrange(4, self.vocab_size) for _ in range(r.sampling.max_tokens)]
            lps = [-1.0] * len(ids)
            out.append(
                Completion(
                    request_id=r.request_id,
                    prompt_ids=r.prompt_ids,
                    token_ids=ids,
                    logprobs=lps,
                    finish_reason="length",
                )
            )
        self.queue = []
        return out

    def load_weights(self, weights) -> None:
        raise NotImplementedError

    def reset_cache(self) -> None:
        pass


def sampling_for(lengths: str, max_tokens: int, vocab_size: int):
    from prime_spmd.inference.engine import SamplingParams

    if lengths == "fixed":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # p(stop) per token ~ 2 / max_tokens under a random model's near-uniform distribution
    num_stop = max(1, 2 * vocab_size // max_tokens)
    stop = list(range(vocab_size - num_stop, vocab_size))
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop)


def run_config(engine, env, args, max_tokens: int, lengths: str) -> dict[str, Any]:
    """Time every side ``args.repeats`` times (interleaved) for one (max_tokens, lengths) setting."""
    import dataclasses

    from prime_spmd.envs.verifiers_bridge import VerifiersEnvironment, sample_seed
    from prime_spmd.envs.vf_client import turn_seed

    sp = sampling_for(lengths, max_tokens, engine.vocab_size)
    num_examples = args.n // args.group_size
    ids = list(range(num_examples))
    keys = [(e, k) for e in ids for k in range(args.group_size)]
    prompts = [engine.render_chat(env.example("train", e)["prompt"]) for e, _ in keys]
    # The bridge seeds request (example e, sample k, turn 0) so; the direct side uses the same seeds.
    seeds = [turn_seed(sample_seed(0, e, k), 0) for e, k in keys]
    bridge_env = VerifiersEnvironment(env.vf_env, name="bench")

    def direct() -> list[list[int]]:
        reqs = [
            Request(prompt_ids=p, sampling=dataclasses.replace(sp, seed=s), request_id=i)
            for i, (p, s) in enumerate(zip(prompts, seeds))
        ]
        return [c.token_ids for c in engine.generate(reqs)]

    def through(e) -> list[list[int]]:
        groups = e.run_groups(engine, "train", ids, args.group_size, sp, seed=0)
        return [r.completion_ids for g in groups for r in g]

    fns = {"direct": direct, "bridge": lambda: through(bridge_env)}
    outs = {name: fn() for name, fn in fns.items()}  # warm-up; also the token check
    same = {name: sum(a == b for a, b in zip(outs["direct"], o)) for name, o in outs.items()}
    tokens = {name: sum(map(len, o)) for name, o in outs.items()}
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            common.sync(engine.device)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            common.sync(engine.device)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    result: dict[str, Any] = dict(max_tokens=max_tokens, lengths=lengths, sides={})
    for name in fns:
        best, med = min(wall[name]), statistics.median(wall[name])
        result["sides"][name] = dict(
            wall_s=wall[name],
            cpu_s=cpu[name],
            best_s=best,
            median_s=med,
            rollouts_per_s_best=args.n / best,
            rollouts_per_s_median=args.n / med,
            overhead_best=best / min(wall["direct"]) - 1,
            overhead_median=med / statistics.median(wall["direct"]) - 1,
            completion_tokens=tokens[name],
            identical_to_direct=same[name],
        )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=64, help="concurrent rollouts")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", default="32", help="comma-separated completion lengths")
    p.add_argument("--lengths", default="fixed", help="comma-separated: fixed, varied (see module doc)")
    p.add_argument("--preset", default="qwen3-nano", help="tiny preset (CPU) or a dense FLAVORS name")
    p.add_argument("--device", default="cpu")
    p.add_argument("--engine", default="native", choices=("native", "zero"), help="zero: see ZeroCostEngine")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: 1 on cpu)")
    p.add_argument("--out", default=None, help="write the results and run metadata as JSON here")
    args = p.parse_args()

    from prime_spmd.envs.verifiers_bridge import VerifiersEnvironment
    from prime_spmd.inference.engine import SamplingParams
    from prime_spmd.inference.native import NativeEngine

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if common.is_cuda(device) else "float32"))
    threads = args.threads if args.threads is not None else (0 if common.is_cuda(device) else 1)
    if threads > 0:
        torch.set_num_threads(threads)
    max_tokens = [int(x) for x in args.max_tokens.split(",")]
    lengths = args.lengths.split(",")
    max_len = 64 + max(max_tokens)  # prompts here render to ~55 tokens
    if args.engine == "zero":
        from prime_spmd.models.tiny import build_char_tokenizer

        engine = ZeroCostEngine(build_char_tokenizer(), max_len)
    else:
        model, tokenizer = build_model(args.preset, device, dtype, max_len)
        engine = NativeEngine(
            model, tokenizer, max_batch_size=args.n, max_model_len=max_len, device=device, cuda_graphs=True
        )
    env = VerifiersEnvironment(build_env(args.n // args.group_size), name="bench")
    # CUDA graphs: capture every batch bucket now, not inside a timed run (no-op work on CPU).
    if common.is_cuda(device) and args.engine == "native":
        b = 1
        while b <= args.n:
            sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            engine.generate([Request(prompt_ids=[1, 2, 3], sampling=sp, request_id=i) for i in range(b)])
            b *= 2
    results = []
    for mt in max_tokens:
        for ln in lengths:
            r = run_config(engine, env, args, mt, ln)
            results.append(r)
            d = r["sides"]["direct"]
            print(f"\nmax_tokens={mt} lengths={ln} N={args.n}: {d['completion_tokens']} completion tokens (direct)")
            for name, s in r["sides"].items():
                print(
                    f"  {name:14s} {s['rollouts_per_s_best']:8.1f} rollouts/s best ({s['best_s'] * 1e3:7.1f} ms), "
                    f"median {s['median_s'] * 1e3:7.1f} ms; overhead {100 * s['overhead_best']:+6.1f}% best, "
                    f"{100 * s['overhead_median']:+6.1f}% median; identical to direct {s['identical_to_direct']}/{args.n}, "
                    f"{s['completion_tokens']} tokens"
                )
    if args.out:
        meta = common.run_metadata(
            device,
            dtype=str(dtype).removeprefix("torch."),
            preset=args.preset,
            engine=args.engine,
            n=args.n,
            group_size=args.group_size,
            repeats=args.repeats,
            torch_threads=torch.get_num_threads(),
        )
        common.write_json(args.out, dict(meta=meta, results=results))


if __name__ == "__main__":
    main()
