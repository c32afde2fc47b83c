"""Configs: dataclass sections, the three job roots, and the TOML/CLI loader."""

from prime_spmd.config.job import EvalJobConfig, RLJobConfig, SFTJobConfig
from prime_spmd.config.loader import load_toml, parse_cli, to_dict, to_json, write_resolved_config

__all__ = [
    "EvalJobConfig",
    "RLJobConfig",
    "SFTJobConfig",
    "load_toml",
    "parse_cli",
    "to_dict",
    "to_json",
    "write_resolved_config",
]
