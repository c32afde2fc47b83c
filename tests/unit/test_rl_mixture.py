"""Mixtures of environments (issue 41): batch composition by ratio, the planner's resume, difficulty
filtering, failure isolation, per-environment metrics and the [[envs]] config."""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path

import pytest

from prime_spmd.config import RLJobConfig, load_toml
from prime_spmd.config.rl_sections import RolloutConfig
from prime_spmd.config.sections import EnvConfig, env_label
from prime_spmd.envs.rollout import Rollout
from prime_spmd.inference.engine import EngineFailure, InferenceEngine, Request, SamplingParams
from prime_spmd.rl.env_metrics import batch_env_metrics, eval_env_metrics
from prime_spmd.rl.isolation import run_isolated
from prime_spmd.rl.mixture import EnvSlot, Mixture
from prime_spmd.rl.schedule import eval_after_step, weights_after_step
from prime_spmd.rl.types import Batch, EvalShare


class _Env:
    """A train split of ``n`` examples whose rewards are ``reward(example_id)``; ``mode`` breaks it."""

    def __init__(self, n: int = 10, reward=lambda eid: 0.5, mode: str = "ok") -> None:
        self.n, self.reward, self.mode = n, reward, mode

    def num_examples(self, split: str) -> int:
        return self.n

    def run_groups(self, engine, split, ids, group_size, sampling, seed) -> list[list[Rollout]]:
        if self.mode == "raise":
            raise KeyError("tool service down")
        groups = [[_rollout(i, k, self.reward(i)) for k in range(group_size)] for i in ids]
        if self.mode == "short":
            return groups[:-1]
        if self.mode == "nan":
            groups[0][0].reward = float("nan")
        if self.mode == "str":
            groups[0][0].reward = "1.0"  # type: ignore[assignment]
        return groups


def _rollout(eid: int, k: int, reward: float, finish: str = "stop") -> Rollout:
    return Rollout(
        example_id=eid,
        sample_idx=k,
        prompt_ids=[1, 2],
        completion_ids=[3, 4, 5],
        completion_mask=[1, 1, 1],
        inference_logprobs=[-1.0] * 3,
        reward=reward,
        info={"finish_reason": finish},
    )


def _cfg(p: int = 4, **rollout) -> RLJobConfig:
    return RLJobConfig(rollout=RolloutConfig(prompts_per_step=p, group_size=2, **rollout))


def _slots(weights: dict[str, float], n: int = 10, **env) -> list[EnvSlot]:
    return [EnvSlot(label=lb, cfg=EnvConfig(label=lb, weight=w), env=_Env(n, **env)) for lb, w in weights.items()]


def test_batches_follow_the_ratios_exactly_and_deterministically() -> None:
    mix = Mixture(_cfg(p=4), _slots({"a": 3.0, "b": 1.0}))
    plans = [mix.plan(b) for b in range(6)]
    assert all(len(p["a"]) == 3 and len(p["b"]) == 1 for p in plans)  # 3:1 of 4 prompts, every batch
    # an uneven split: 2:1 of 4 prompts is 8/3 : 4/3; each batch within one prompt of it, 2:1 over the run
    mix = Mixture(_cfg(p=4), _slots({"a": 2.0, "b": 1.0}))
    counts = [{lb: len(ids) for lb, ids in mix.plan(b).items()} for b in range(6)]
    assert all(c["a"] + c["b"] == 4 and c["a"] in (2, 3) for c in counts)
    assert sum(c["a"] for c in counts) == 16 and sum(c["b"] for c in counts) == 8
    again = Mixture(_cfg(p=4), _slots({"a": 2.0, "b": 1.0}))
    assert [again.plan(b) for b in range(6)] == [mix.plan(b) for b in range(6)]  # planned once, same plans
    # each env walks a seeded permutation: one epoch of 10 examples holds each once
    walk = [i for b in range(6) for i in mix.plans[b]["a"]][:10]
    assert sorted(walk) == list(range(10)) and walk != list(range(10))


def test_curriculum_hook_sets_the_weights_per_step(tmp_path: Path) -> None:
    f = tmp_path / "cur.py"
    f.write_text("def weights(step):\n    return {'a': 1.0} if step < 2 else {'a': 1.0, 'b': 1.0}\n")
    mix = Mixture(_cfg(p=4, curriculum=f"{f}:weights"), _slots({"a": 1.0, "b": 0.0}))
    assert [len(mix.plan(b)["b"]) for b in range(4)] == [0, 0, 2, 2]
    bad = Mixture(_cfg(p=4, curriculum=f"{f}:weights"), _slots({"x": 1.0}))
    with pytest.raises(ValueError, match="rollout.curriculum.*keys must be among"):
        bad.plan(0)


def test_resume_restores_the_planner() -> None:
    """A planner rebuilt from a checkpoint's state plans the batches the uninterrupted one plans, and keeps
    the plan of a batch planned before the checkpoint (a resumed run regenerates it)."""
    cfg = _cfg(p=3, filter_difficulty=True, filter_recheck_steps=2)
    solved = {0, 1, 2, 3}

    def run(mix: Mixture, batches: range) -> list[dict]:
        out = []
        for b in batches:
            plan = mix.plan(b + 1)  # max_async 1: batch b+1 is planned before batch b is observed
            out.append(plan)
            groups = [[_rollout(i, k, 1.0 if i in solved else 0.5) for k in range(2)] for i in mix.plans[b]["a"]]
            mix.observe(Batch(index=b, groups=groups, group_envs=["a"] * len(groups)))
        return out

    slots = _slots({"a": 1.0, "b": 1.0}, n=6)
    ref = Mixture(cfg, slots)
    ref.plan(0)
    full = run(ref, range(8))
    mix = Mixture(cfg, slots)
    mix.plan(0)
    first = run(mix, range(4))
    state = pickle.loads(pickle.dumps(mix.state_dict()))
    resumed = Mixture(cfg, slots)
    resumed.load_state_dict(state)
    assert first + run(resumed, range(4, 8)) == full
    with pytest.raises(ValueError, match="environments"):
        Mixture(cfg, _slots({"a": 1.0})).load_state_dict(state)


def test_difficulty_filter_skips_solved_and_hopeless_prompts_and_rechecks_them() -> None:
    mix = Mixture(_cfg(p=2, filter_difficulty=True, filter_recheck_steps=3), _slots({"a": 1.0}, n=4))
    p0 = mix.plan(0)["a"]
    rewards = {p0[0]: 1.0, p0[1]: 0.0}  # solved, hopeless
    groups = [[_rollout(i, k, rewards[i]) for k in range(2)] for i in p0]
    m, stop = mix.observe(Batch(index=0, groups=groups, group_envs=["a", "a"]))
    assert m["env/a/filtered_prompts"] == 2.0 and stop is None
    p1 = mix.plan(1)["a"]  # the other two examples of the epoch
    p2 = mix.plan(2)["a"]  # next epoch: the walk meets the filtered ones and skips them
    assert set(p1) | set(p0) == {0, 1, 2, 3} and sorted(p2) == sorted(p1)
    epoch1 = [mix._order("a", 4 + i) for i in range(4)]
    walked = epoch1[: 1 + max(epoch1.index(i) for i in p1)]
    assert mix.plan_counts[2]["a"]["skipped"] == len(set(walked) & set(p0))
    p3 = mix.plan(3)["a"]  # due (0 + 3): both come back ahead of the walk, to be re-checked
    assert sorted(p3) == sorted(p0) and mix.plan_counts[3]["a"]["rechecked"] == 2.0
    m1, _ = mix.observe(Batch(index=1, groups=[], group_envs=[]))
    assert m1["env/a/prompts"] == 2.0 and m1["env/a/skipped_prompts"] == 0.0


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("raise", "raised KeyError"),
        ("short", "returned 1 groups for 2 prompts"),
        ("nan", "not finite"),
        ("str", "not a number"),
    ],
)
def test_a_failing_environment_loses_only_its_groups(mode: str, reason: str) -> None:
    good, failures = run_isolated("bad", _Env(mode=mode), None, "train", [4, 5], 2, None, 0)
    assert all(reason in f[2] and f[0] == "bad" for f in failures)
    dropped = {f[1] for f in failures}
    assert dropped == ({4} if mode in ("nan", "str") else {4, 5})
    assert [g[0].example_id for g in good] == [e for e in (4, 5) if e not in dropped]
    wrong_size = run_isolated("bad", _Env(), None, "train", [1], 3, None, 0)[0]
    assert len(wrong_size) == 1
    assert run_isolated("bad", _Env(), None, "train", [1], 3, None, 0)[1] == []


class _FailingStepEngine(InferenceEngine):
    """An engine whose step raises as a CUDA allocator assert does (c730d53, H200)."""

    tokenizer = None

    def __init__(self) -> None:
        self.queued: list = []

    def add_request(self, request) -> None:
        self.queued.append(request)

    def step(self):
        raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")

    def has_unfinished(self) -> bool:
        return bool(self.queued)

    def load_weights(self, weights) -> None: ...

    def reset_cache(self) -> None: ...


class _GeneratingEnv(_Env):
    def run_groups(self, engine, split, ids, group_size, sampling, seed) -> list[list[Rollout]]:
        engine.generate([Request(prompt_ids=[1, 2], sampling=sampling, request_id=i) for i in ids])
        return super().run_groups(engine, split, ids, group_size, sampling, seed)


def test_an_engine_failure_ends_the_run_instead_of_dropping_the_environment_groups() -> None:
    """A step of the engine that raises is the engine's failure, not the environment's: ``generate`` raises
    EngineFailure (with the step's error as its cause) and ``run_isolated`` lets it through."""
    with pytest.raises(EngineFailure, match="INTERNAL ASSERT") as info:
        run_isolated("ok", _GeneratingEnv(), _FailingStepEngine(), "train", [4, 5], 2, SamplingParams(max_tokens=4), 0)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_failure_rate_stops_the_run_naming_the_environment() -> None:
    mix = Mixture(_cfg(p=4, max_env_failure_rate=0.5), _slots({"good": 1.0, "flaky": 1.0}))
    plan = mix.plan(0)
    groups = [[_rollout(i, k, 0.5) for k in range(2)] for i in plan["good"]]
    failures = [("flaky", i, "raised KeyError: 'x'") for i in plan["flaky"]]
    batch = Batch(index=0, groups=groups, group_envs=["good"] * 2, failures=failures)
    metrics = batch_env_metrics(batch, ["good", "flaky"])
    assert metrics["env/flaky/failed_groups"] == 2.0 and metrics["env/good/failed_groups"] == 0.0
    _, stop = mix.observe(batch)
    assert stop is None  # 2 groups: below the minimum count the rate is judged on
    plan = mix.plan(1)
    failures = [("flaky", i, "timeout") for i in plan["flaky"]]
    _, stop = mix.observe(Batch(index=1, groups=[], failures=failures))
    assert stop is not None and "'flaky' failed 4 of its 4 groups" in stop and "max_env_failure_rate" in stop


def test_per_environment_metrics() -> None:
    a = [[_rollout(0, 0, 1.0), _rollout(0, 1, 0.5, finish="length")]]
    b = [[_rollout(1, 0, 0.0), _rollout(1, 1, 0.0)]]
    b[0][1].metrics["failed"] = 1.0
    m = batch_env_metrics(Batch(index=0, groups=a + b, group_envs=["a", "b"]), ["a", "b"])
    assert m["env/a/reward"] == 0.75 and m["env/a/pass_rate"] == 0.5 and m["env/a/truncated"] == 0.5
    assert m["env/a/completion_len"] == 3.0 and m["env/b/failed_rollouts"] == 1.0 and m["env/b/reward"] == 0.0
    ev = EvalShare(
        version=5,
        rewards={"a": [[1.0, 0.0], [0.0, 0.0]]},
        completion_lens={"a": [3, 3, 3, 3]},
        truncated={"a": 1},
        failed_groups={"a": 0},
    )
    e = eval_env_metrics(ev)
    assert e["eval_step"] == 5.0 and e["env/a/eval_reward"] == 0.25
    assert e["env/a/eval_pass@1"] == 0.25 and e["env/a/eval_pass@2"] == 0.5 and e["env/a/eval_truncated"] == 0.25


def test_eval_schedule() -> None:
    assert [j for j in range(10) if eval_after_step(j, 4, True, 10)] == [3, 7, 9]
    assert [j for j in range(10) if eval_after_step(j, 4, False, 10)] == [3, 7]
    assert not any(eval_after_step(j, 0, True, 10) for j in range(10))
    assert weights_after_step(9, 1, 10, True) and not weights_after_step(9, 1, 10, False)


def test_envs_toml_and_labels(tmp_path: Path) -> None:
    f = tmp_path / "rl.toml"
    f.write_text(
        '[model]\npath = "m"\n[[envs]]\nname = "reverse_text"\nweight = 2.0\n'
        '[[envs]]\nname = "pkg.vf_retry:load_environment"\nmax_tokens = 8\n[envs.args]\nmax_turns = "3"\n'
    )
    cfg = load_toml(RLJobConfig, f)
    cfg.validate()
    assert [env_label(e) for e in cfg.environments()] == ["reverse_text", "vf_retry"]
    assert cfg.envs[1].args == {"max_turns": "3"} and cfg.max_tokens() == max(8, cfg.sampling.max_tokens)
    assert env_label(EnvConfig(name="path/to/my_env.py")) == "my_env"
    cfg.envs[1].label = "reverse_text"
    with pytest.raises(ValueError, match="labels must differ"):
        cfg.validate()
    cfg.envs[1].label = ""
    cfg.env.name = "other"
    with pytest.raises(ValueError, match=r"either \[env\].*or \[\[envs\]\]"):
        cfg.validate()
    assert RLJobConfig().environments() == [EnvConfig()]  # the single [env]: a mixture of one
    f.write_text('[model]\npath = "m"\n[[env]]\nname = "reverse_text"\n')
    with pytest.raises(ValueError, match=r"key 'env' must be a table \(\[env\]\) \(several environments: \[\[envs\]\]"):
        load_toml(RLJobConfig, f)
    recipe = load_toml(RLJobConfig, Path(__file__).parents[2] / "configs" / "mixture" / "rl.toml")
    recipe.validate()
    assert [(env_label(e), e.weight) for e in recipe.environments()] == [("reverse", 1.0), ("retry", 1.0)]
    assert recipe.eval.interval_steps > 0
    counts = Counter(len(Mixture(_cfg(p=5), _slots({"x": 1.0})).plan(b)["x"]) for b in range(3))
    assert counts == {5: 3}


def test_verifiers_env_group_runs_through_the_bridge(tmp_path: Path) -> None:
    """``vf.EnvGroup`` is one classic environment to the bridge: each row goes to its sub-environment
    (single-turn arithmetic, multi-turn guessing), token-exact."""
    vf = pytest.importorskip("verifiers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_spmd.envs.verifiers_bridge import VerifiersEnvironment
    from prime_spmd.inference.engine import SamplingParams
    from prime_spmd.inference.native import NativeEngine
    from prime_spmd.models.tiny import build_tiny_model
    from tests.envs_for_tests import load_multi_turn_env, load_single_turn_env

    path = build_tiny_model(tmp_path / "m", "qwen3-nano", seed=0, initializer_range=0.3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = NativeEngine(model, AutoTokenizer.from_pretrained(path), max_batch_size=16, max_model_len=96, device="cpu")
    group = vf.EnvGroup(envs=[load_single_turn_env(num_examples=2), load_multi_turn_env(num_examples=2)])
    env = VerifiersEnvironment(group, name="group", reward_timeout_s=None)
    assert env.num_examples("train") == 4
    groups = env.run_groups(engine, "train", [0, 1, 2, 3], 2, SamplingParams(temperature=1.0, max_tokens=6), 0)
    sampled = [sum(g[0].completion_mask) for g in groups]
    assert sampled[:2] == [6, 6] and all(s > 6 for s in sampled[2:])  # the guessing game takes more turns
    assert not any(r.metrics.get("failed") for g in groups for r in g)
    for g in groups:
        for r in g:
            r.validate()


def test_a_hanging_group_is_cut_by_the_group_timeout(tmp_path: Path) -> None:
    """A classic environment whose ``env_response`` never returns: ``group_timeout_s`` fails that group (its
    rollouts marked failed, counted in ``failed_groups``), the other groups of the call are kept."""
    vf = pytest.importorskip("verifiers")
    import asyncio

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_spmd.envs.verifiers_bridge import VerifiersEnvironment
    from prime_spmd.inference.engine import SamplingParams
    from prime_spmd.inference.native import NativeEngine
    from prime_spmd.models.tiny import build_tiny_model

    class HangsOnOdd(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            if int(state["answer"]) % 2:
                await asyncio.sleep(3600)  # a tool call that never answers
            return [vf.UserMessage(content="Again.")]

    ds = Dataset.from_list([{"question": f"Say {i}.", "answer": str(i)} for i in range(2)])
    env = VerifiersEnvironment(
        HangsOnOdd(dataset=ds, rubric=vf.Rubric(funcs=[lambda completion: 0.5]), max_turns=2),
        reward_timeout_s=None,
        group_timeout_s=2.0,
    )
    path = build_tiny_model(tmp_path / "m", "qwen3-nano", seed=0, initializer_range=0.3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = NativeEngine(model, AutoTokenizer.from_pretrained(path), max_batch_size=8, max_model_len=96, device="cpu")
    groups, failures = run_isolated("hangs", env, engine, "train", [0, 1], 2, SamplingParams(max_tokens=4), 0)
    assert failures == [] and len(groups) == 2
    m = batch_env_metrics(Batch(index=0, groups=groups, group_envs=["hangs", "hangs"]), ["hangs"])
    assert m["env/hangs/failed_groups"] == 1.0 and m["env/hangs/failed_rollouts"] == 2.0
    assert all(r.metrics.get("failed") for r in groups[1]) and not any(r.metrics.get("failed") for r in groups[0])


def test_retry_env_stops_once_solved(qwen3_tokenizer) -> None:
    """reverse_text_retry: a first answer that is the reversal ends the rollout (reward 1, one turn); a wrong
    one gets the feedback and another attempt, scored by the last one minus the retry penalty."""
    pytest.importorskip("verifiers")
    from prime_spmd.envs.verifiers_bridge import VerifiersEnvironment
    from prime_spmd.envs.vf_reverse_retry import load_environment
    from prime_spmd.inference.engine import SamplingParams
    from tests.fakes import ScriptedEngine

    env = VerifiersEnvironment(load_environment(num_train_examples=2, min_chars=5, max_chars=5), reward_timeout_s=None)
    text = env.example("train", 0)["prompt"][0]["content"]
    engine = ScriptedEngine(qwen3_tokenizer, lambda prompt: f"{text[::-1]}<|im_end|>")
    (group,) = env.run_groups(engine, "train", [0], 1, SamplingParams(max_tokens=16), seed=0)
    assert len(engine.prompts) == 1 and group[0].reward == pytest.approx(1.0)
    answers = iter(["zzzzz<|im_end|>", f"{text[::-1]}<|im_end|>"])
    engine = ScriptedEngine(qwen3_tokenizer, lambda prompt: next(answers))
    (group,) = env.run_groups(engine, "train", [0], 1, SamplingParams(max_tokens=16), seed=0)
    assert len(engine.prompts) == 2 and group[0].reward == pytest.approx(0.9)


def test_a_single_environment_takes_batches_without_labels() -> None:
    """A batch restored from a checkpoint written before mixtures has no environment labels: with one
    environment its groups are that environment's."""
    mix = Mixture(_cfg(p=2), _slots({"only": 1.0}))
    mix.plan(0)
    batch = Batch(index=0, groups=[[_rollout(0, k, 0.5) for k in range(2)]])
    metrics, stop = mix.observe(batch)
    assert batch.group_envs == ["only"] and mix.groups == {"only": 1} and stop is None
    assert batch_env_metrics(batch, ["only"])["env/only/reward"] == 0.5
