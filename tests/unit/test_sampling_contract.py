"""The trainer's logprobs must be of the distribution the engine sampled from (issue 15.5).

The trainer recomputes log softmax(logits / --sampling.temperature) with no top-k / top-p / min-p,
so RL refuses filtered sampling, and refuses an environment that overrides the sampling parameters
of training rollouts (eval rollouts may sample as the environment likes).
"""

from __future__ import annotations

import pytest
import verifiers as vf

from prime_spmd.config import EvalJobConfig, RLJobConfig
from prime_spmd.config.sections import ModelConfig, SamplingConfig
from prime_spmd.envs.verifiers_bridge import VerifiersEnvironment
from prime_spmd.inference.engine import SamplingParams
from tests.envs_for_tests import _dataset
from tests.fakes import ScriptedEngine


@pytest.mark.parametrize(
    "field, value", [("top_k", 8), ("top_p", 0.9), ("min_p", 0.05)], ids=["top_k", "top_p", "min_p"]
)
def test_rl_refuses_filtered_sampling(field: str, value: float) -> None:
    model = ModelConfig(path="some/model")  # --model.path is required; its existence is checked at load, not here
    cfg = RLJobConfig(model=model, sampling=SamplingConfig(**{field: value}))
    with pytest.raises(ValueError, match=rf"--sampling.{field}={value}.*trainer"):
        cfg.validate()
    RLJobConfig(model=model, sampling=SamplingConfig(temperature=0.7)).validate()  # temperature alone: matched exactly
    EvalJobConfig(model=model, sampling=SamplingConfig(**{field: value})).validate()  # eval trains nothing: allowed


class _Recording(ScriptedEngine):
    """Records the temperature of every request it gets."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, lambda prompt: "7<|im_end|>")
        self.sampling_seen: list[float] = []

    def add_request(self, request) -> None:
        self.sampling_seen.append(request.sampling.temperature)
        super().add_request(request)


def _env_with_sampling_args(args: dict) -> VerifiersEnvironment:
    ds = _dataset(2)
    rubric = vf.Rubric(funcs=[lambda completion: 1.0])
    env = vf.SingleTurnEnv(dataset=ds, eval_dataset=ds, rubric=rubric, sampling_args=args)
    return VerifiersEnvironment(env, name="overrides", reward_timeout_s=None)


def test_env_sampling_override_is_refused_for_training(qwen3_tokenizer) -> None:
    env = _env_with_sampling_args({"temperature": 0.5})
    sp = SamplingParams(temperature=1.0, max_tokens=4)
    with pytest.raises(ValueError, match=r"'overrides'.*temperature=0.5.*--sampling.temperature=1.0"):
        env.run_groups(_Recording(qwen3_tokenizer), "train", [0], 2, sp, seed=0)
    # eval: the environment's parameters are used as asked
    engine = _Recording(qwen3_tokenizer)
    (group,) = env.run_groups(engine, "eval", [0], 2, sp, seed=0)
    assert len(group) == 2 and all(not r.metrics.get("failed") for r in group)
    assert engine.sampling_seen == [0.5, 0.5]
    # an override equal to the run's own value changes nothing and is accepted
    same = _env_with_sampling_args({"temperature": 1.0})
    (group,) = same.run_groups(_Recording(qwen3_tokenizer), "train", [0], 2, sp, seed=0)
    assert all(not r.metrics.get("failed") for r in group)
