"""The classic bridge with a scripted engine: what reward functions see, and every kind of failure counted on
its rollout (env errors, a raising setup_state, an overlong prompt, max_seq_len truncation, raising and hanging
reward functions of a RubricGroup)."""

from __future__ import annotations

import pytest

vf = pytest.importorskip("verifiers")

from datasets import Dataset  # noqa: E402

from prime_spmd.envs.verifiers_bridge import VerifiersEnvironment  # noqa: E402
from prime_spmd.inference.engine import SamplingParams  # noqa: E402
from tests.fakes import ScriptedEngine  # noqa: E402


def test_rewards_states_and_failures(qwen3_tokenizer):
    """Scripted completions: rewards and metrics, what reward functions see in the state, max_seq_len
    truncation, an overlong prompt, a vf.Error and a raising setup_state (its group fails)."""
    seen: list = []

    class Env(vf.SingleTurnEnv):
        async def setup_state(self, state):
            if state["answer"] == "boom":
                raise KeyError("env bug")  # escapes: the group fails
            if state["answer"] == "err":
                raise vf.ToolError("recorded")  # a vf.Error: recorded on the rollout (env_errors)
            return state

    def exact(completion, answer, state) -> float:
        steps = state["trajectory"]
        ids = [s["tokens"]["completion_ids"] for s in steps]
        text = completion[-1].content if completion else None
        seen.append((answer, text, ids, state["is_truncated"], state.get("stop_condition")))
        return float(answer in (text or ""))

    rows = [{"question": "q", "answer": a} for a in ("7", "boom", "err", "8")]
    rows.append({"question": "long " * 300, "answer": "x"})  # past max_model_len: overlong_prompts
    vf_env = Env(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[exact, lambda completion: 0.25]))
    vf_env.max_seq_len = 16  # truncates the stored completion ids (verifiers' parse_response_tokens rule)
    env = VerifiersEnvironment(vf_env)
    engine = ScriptedEngine(qwen3_tokenizer, lambda p: "7 and 8 and more words here<|im_end|>", max_model_len=300)
    groups = env.run_groups(engine, "train", [0, 1, 2, 3, 4], 2, SamplingParams(max_tokens=40), seed=0)
    assert len(seen) == 8  # all but the failed group, two samples each
    by_eid = {g[0].example_id: g for g in groups}
    assert all(r.reward == 1.25 and r.metrics["failed"] == 0.0 for r in by_eid[0] + by_eid[3])
    assert all(r.metrics["group_errors"] == 1.0 for r in by_eid[1])
    assert all(r.metrics["env_errors"] == 1.0 and r.reward == 0.0 for r in by_eid[2])
    assert all(r.metrics["overlong_prompts"] == 1.0 and r.completion_ids == [] for r in by_eid[4])
    assert any(truncated for *_, truncated, _ in seen)  # max_seq_len cut a completion
    assert all(len(r.completion_ids) <= 16 for g in groups for r in g)


def test_rubric_group_scoring_with_failures_and_timeouts(qwen3_tokenizer):
    """A RubricGroup with plain, async, group, raising and hanging (past the 0.3 s reward timeout) functions:
    weighted rewards and metrics, and reward_errors / reward_timeouts counted on the right rollouts."""
    import threading

    release = threading.Event()

    def plain(completion, answer) -> float:
        return float(answer in (completion[-1].content or ""))

    async def later(answer, state) -> float:
        return 0.5 * len(state["trajectory"]) + (answer == "8")

    def spread(completions) -> list[float]:
        return [0.1 * i for i in range(len(completions))]

    def flaky(answer) -> float:
        if answer == "8":
            raise ValueError("bad answer")
        return 2.0

    def hangs(answer, **kwargs) -> float:
        if answer == "7" and kwargs["state"]["trajectory"][0]["trajectory_id"]:
            release.wait(5.0)  # past the timeout: counted, its worker abandoned, later calls go on
        return 3.0

    rubric = vf.RubricGroup(
        [
            vf.Rubric(funcs=[plain, later, spread, flaky], weights=[1.0, 0.5, 1.0, 1.0]),
            vf.Rubric(funcs=[hangs], weights=[0.25]),
        ]
    )
    rows = [{"question": "q", "answer": a} for a in ("7", "8", "9")]
    vf_env = vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=rubric)
    env = VerifiersEnvironment(vf_env, reward_timeout_s=0.3)
    engine = ScriptedEngine(qwen3_tokenizer, lambda p: "7 or 9<|im_end|>", max_model_len=300)
    groups = env.run_groups(engine, "train", [0, 1, 2], 2, SamplingParams(max_tokens=20), seed=0)
    release.set()
    by_eid = {g[0].example_id: g for g in groups}
    assert all(r.metrics["reward_errors"] == 1.0 and r.reward == 0.0 for r in by_eid[1])
    assert all(r.metrics["reward_timeouts"] == 1.0 for r in by_eid[0])
    assert {r.metrics["reward_timeouts"] for r in by_eid[2]} == {0.0}
    assert by_eid[2][0].metrics["env/plain"] == 1.0 and by_eid[2][1].metrics["env/spread"] == pytest.approx(0.1)
    assert by_eid[2][0].reward == pytest.approx(1.0 + 0.25 + 0.0 + 2.0 + 0.75)
