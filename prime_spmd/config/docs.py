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

from prime_spmd.config.job import RL_DEFAULT_LR, SFT_DEFAULT_LR, EvalJobConfig, RLJobConfig, SFTJobConfig

HEADER = f"""# Configuration

Generated from the config dataclasses by `python -m prime_spmd.config.docs`; do not edit by hand.

A subcommand's config is a dataclass of sections. A TOML file (`--config FILE.toml`, see `configs/`)
gives the defaults; dotted CLI flags override them (`--optim.lr 3e-4`, `--log.no_plots` for booleans).
Unknown TOML keys, wrong types and values outside a field's range are errors that name the key, the
file and what is allowed. `--dry_run` prints the config; every run writes it to `<output_dir>/config.json`
with a `resolved` block: what each `auto` setting (and each 0 or None that means "pick") resolved to on that
run, by flag (e.g. `"trainer.loss_impl": "reference"`). `python -m prime_spmd SUBCOMMAND --help` shows the
same text, and each subcommand shows only the flags it reads.

`--model.path` is required. `--optim.lr` defaults per subcommand: sft {SFT_DEFAULT_LR:g}, rl {RL_DEFAULT_LR:g} (full fine-tuning of a
pretrained model); LoRA runs and the tiny random models of the recipes in `configs/` train at larger rates, so
the recipes set `lr` themselves.
"""


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (the string statement after each annotation), base classes'
    fields included."""
    docs: dict[str, str] = {}
    for klass in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
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


def _default(f: dataclasses.Field, default: object) -> str:
    """The default of field ``f`` as the subcommand sets it (``default``: the job's section instance, whose
    values may differ from the class's, e.g. --optim.lr), or "required"."""
    if default is not None:
        return f"`{getattr(default, f.name)!r}`"
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{f.default_factory()!r}`"  # type: ignore[misc]
    return "required"


def render_section(cls: type, prefix: str, default: object = None) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows = ["| flag | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        value = _default(f, default)
        rows.append(f"| `--{prefix}{f.name}` | {_type(hints[f.name])} | {value} | {docs.get(f.name, '')} |")
    return rows


def render() -> str:
    out = [HEADER]
    seen: set[tuple[type, str]] = set()  # (section class, defaults): a section is shown again where they differ
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
            if not dataclasses.is_dataclass(sec):
                continue
            default = f.default_factory()  # type: ignore[misc]
            if (sec, repr(default)) in seen:
                continue
            title = sec.__name__
            if any(cls is sec for cls, _ in seen):
                title += f" (`{name}`'s defaults)"
            seen.add((sec, repr(default)))
            out += [f"### `[{f.name}]` {title}", "", *render_section(sec, f.name + ".", default), ""]
            sub_hints = typing.get_type_hints(sec)
            for g in dataclasses.fields(sec):  # nested sections, e.g. [model.lora]
                sub = sub_hints[g.name]
                if dataclasses.is_dataclass(sub) and (sub, "") not in seen:
                    seen.add((sub, ""))
                    path = f"{f.name}.{g.name}"
                    out += [f"### `[{path}]` {sub.__name__}", "", *render_section(sub, path + "."), ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
