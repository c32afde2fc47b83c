"""User functions the RL config names by dotted path (``--rollout.curriculum``, ...): ``import_function``."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any


def import_function(path: str, flag: str) -> Callable[..., Any]:
    """``pkg.module:function`` or ``path/to/file.py:function``; ``ValueError`` naming ``flag`` otherwise."""
    target, _, name = path.partition(":")
    if not name:
        raise ValueError(f"--{flag}={path!r}: expected pkg.module:function or path/to/file.py:function")
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"ps_fn_{Path(target).stem}", target)
        if spec is None or spec.loader is None or not Path(target).is_file():
            raise ValueError(f"--{flag}={path!r}: no such file {target}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--{flag}={path!r}: {target} has no function {name}")
    return fn
