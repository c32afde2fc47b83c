"""``--env.name`` -> an ``Environment``: built-ins by name, anything else through the verifiers bridge."""

from __future__ import annotations

from prime_spmd.config.sections import EnvConfig
from prime_spmd.envs.base import Environment

BUILTINS = ("reverse_text",)


def load_environment(cfg: EnvConfig) -> Environment:
    """The built-in environment named ``cfg.name``, else the installed verifiers environment of that id."""
    if cfg.name == "reverse_text":
        from prime_spmd.envs.reverse_text import ReverseTextEnv

        return ReverseTextEnv(seed=cfg.seed, num_eval_examples=cfg.num_eval_examples, args=cfg.args)
    from prime_spmd.envs.verifiers_bridge import load_verifiers_environment

    return load_verifiers_environment(cfg)
