"""Tiny random-init Qwen3 models with a character-level tokenizer, written with ``save_pretrained``.

Tests, the reverse-text demo and benchmarks build their models here so that everything downstream
loads them through the real loading path (``AutoModelForCausalLM.from_pretrained(dir)``).
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|pad|>", "<|unk|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list(string.printable[:95]) + ["\n"]  # digits, letters, punctuation, space, then newline
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# name -> (hidden, layers, heads, kv_heads, head_dim, intermediate)
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "qwen3-nano": (64, 2, 4, 2, 16, 128),
    "qwen3-micro": (96, 3, 4, 2, 24, 256),
    "qwen3-1m": (128, 4, 4, 2, 32, 384),
}


def build_char_tokenizer():
    """A character-level fast tokenizer with Qwen-style chat special tokens and a chat template."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<|unk|>",
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_qwen3_config(preset: str, vocab_size: int, max_position_embeddings: int = 2048, **overrides):
    """A ``Qwen3Config`` of the named preset (see PRESETS)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}; choose one of {sorted(PRESETS)}")
    hidden, layers, heads, kv_heads, head_dim, inter = PRESETS[preset]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=0,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        bos_token_id=None,
    )
    kwargs.update(overrides)
    from transformers import Qwen3Config  # here: it imports the auto-model factory (2-6 s of start-up, 5.17)

    return Qwen3Config(**kwargs)


def build_tiny_model(path: str | Path, preset: str = "qwen3-nano", seed: int = 0, **overrides) -> Path:
    """Write a random-init tiny Qwen3 (fp32) and the character tokenizer to ``path``; return it.

    Deterministic for a given (preset, seed, overrides).
    """
    path = Path(path)
    tokenizer = build_char_tokenizer()
    overrides.setdefault("vocab_size", len(tokenizer))  # a larger vocab (benchmark shapes) is allowed
    if overrides["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size={overrides['vocab_size']} is smaller than the tokenizer's {len(tokenizer)}")
    config = tiny_qwen3_config(preset, **overrides)
    from transformers import AutoModelForCausalLM  # here: an auto-model class imports transformers' generation code

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
