"""``--env.name`` -> an ``Environment``: built-ins by name, anything else through a verifiers bridge.

Which bridge follows the installed verifiers (docs/environments.md, "Which verifiers, with which
vLLM"): 0.3.x -> the classic API (verifiers_bridge.py: ``vf.SingleTurnEnv`` & co.); >= 0.4 -> the v1
API (vf_v1.py: ``vf.Taskset`` + ``vf.Harness``). An environment written for the other API is a
``ValueError`` naming it and the installed version. Neither bridge is imported for a built-in, so
built-ins run with either verifiers, or none.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Literal

from prime_spmd.config.sections import EnvConfig
from prime_spmd.envs.base import Environment
from prime_spmd.envs.number_list import NumberListEnv
from prime_spmd.envs.reverse_text import ReverseTextEnv
from prime_spmd.envs.visual import VisualEnv

BUILTINS = ("reverse_text", "number_list", "visual")


def verifiers_api() -> tuple[Literal["classic", "v1"] | None, str]:
    """(the API the installed verifiers offers, its version); (None, "") when it is not installed."""
    try:
        installed = version("verifiers")
    except PackageNotFoundError:
        return None, ""
    major_minor = tuple(int(p) if p.isdigit() else 0 for p in installed.split(".")[:2])
    return ("v1" if major_minor >= (0, 4) else "classic"), installed


def load_environment(cfg: EnvConfig) -> Environment:
    """The built-in environment named ``cfg.name``, else the verifiers environment of that id."""
    if cfg.name == "reverse_text":
        return ReverseTextEnv(seed=cfg.seed, num_eval_examples=cfg.num_eval_examples, args=cfg.args)
    if cfg.name == "number_list":
        return NumberListEnv(seed=cfg.seed, num_eval_examples=cfg.num_eval_examples, args=cfg.args)
    if cfg.name == "visual":
        return VisualEnv(seed=cfg.seed, num_eval_examples=cfg.num_eval_examples, args=cfg.args)
    api, installed = verifiers_api()
    if api is None:
        raise ValueError(
            f"--env.name {cfg.name!r} is not a built-in ({', '.join(BUILTINS)}) and verifiers is not installed"
        )
    source = _source_text(cfg.name)
    v1_source = source is not None and ("import verifiers.v1" in source or "from verifiers.v1" in source)
    if api == "v1":
        from prime_spmd.envs.vf_v1 import classic_mismatch, load_v1_environment

        if source is not None and "verifiers" in source and not v1_source:
            raise ValueError(classic_mismatch(cfg.name))
        return load_v1_environment(cfg)
    if v1_source:
        raise ValueError(
            f"--env.name {cfg.name!r} is a verifiers v1 environment (vf.Taskset + vf.Harness, verifiers>=0.4,<0.5), "
            f"but the installed verifiers is {installed}: this venv runs classic environments only "
            "(use the vLLM venv, .venv-vllm, which has verifiers 0.4)"
        )
    from prime_spmd.envs.verifiers_bridge import load_verifiers_environment

    return load_verifiers_environment(cfg)


def _source_text(name: str) -> str | None:
    """The source of the file ``name`` points at (a ``.py`` path or a module, before any ``:``), read, not
    imported (an environment for the other verifiers API need not import here); None when not found."""
    target = name.partition(":")[0]
    if target.endswith(".py"):
        path: Path | None = Path(target)
    else:
        try:
            spec = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            return None
        path = Path(spec.origin) if spec is not None and spec.origin not in (None, "built-in", "frozen") else None
    if path is None or not path.is_file():
        return None
    return path.read_text(errors="replace")
