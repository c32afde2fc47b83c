"""Do our engine's samples score like transformers' ``generate`` on the same model and prompts? (issue 18)

Reverse-text eval prompts (the built-in environment's), ``--samples`` completions each at temperature 1 with no
top-k/top-p, scored with the environment's reward (LCS ratio) and exact match, by the native engine and by
``model.generate(do_sample=True, top_k=0)`` (what TRL's GRPOTrainer calls). The two means should agree within
their standard errors; a gap means the engine samples a different distribution than the model's.

    python benchmarks/sample_parity.py --model /tmp/e2e/sft/hf                       # CPU, the demo SFT model
    python3 benchmarks/sample_parity.py --model DIR --device cuda --dtype bfloat16 --env-args alphabet 0123456789 min_chars 8 max_chars 16

It asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="HF-format model dir with its tokenizer")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=16, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--env-args", nargs="*", default=[], help="reverse_text env args as key value pairs")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    return p.parse_args(argv)


def _summary(rewards: list[float], exact: list[float]) -> dict:
    n = len(rewards)
    return dict(
        n=n,
        reward=statistics.fmean(rewards),
        reward_se=statistics.pstdev(rewards) / n**0.5,
        exact=statistics.fmean(exact),
        exact_se=statistics.pstdev(exact) / n**0.5,
    )


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_spmd.data.reverse_text import lcs_ratio
    from prime_spmd.envs.base import completion_text, end_token_ids
    from prime_spmd.envs.reverse_text import ReverseTextEnv
    from prime_spmd.inference.engine import Request, SamplingParams
    from prime_spmd.inference.native import NativeEngine

    args = parse_args(argv)
    if len(args.env_args) % 2:
        raise SystemExit(f"--env-args needs key value pairs, got {args.env_args}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(str(args.model))
    env = ReverseTextEnv(
        seed=0, num_eval_examples=args.prompts, args=dict(zip(args.env_args[::2], args.env_args[1::2]))
    )
    examples = [env.example("eval", i) for i in range(args.prompts)]
    prompts = []
    for ex in examples:
        ids = tok.apply_chat_template(ex["prompt"], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    ends = end_token_ids(tok)
    max_len = max(map(len, prompts)) + args.max_tokens

    def score(i: int, token_ids: list[int]) -> tuple[float, float]:
        text = completion_text(tok, token_ids, ends)
        return lcs_ratio(examples[i]["answer"], text), float(text == examples[i]["answer"])

    def load():
        return AutoModelForCausalLM.from_pretrained(str(args.model), dtype=dtype).to(device).eval()

    engine = NativeEngine(load(), tok, max_batch_size=256, max_model_len=max_len, device=device)
    requests = [
        Request(prompt_ids=p, sampling=SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=1000 * i + j),
                request_id=(i, j))
        for i, p in enumerate(prompts) for j in range(args.samples)
    ]  # fmt: skip
    ours = [score(c.request_id[0], c.token_ids) for c in engine.generate(requests)]
    del engine
    model = load()
    torch.manual_seed(0)
    theirs = []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p] * args.samples, device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=args.max_tokens, eos_token_id=sorted(ends),
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
        theirs += [score(i, row) for row in out[:, len(p) :].tolist()]
    result = dict(
        meta=common.run_metadata(device, model=str(args.model), dtype=args.dtype),
        native=_summary([r for r, _ in ours], [e for _, e in ours]),
        hf_generate=_summary([r for r, _ in theirs], [e for _, e in theirs]),
    )
    for name in ("native", "hf_generate"):
        s = result[name]
        print(
            f"{name:12s} n={s['n']} reward {s['reward']:.4f} +- {s['reward_se']:.4f}  exact {s['exact']:.4f} +- {s['exact_se']:.4f}"
        )
    if args.out:
        common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
