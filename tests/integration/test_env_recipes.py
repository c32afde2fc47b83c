"""The multi-turn and tool-use recipes (configs/reverse_text_retry, configs/reverse_text_tool) run.

Each recipe's rl.toml runs 2 steps from a random tiny model (the recipe's own env, args, lengths),
then its eval.toml on the result. A random model never reverses a string, so the retry env always
uses all 3 attempts: the environment's feedback turns show up as env tokens (mask 0) in training.
The tool path is checked with a scripted engine that calls the tool, since a random model does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prime_spmd.config import EvalJobConfig, RLJobConfig, load_toml
from prime_spmd.envs.verifiers_bridge import VerifiersEnvironment
from prime_spmd.inference.engine import SamplingParams
from tests.fakes import ScriptedEngine
from tests.jobs import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def _run_recipe(name: str, tmp_path: Path) -> tuple[list[dict], dict]:
    from prime_spmd.eval import run_eval
    from prime_spmd.rl.loop import run_rl

    rl = load_toml(RLJobConfig, ROOT / f"configs/{name}/rl.toml")
    rl.output_dir, rl.model.path, rl.model.init_tiny = str(tmp_path / "rl"), str(tmp_path / "base"), "qwen3-nano"
    rl.trainer.max_steps, rl.rollout.prompts_per_step, rl.rollout.group_size = 2, 4, 2
    rl.ckpt.interval_steps, rl.log.progress, rl.log.plots = 0, False, False
    run_rl(rl)
    rows = read_metrics(tmp_path / "rl")
    ev = load_toml(EvalJobConfig, ROOT / f"configs/{name}/eval.toml")
    ev.output_dir, ev.model.path, ev.log.progress = str(tmp_path / "eval"), str(tmp_path / "rl/hf"), False
    ev.env.num_eval_examples, ev.samples_per_example = 4, 2
    return rows, run_eval(ev)


def test_retry_recipe_runs_multi_turn(tmp_path: Path) -> None:
    rows, summary = _run_recipe("reverse_text_retry", tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["env/attempts"] == 3.0 for r in rows), rows  # a random model never solves it
    assert all(r["failed_rollouts"] == 0 and r["train_samples"] > 0 for r in rows), rows
    # 3 attempts of <= 16 tokens plus two feedback turns: longer than one turn could be
    assert all(r["completion_len_mean"] > 16 for r in rows), rows
    assert summary["num_examples"] == 4


def test_tool_recipe_runs(tmp_path: Path) -> None:
    rows, summary = _run_recipe("reverse_text_tool", tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["failed_rollouts"] == 0 and "env/total_tool_calls" in r for r in rows), rows
    assert summary["num_examples"] == 4


def test_tool_env_calls_reverse_and_scores_the_answer(qwen3_tokenizer) -> None:
    """A model that calls the tool gets the reversal back as a tool message and answers with it."""
    from prime_spmd.envs.vf_reverse_tool import load_environment

    env = VerifiersEnvironment(load_environment(num_train_examples=2, min_chars=5, max_chars=5), reward_timeout_s=None)
    text = env.example("train", 0)["prompt"][0]["content"]

    def script(prompt: str) -> str:
        if "<tool_response>" not in prompt and "tool" not in prompt.rsplit("<|im_start|>", 1)[-1]:
            call = json.dumps({"name": "reverse", "arguments": {"text": text}})
            return f"<tool_call>\n{call}\n</tool_call><|im_end|>"
        return f"{text[::-1]}<|im_end|>"

    engine = ScriptedEngine(qwen3_tokenizer, script)
    (group,) = env.run_groups(engine, "train", [0], 1, SamplingParams(max_tokens=64), seed=0)
    r = group[0]
    assert len(engine.log) == 2, engine.prompts  # the tool call, then the answer
    assert text[::-1] in engine.prompts[1]  # the tool's result reached the model
    assert r.reward == pytest.approx(1.0) and r.metrics["env/exact_match"] == 1.0
    assert r.metrics.get("env/total_tool_calls") == 1.0, r.metrics
    assert 0 in r.completion_mask  # the tool message is env tokens
