"""TOML recipes -> config dataclasses -> tyro CLI.

A TOML file gives the defaults, dotted CLI flags override them. Every TOML key is checked against
the dataclass: an unknown key or a value of the wrong type is a ``ValueError`` naming the key, the
file and what is allowed. Section ``__post_init__`` checks then run on the merged values.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import tyro

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check one TOML value against a field type; return it (ints widen to floats)."""
    origin = get_origin(tp)
    bad = ValueError(f"{source}: key '{key}' = {value!r} has the wrong type; expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            hint = " (several environments: [[envs]] tables)" if key == "env" and isinstance(value, list) else ""
            raise ValueError(f"{source}: key '{key}' must be a table ([{key}]){hint}, got {value!r}")
        return build_dataclass(tp, value, source, prefix=key + ".")
    if origin is Literal:
        if value not in get_args(tp):
            raise ValueError(f"{source}: key '{key}' = {value!r} is not allowed; allowed values: {get_args(tp)}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return {str(k): str(v) for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise bad
        (arm,) = get_args(tp)
        return [_coerce(v, arm, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for arm in get_args(tp):
            try:
                return _coerce(value, arm, key, source)
            except ValueError:
                continue
        raise bad
    if tp is type(None):
        if value is not None:
            raise bad
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    raise bad


def build_dataclass(cls: type[T], values: dict[str, Any], source: str, prefix: str = "") -> T:
    """Build ``cls`` from a (nested) dict, rejecting unknown keys and wrong types by name."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in names:
            raise ValueError(f"{source}: unknown key '{prefix}{key}'; allowed keys here: {', '.join(sorted(names))}")
        kwargs[key] = _coerce(value, hints[key], prefix + key, source)
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


def load_toml(cls: type[T], path: str | Path) -> T:
    """Read a TOML recipe into ``cls``; fields missing from the file keep their dataclass defaults."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config={str(path)!r}: no such file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from e
    data.pop("config", None)
    cfg = build_dataclass(cls, data, str(path))
    cfg.config = str(path)  # type: ignore[attr-defined]
    return cfg


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def parse_cli(cls: type[T], argv: list[str], prog: str) -> T:
    """Parse ``argv`` into ``cls``: defaults from ``--config FILE.toml`` if given, then CLI flags.

    Runs ``validate()`` (cross-section rules) on the result. Raises ``ValueError`` for bad TOML.
    """
    path = _config_path(argv)
    default = load_toml(cls, path) if path else None
    cfg = tyro.cli(cls, default=default, args=argv, prog=prog, use_underscores=True)
    if path:
        cfg.config = path  # type: ignore[attr-defined]
    cfg.validate()  # type: ignore[attr-defined]
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts (JSON-serializable)."""
    return dataclasses.asdict(cfg)


def to_json(cfg: Any) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=False)


# Settings where a value other than "auto" leaves the choice to the run: flag -> that value.
PICKED_BY_RUN: dict[str, object] = {
    "topology.bridge_timeout_s": 0,
    "inference.max_model_len": 0,
    "inference.native.decode_steps_per_launch": 0,
    "model.router_aux_loss_coef": None,
}


def auto_flags(cfg: Any) -> list[str]:
    """Dotted flags of ``cfg`` whose value leaves the choice to the run: "auto", or the values of ``PICKED_BY_RUN``."""
    found: list[str] = []

    def walk(d: dict[str, Any], prefix: str) -> None:
        for key, value in d.items():
            flag = prefix + key
            if isinstance(value, dict) and key != "args":
                walk(value, flag + ".")
            elif value == "auto" or (flag in PICKED_BY_RUN and value == PICKED_BY_RUN[flag]):
                found.append(flag)

    walk(to_dict(cfg), "")
    return found


def write_resolved_config(cfg: Any, output_dir: str | Path, resolved: dict[str, Any] | None = None) -> Path:
    """Write the config as ``<output_dir>/config.json`` (call on one rank); return the path.

    ``resolved`` (flag -> value: what each ``auto_flags`` setting resolved to on this run, e.g.
    ``{"trainer.loss_impl": "reference"}``) goes under the key ``resolved``; the other keys are the config as given.
    """
    data = to_dict(cfg)
    if resolved:
        data["resolved"] = resolved
    path = Path(output_dir) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
