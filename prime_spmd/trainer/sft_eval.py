"""Greedy reverse-text evaluation of an exported model (exact match and per-character LCS score)."""

from __future__ import annotations

from pathlib import Path

import torch

from prime_spmd.config import SFTJobConfig
from prime_spmd.config.sections import ModelConfig
from prime_spmd.data.reverse_text import example_rng, lcs_ratio, reverse_text_example
from prime_spmd.data.sft import render_prompt
from prime_spmd.models.loading import load_model, load_tokenizer


@torch.no_grad()
def eval_reverse_text(model_dir: Path, cfg: SFTJobConfig, device: torch.device) -> dict[str, float]:
    """Greedy completions for ``cfg.eval_examples`` held-out strings; one process, no collectives."""
    mcfg = ModelConfig(path=str(model_dir), impl=cfg.model.impl, dtype=cfg.model.dtype)
    tok = load_tokenizer(mcfg)
    lm = load_model(mcfg, device).eval()
    texts = [
        reverse_text_example(example_rng(cfg.trainer.seed, "eval", i), cfg.data.min_chars, cfg.data.max_chars, cfg.data.alphabet)
        for i in range(cfg.eval_examples)
    ]
    prompts = [render_prompt(tok, [{"role": "user", "content": t}]) for t, _ in texts]
    width = max(map(len, prompts))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = lm.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=cfg.data.max_chars + 2,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=tok.eos_token_id,
    )
    exact, score = 0, 0.0
    for (_, answer), row in zip(texts, out[:, width:].tolist()):
        completion = tok.decode(row, skip_special_tokens=True)
        exact += int(completion == answer)
        score += lcs_ratio(answer, completion)
    n = max(len(texts), 1)
    return {"eval_exact_match": exact / n, "eval_char_score": score / n}
