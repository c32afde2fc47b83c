"""A verifiers environment with no train split: training on its eval split must be asked for."""

from __future__ import annotations

import logging

import pytest
import verifiers as vf
from datasets import Dataset

from prime_spmd.config.sections import EnvConfig
from prime_spmd.envs.verifiers_bridge import VerifiersEnvironment, load_verifiers_environment


def load_eval_only_env() -> vf.Environment:
    ds = Dataset.from_list([{"question": f"q{i}", "answer": str(i)} for i in range(3)])
    return vf.SingleTurnEnv(eval_dataset=ds, rubric=vf.Rubric(funcs=[lambda completion: 0.0]))


def test_train_split_never_silently_falls_back_to_eval(caplog) -> None:
    env = load_verifiers_environment(EnvConfig(name="tests.unit.test_env_splits:load_eval_only_env"))
    with pytest.raises(ValueError, match=r"has no train split.*--env.train_on_eval_split"):
        env.num_examples("train")
    assert env.num_examples("eval") == 3  # eval is unaffected

    allowed = VerifiersEnvironment(load_eval_only_env(), name="eval-only", train_on_eval_split=True)
    with caplog.at_level(logging.WARNING, logger="prime_spmd"):
        assert allowed.num_examples("train") == 3
    assert any("trains on its EVAL split" in r.getMessage() for r in caplog.records), caplog.records
    assert EnvConfig(train_on_eval_split=True).train_on_eval_split
