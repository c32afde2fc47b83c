"""Greedy reverse-text evaluation of an exported model (exact match and per-character LCS score)."""

from __future__ import annotations

from pathlib import Path

import torch

from prime_spmd.config import SFTJobConfig
from prime_spmd.config.sections import ModelConfig
from prime_spmd.data.reverse_text import example_rng, lcs_ratio, reverse_text_example
from prime_spmd.data.sft import render_prompt
from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.models.loading import load_model, load_tokenizer


@torch.no_grad()
def eval_reverse_text(model_dir: Path, cfg: SFTJobConfig, device: torch.device) -> dict[str, float]:
    """Greedy completions (native engine) for ``cfg.eval_examples`` held-out strings; one process."""
    mcfg = ModelConfig(path=str(model_dir), impl=cfg.model.impl, dtype=cfg.model.dtype)
    tok = load_tokenizer(mcfg)
    engine = NativeEngine(
        load_model(mcfg, device),
        tok,
        max_batch_size=min(cfg.eval_examples, 256),
        max_model_len=cfg.trainer.seq_len,
        device=device,
    )
    texts = [
        reverse_text_example(
            example_rng(cfg.trainer.seed, "eval", i), cfg.data.min_chars, cfg.data.max_chars, cfg.data.alphabet
        )
        for i in range(cfg.eval_examples)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=cfg.data.max_chars + 2)
    requests = [
        Request(prompt_ids=render_prompt(tok, [{"role": "user", "content": t}]), sampling=greedy, request_id=i)
        for i, (t, _) in enumerate(texts)
    ]
    exact, score = 0, 0.0
    for (_, answer), c in zip(texts, engine.generate(requests)):
        completion = tok.decode(c.token_ids, skip_special_tokens=True)
        exact += int(completion == answer)
        score += lcs_ratio(answer, completion)
    n = max(len(texts), 1)
    return {"eval_exact_match": exact / n, "eval_char_score": score / n}
