"""``python -m prime_spmd eval``: run an environment's eval split with the inference engine.

Writes into ``--output_dir``: ``config.json`` (resolved config), ``samples.jsonl`` (one line per
sample: prompt, completion, answer, reward, token counts, finish reason) and ``summary.json``
(mean reward, pass@k for k = 1 .. samples_per_example, throughput).

pass@k uses the unbiased estimator of Chen et al. 2021 (HumanEval): per example with n samples of
which c pass, pass@k = 1 - C(n - c, k) / C(n, k), averaged over examples. A sample passes when its
reward is >= 1 - 1e-6 (for reverse_text: an exact reversal).

Single process: one engine on this rank's device. Multi-rank sharding of the examples is the
lead's wiring (each rank would run a contiguous share and rank 0 would merge the files).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

from prime_spmd.config import EvalJobConfig, to_json, write_resolved_config
from prime_spmd.envs.base import Environment
from prime_spmd.envs.loader import load_environment
from prime_spmd.inference.engine import SamplingParams, render_chat_ids
from prime_spmd.inference.factory import build_engine
from prime_spmd.log import logger
from prime_spmd.models.loading import load_tokenizer, maybe_build_tiny
from prime_spmd.models.vision import load_vision_processor
from prime_spmd.progress import Progress
from prime_spmd.trainer.resolved import resolved_settings

PASS_THRESHOLD = 1.0 - 1e-6


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one example: probability that k of its n samples, drawn without replacement, hold a pass."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _model_len(cfg: EvalJobConfig, env: Environment, tokenizer, num_examples: int) -> int:
    """KV-cache length: --inference.max_model_len, else the longest eval prompt plus --sampling.max_tokens."""
    if cfg.inference.max_model_len:
        return cfg.inference.max_model_len
    processor = load_vision_processor(cfg.model.path, tokenizer)  # images count their expanded tokens

    def length(messages: list[dict]) -> int:
        return len(processor.render(messages)[0] if processor is not None else render_chat_ids(tokenizer, messages))

    longest = max(length(env.example("eval", i)["prompt"]) for i in range(num_examples))
    return longest + cfg.sampling.max_tokens + 1


def run_eval(cfg: EvalJobConfig) -> dict[str, float]:
    """Run the eval split end to end on this process; return the summary (also written to summary.json)."""
    out_dir = Path(cfg.output_dir)
    write_resolved_config(cfg, out_dir)
    logger.info(f"eval config:\n{to_json(cfg)}")
    maybe_build_tiny(cfg.model, cfg.seed)
    env = load_environment(cfg.env)
    num_examples = min(cfg.env.num_eval_examples, env.num_examples("eval"))
    if num_examples < 1:
        raise ValueError(f"--env.num_eval_examples={cfg.env.num_eval_examples}: the eval split is empty")
    tokenizer = load_tokenizer(cfg.model)
    device, model_len = _device(), _model_len(cfg, env, tokenizer, num_examples)
    engine = build_engine(cfg.inference, cfg.model, device, model_len)
    write_resolved_config(cfg, out_dir, resolved_settings(cfg, device, engine=engine, max_model_len=model_len))
    s = cfg.sampling
    sampling = SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, max_tokens=s.max_tokens
    )
    n = cfg.samples_per_example
    # chunks of examples big enough to keep every KV slot busy between progress updates
    chunk = max(1, 4 * cfg.inference.max_batch_size // n)
    bar = Progress(total=num_examples, desc="eval", enabled=cfg.log.progress)
    rewards: list[list[float]] = []
    num_tokens, start = 0, time.perf_counter()
    with open(out_dir / "samples.jsonl", "w") as f:
        for lo in range(0, num_examples, chunk):
            ids = list(range(lo, min(lo + chunk, num_examples)))
            groups = env.run_groups(engine, "eval", ids, n, sampling, cfg.seed)
            for group in groups:
                rewards.append([r.reward for r in group])
                for r in group:
                    num_tokens += len(r.completion_ids)
                    f.write(json.dumps(_sample_row(r, tokenizer)) + "\n")
            bar.update(len(ids), reward=sum(map(sum, rewards)) / (len(rewards) * n))
    bar.close()
    elapsed = time.perf_counter() - start
    summary = _summarize(rewards, n, num_tokens, elapsed)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("eval: " + " ".join(f"{k}={v:.4g}" for k, v in summary.items()))
    return summary


def _sample_row(r, tokenizer) -> dict:
    completion = r.info.get("completion_text")
    if completion is None:
        completion = tokenizer.decode(r.completion_ids, skip_special_tokens=True)
    return {
        "example_id": r.example_id,
        "sample_idx": r.sample_idx,
        "prompt": tokenizer.decode(r.prompt_ids),
        "completion": completion,
        "answer": r.info.get("answer"),
        "reward": r.reward,
        "prompt_tokens": len(r.prompt_ids),
        "completion_tokens": len(r.completion_ids),
        "finish_reason": r.info.get("finish_reason"),
    }


def _summarize(rewards: list[list[float]], n: int, num_tokens: int, elapsed_s: float) -> dict[str, float]:
    flat = [x for g in rewards for x in g]
    mean = sum(flat) / len(flat)
    summary: dict[str, float] = {
        "num_examples": len(rewards),
        "samples_per_example": n,
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat)),
    }
    for k in range(1, n + 1):
        passes = [pass_at_k(n, sum(x >= PASS_THRESHOLD for x in g), k) for g in rewards]
        summary[f"pass@{k}"] = sum(passes) / len(passes)
    summary["completion_tokens_mean"] = num_tokens / len(flat)
    summary["elapsed_s"] = elapsed_s
    summary["tokens_per_s"] = num_tokens / elapsed_s if elapsed_s > 0 else 0.0
    return summary
