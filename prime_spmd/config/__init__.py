"""Configs: dataclass sections, the three job roots, and the TOML/CLI loader.

The loader (tyro) is imported on first use of one of its names, so that the sections import where the CLI stack is
not installed (the engine and the models read their sections; the GPU machine's image has no tyro).
"""

from prime_spmd.config.job import EvalJobConfig, RLJobConfig, SFTJobConfig

_LOADER = ("load_toml", "parse_cli", "to_dict", "to_json", "write_resolved_config")

__all__ = ["EvalJobConfig", "RLJobConfig", "SFTJobConfig", *_LOADER]


def __getattr__(name: str):
    if name in _LOADER:
        from prime_spmd.config import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'prime_spmd.config' has no attribute {name!r}")
