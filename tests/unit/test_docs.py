"""Docs that are generated from code must match it."""

from pathlib import Path

from prime_spmd.config.docs import render

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_md_is_current() -> None:
    assert (ROOT / "docs/configuration.md").read_text() == render(), (
        "docs/configuration.md is stale: run `python -m prime_spmd.config.docs > docs/configuration.md`"
    )


def test_every_config_field_has_a_docstring() -> None:
    import dataclasses

    from prime_spmd.config.docs import field_docs
    from prime_spmd.config.job import EvalJobConfig, RLJobConfig, SFTJobConfig

    for job in (SFTJobConfig, RLJobConfig, EvalJobConfig):
        for f in dataclasses.fields(job):
            assert f.name in field_docs(job), f"{job.__name__}.{f.name}"
            v = getattr(job(), f.name)
            if dataclasses.is_dataclass(v):
                missing = [g.name for g in dataclasses.fields(v) if g.name not in field_docs(type(v))]
                assert not missing, f"{type(v).__name__}: fields without a docstring: {missing}"
