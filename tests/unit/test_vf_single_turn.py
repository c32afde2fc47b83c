"""The classic bridge's single-turn fast path (prime_spmd/envs/vf_single_turn.py) against the general path.

Each test runs the same environment object through ``VerifiersEnvironment`` twice, with
``single_turn_fast_path`` on and off, and compares every field of every ``Rollout`` plus what the
reward functions saw. ~15 s in all on the 2-core CPU machine (the tiny model runs once per path).
"""

from __future__ import annotations

import pytest

vf = pytest.importorskip("verifiers")

from datasets import Dataset  # noqa: E402

from prime_spmd.envs.verifiers_bridge import VerifiersEnvironment  # noqa: E402
from prime_spmd.envs.vf_single_turn import single_turn_blocker  # noqa: E402
from prime_spmd.inference.engine import SamplingParams  # noqa: E402
from tests import envs_for_tests  # noqa: E402
from tests.fakes import ScriptedEngine, native_engine  # noqa: E402


def _fields(groups) -> list[tuple]:
    return [
        (r.example_id, r.sample_idx, r.prompt_ids, r.completion_ids, r.completion_mask, r.inference_logprobs)
        + (r.reward, r.metrics, r.info)
        for g in groups
        for r in g
    ]


def _both(vf_env, engine_fn, ids, group_size, sp, **kw) -> tuple[list, list, list]:
    """(fast rollouts, general rollouts, max batch the fast path's engine saw)."""
    out, batches = [], []
    for fast in (True, False):
        env = VerifiersEnvironment(vf_env, reward_timeout_s=5.0, single_turn_fast_path=fast, **kw)
        assert env.fast_single_turn is fast
        engine = engine_fn()
        out.append(env.run_groups(engine, "train", ids, group_size, sp, seed=3))
        batches.append(engine.max_batch_seen)
    return out[0], out[1], batches


def test_fast_path_matches_general_path_sampled(qwen3_model, qwen3_tokenizer):
    """Sampled (temperature 1, per-request seeds), env sampling_args and a stop string: identical rollouts,
    and the fast path sent all of them to the engine in one batch."""
    vf_env = envs_for_tests.load_single_turn_env(num_examples=3)
    vf_env.sampling_args = {"max_tokens": 7, "stop": ["zz"]}
    sp = SamplingParams(temperature=1.0, max_tokens=12)
    fast, general, batches = _both(vf_env, lambda: native_engine(qwen3_model, qwen3_tokenizer), [0, 1, 2], 3, sp)
    assert _fields(fast) == _fields(general)
    assert batches[0] == 9
    lengths = {len(r.completion_ids) for g in fast for r in g}
    assert max(lengths) <= 7 and len({tuple(r.completion_ids) for g in fast for r in g}) > 1  # seeds differ


def test_fast_path_rewards_states_and_failures_match(qwen3_tokenizer):
    """Scripted completions: rewards and metrics, what reward functions see in the state, max_seq_len
    truncation, an overlong prompt, a vf.Error and a raising setup_state (its group fails) all match."""
    seen: dict[bool, list] = {True: [], False: []}
    mode = {"fast": True}

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
        seen[mode["fast"]].append((answer, text, ids, state["is_truncated"], state.get("stop_condition")))
        return float(answer in (text or ""))

    rows = [{"question": "q", "answer": a} for a in ("7", "boom", "err", "8")]
    rows.append({"question": "long " * 300, "answer": "x"})  # past max_model_len: overlong_prompts
    vf_env = Env(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[exact, lambda completion: 0.25]))
    vf_env.max_seq_len = 16  # truncates the stored completion ids (verifiers' parse_response_tokens rule)
    from prime_spmd.envs.vf_single_turn import _fresh_states

    # setup_state is overridden: the turn loop's first stop check runs (the vf.Error row stops there).
    assert not _fresh_states(vf_env) and _fresh_states(envs_for_tests.load_single_turn_env())
    out = []
    for fast in (True, False):
        mode["fast"] = fast
        env = VerifiersEnvironment(vf_env, single_turn_fast_path=fast)
        engine = ScriptedEngine(qwen3_tokenizer, lambda p: "7 and 8 and more words here<|im_end|>", max_model_len=300)
        out.append(env.run_groups(engine, "train", [0, 1, 2, 3, 4], 2, SamplingParams(max_tokens=40), seed=0))
    fast, general = out
    assert _fields(fast) == _fields(general)
    assert (
        sorted(seen[True], key=repr) == sorted(seen[False], key=repr) and len(seen[True]) == 8
    )  # all but the failed group, two samples each
    by_eid = {g[0].example_id: g for g in fast}
    assert all(r.reward == 1.25 and r.metrics["failed"] == 0.0 for r in by_eid[0] + by_eid[3])
    assert all(r.metrics["group_errors"] == 1.0 for r in by_eid[1])
    assert all(r.metrics["env_errors"] == 1.0 and r.reward == 0.0 for r in by_eid[2])
    assert all(r.metrics["overlong_prompts"] == 1.0 and r.completion_ids == [] for r in by_eid[4])
    assert any(truncated for *_, truncated, _ in seen[True])  # max_seq_len cut a completion


def test_blocker_sends_other_environments_to_the_general_path(qwen3_tokenizer):
    """Multi-turn, a rollout timeout or own stop conditions: the general path."""
    assert single_turn_blocker(envs_for_tests.load_single_turn_env()) is None
    assert "max_turns" in single_turn_blocker(envs_for_tests.load_multi_turn_env(max_turns=3))
    assert "stop conditions" in single_turn_blocker(envs_for_tests.load_multi_turn_env(max_turns=1))
    assert "max_turns" in single_turn_blocker(envs_for_tests.load_tool_env())
    timed = envs_for_tests.load_single_turn_env()
    assert VerifiersEnvironment(timed, rollout_timeout_s=30).fast_single_turn is False
    assert "timeout" in single_turn_blocker(timed)


def test_batched_scoring_matches_general_path_with_failures_and_timeouts(qwen3_tokenizer):
    """vf_scoring.score_groups against verifiers' score_group: a RubricGroup with plain, async, group,
    raising and hanging (past the 0.3 s reward timeout) functions, and a rubric subclass that overrides
    scoring (scored by verifiers): equal rollouts, and the same reward_errors / reward_timeouts counts."""
    import threading

    from prime_spmd.envs.vf_scoring import scoring_blocker

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

    class Custom(vf.Rubric):
        async def score_group(self, states):
            await super().score_group(states)

    rubric = vf.RubricGroup(
        [
            vf.Rubric(funcs=[plain, later, spread, flaky], weights=[1.0, 0.5, 1.0, 1.0]),
            vf.Rubric(funcs=[hangs], weights=[0.25]),
        ]
    )
    rows = [{"question": "q", "answer": a} for a in ("7", "8", "9")]
    vf_env = vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=rubric)
    assert scoring_blocker(Custom()) is not None
    out = []
    for fast in (True, False):
        env = VerifiersEnvironment(vf_env, single_turn_fast_path=fast, reward_timeout_s=0.3)
        assert scoring_blocker(vf_env.rubric) is None
        engine = ScriptedEngine(qwen3_tokenizer, lambda p: "7 or 9<|im_end|>", max_model_len=300)
        out.append(env.run_groups(engine, "train", [0, 1, 2], 2, SamplingParams(max_tokens=20), seed=0))
    release.set()
    fast, general = out
    assert _fields(fast) == _fields(general)
    by_eid = {g[0].example_id: g for g in fast}
    assert all(r.metrics["reward_errors"] == 1.0 and r.reward == 0.0 for r in by_eid[1])
    assert all(r.metrics["reward_timeouts"] == 1.0 for r in by_eid[0])
    assert {r.metrics["reward_timeouts"] for r in by_eid[2]} == {0.0}
    assert by_eid[2][0].metrics["env/plain"] == 1.0 and by_eid[2][1].metrics["env/spread"] == pytest.approx(0.1)
    assert by_eid[2][0].reward == pytest.approx(1.0 + 0.25 + 0.0 + 2.0 + 0.75)


def test_overrides_and_handlers_take_the_awaiting_path(qwen3_tokenizer):
    """An add_trajectory_step that awaits, an env cleanup handler taking **kwargs, a rubric cleanup handler,
    and reward functions whose objects come from score_objects (a row field, a class object shadowing
    `answer`): the fast path gathers and calls them as verifiers does; rollouts and calls match."""
    import asyncio

    from prime_spmd.envs.vf_scoring import _direct_names
    from prime_spmd.envs.vf_single_turn import _inline, _rubric_cleans_up

    calls: dict[bool, list] = {True: [], False: []}
    mode = {"fast": True}

    class Env(vf.SingleTurnEnv):
        async def add_trajectory_step(self, state, trajectory_step):
            await asyncio.sleep(0)
            await super().add_trajectory_step(state, trajectory_step)

        @vf.cleanup
        async def note(self, **kwargs):
            calls[mode["fast"]].append(("env", sorted(kwargs), kwargs["state"]["answer"]))

    class Rub(vf.Rubric):
        @vf.cleanup
        async def done(self, state):
            calls[mode["fast"]].append(("rubric", state["answer"]))

    def from_row(question, answer) -> float:  # `question` is a row field: score_objects builds it
        return float(len(question)) + (answer == "shadow")

    rubric = Rub(funcs=[from_row, lambda completion, answer: float(answer in (completion[-1].content or ""))])
    rubric.add_class_object("answer", "shadow")  # replaces the state's answer in score_objects
    rows = [{"question": q, "answer": a} for q, a in (("q1", "7"), ("q22", "8"))]
    vf_env = Env(dataset=Dataset.from_list(rows), rubric=rubric)
    plain = envs_for_tests.load_single_turn_env()
    assert _inline(plain) and not _rubric_cleans_up(plain.rubric)
    assert not _inline(vf_env) and _rubric_cleans_up(vf_env.rubric)
    out = []
    for fast in (True, False):
        mode["fast"] = fast
        env = VerifiersEnvironment(vf_env, single_turn_fast_path=fast, reward_timeout_s=5.0)
        assert env.fast_single_turn is fast
        engine = ScriptedEngine(qwen3_tokenizer, lambda p: "7<|im_end|>", max_model_len=300)
        out.append(env.run_groups(engine, "train", [0, 1], 2, SamplingParams(max_tokens=8), seed=0))
    from prime_spmd.envs.vf_rewards import guard_info

    assert all(_direct_names(vf_env.rubric.rubrics[0], guard_info(f)) is None for f in vf_env.rubric.rubrics[0].funcs)
    fast, general = out
    assert _fields(fast) == _fields(general)
    assert sorted(calls[True], key=repr) == sorted(calls[False], key=repr) and len(calls[True]) == 8
    assert ("env", ["env", "resources", "state", "task"], "7") in calls[True]
    assert {r.reward for g in fast for r in g} == {3.0, 4.0}  # len(question) + 1 ("shadow"), the lambda 0
