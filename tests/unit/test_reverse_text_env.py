"""The built-in reverse-text environment: deterministic examples, LCS reward, rollouts from the engine."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_spmd.config.sections import EnvConfig
from prime_spmd.envs.loader import load_environment
from prime_spmd.envs.reverse_text import ReverseTextEnv, completion_text, lcs_ratio, reverse_text_example
from prime_spmd.inference.engine import SamplingParams
from prime_spmd.inference.logprobs import teacher_forced_logprobs
from prime_spmd.inference.native import NativeEngine
from prime_spmd.models.tiny import build_tiny_model


def test_examples_are_seeded_and_in_range():
    env = load_environment(EnvConfig(name="reverse_text", args={"min_chars": "3", "max_chars": "4"}, seed=1))
    ex = [env.example("eval", i) for i in range(50)]
    assert ex == [env.example("eval", i) for i in range(50)]
    for e in ex:
        text = e["prompt"][0]["content"]
        assert e["prompt"] == [{"role": "user", "content": text}]
        assert 3 <= len(text) <= 4 and set(text) <= set("abcdefghijklmnopqrstuvwxyz") and e["answer"] == text[::-1]
    other = ReverseTextEnv(seed=2, args={"min_chars": "3", "max_chars": "4"})
    assert [other.example("eval", i) for i in range(50)] != ex
    assert env.example("train", 0) != env.example("eval", 0)
    t, a = reverse_text_example(random.Random(0), 5, 5, "ab")
    assert len(t) == 5 and a == t[::-1]
    with pytest.raises(ValueError, match="unknown keys"):
        ReverseTextEnv(args={"max_len": "3"})


def test_lcs_ratio():
    assert lcs_ratio("abc", "abc") == 1.0
    assert lcs_ratio("abc", "xyz") == 0.0
    assert lcs_ratio("abcd", "abd") == pytest.approx(2 * 3 / 7)


def test_run_groups_gives_scored_token_exact_rollouts(tmp_path):
    path = build_tiny_model(tmp_path / "m", "qwen3-nano", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    eng = NativeEngine(model, tok, max_batch_size=4, max_model_len=64, device="cpu")
    env = ReverseTextEnv(seed=0, num_eval_examples=3)
    sp = SamplingParams(temperature=1.0, max_tokens=12)
    groups = env.run_groups(eng, "eval", [0, 2], group_size=3, sampling=sp, seed=5)
    assert [[r.example_id for r in g] for g in groups] == [[0, 0, 0], [2, 2, 2]]
    for g in groups:
        assert [r.sample_idx for r in g] == [0, 1, 2]
        for r in g:
            r.validate()
            assert r.completion_mask == [1] * len(r.completion_ids)
            assert r.prompt_ids == eng.render_chat(env.example("eval", r.example_id)["prompt"])
            text = completion_text(tok, r.completion_ids)
            assert r.reward == lcs_ratio(r.info["answer"], text)
            tf = teacher_forced_logprobs(model, r.prompt_ids, r.completion_ids, 1.0)
            assert torch.allclose(tf, torch.tensor(r.inference_logprobs), atol=1e-5)
    # seeds come from (seed, example, sample): example 2 alone gives the same group
    again = env.run_groups(eng, "eval", [2], group_size=3, sampling=sp, seed=5)
    assert [r.completion_ids for r in again[0]] == [r.completion_ids for r in groups[1]]
    assert len({tuple(r.completion_ids) for r in groups[0]}) > 1


def test_completion_text_cuts_at_end_of_turn(tmp_path):
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m", "qwen3-nano"))
    ids = tok.encode("cba") + [tok.eos_token_id] + tok.encode("zz")
    assert completion_text(tok, ids) == "cba"
