"""Render docs/configuration.md from the config dataclasses (field, type, default, docstring).

    python -m prime_spmd.config.docs > docs/configuration.md

A unit test checks the committed file is up to date, so the docs cannot drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

from prime_spmd.config.job import EvalJobConfig, RLJobConfig, SFTJobConfig

HEADER = """# Configuration

Generated from the config dataclasses by `python -m prime_spmd.config.docs`; do not edit by hand.

A subcommand's config is a dataclass of sections. A TOML file (`--config FILE.toml`, see `configs/`)
gives the defaults; dotted CLI flags override them (`--optim.lr 3e-4`, `--log.no_plots` for booleans).
Unknown TOML keys, wrong types and values outside a field's range are errors that name the key, the
file and what is allowed. `--dry_run` prints the resolved config; every run writes it to
`<output_dir>/config.json`. `python -m prime_spmd SUBCOMMAND --help` shows the same text.
"""


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (the string statement after each annotation)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for prev, node in zip(body, body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name):
            if (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _type(tp: typing.Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{_type(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp)).replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        v = f.default_factory()  # type: ignore[misc]
        return "" if dataclasses.is_dataclass(v) else f"`{v!r}`"
    return "required"


def render_section(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows = ["| flag | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        rows.append(f"| `--{prefix}{f.name}` | {_type(hints[f.name])} | {_default(f)} | {docs.get(f.name, '')} |")
    return rows


def render() -> str:
    out = [HEADER]
    seen: set[type] = set()
    for name, job in (("sft", SFTJobConfig), ("rl", RLJobConfig), ("eval", EvalJobConfig)):
        hints = typing.get_type_hints(job)
        out += [f"## `{name}` ({job.__name__})", "", *render_section(job, ""), ""]
        for f in dataclasses.fields(job):
            sec = hints[f.name]
            if not dataclasses.is_dataclass(sec):
                continue
            out.append(f"- `[{f.name}]` ({sec.__name__}): {field_docs(job).get(f.name, '')}")
        out.append("")
        for f in dataclasses.fields(job):
            sec = hints[f.name]
            if dataclasses.is_dataclass(sec) and sec not in seen:
                seen.add(sec)
                out += [f"### `[{f.name}]` {sec.__name__}", "", *render_section(sec, f.name + "."), ""]
                sub_hints = typing.get_type_hints(sec)
                for g in dataclasses.fields(sec):  # nested sections, e.g. [model.lora]
                    sub = sub_hints[g.name]
                    if dataclasses.is_dataclass(sub) and sub not in seen:
                        seen.add(sub)
                        path = f"{f.name}.{g.name}"
                        out += [f"### `[{path}]` {sub.__name__}", "", *render_section(sub, path + "."), ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
