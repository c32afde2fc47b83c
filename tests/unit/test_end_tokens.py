"""``end_token_ids``: the real Qwen3 tokenizer's turn-ending ids, looked up once per tokenizer (its
``get_vocab`` rebuilds a 151k-entry dict per call: per rollout it cost ~9 s of a CPU RL step)."""

from __future__ import annotations

from prime_spmd.envs.base import completion_text, end_token_ids


def test_end_token_ids_real_qwen3_tokenizer_looked_up_once(qwen3_tokenizer) -> None:
    tok = qwen3_tokenizer
    calls = []
    get_vocab = tok.get_vocab
    tok.get_vocab = lambda: calls.append(1) or get_vocab()  # instance attribute: counts this tokenizer's calls
    ends = end_token_ids(tok)
    assert ends >= {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    assert tok.eos_token_id in ends
    ends.add(-1)  # the caller's copy: the cache is not changed through it
    ids = tok.encode("abc", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")] + [42]
    for _ in range(5):
        assert completion_text(tok, ids) == "abc"
    assert end_token_ids(tok) == ends - {-1}
    assert len(calls) == 1
