"""Building a model on the meta device without running ``torch.nn.init``.

Module constructors draw their random init (``nn.Linear`` / ``nn.Embedding`` ``reset_parameters``, our RMSNorm's
``ones_``). On the meta device the draws store nothing, but ``normal_`` and its kin run there through
``torch._refs``, whose first call imports ``torch._dynamo``: 0.7-0.9 s on the 2-core dev VM (2026-12-07), paid by
every CPU run, which compiles nothing, before its first step. Every model this package builds on meta gets its
values afterwards (``load_state_dict``, ``materialize_random``, ``to_empty`` then a load), so ``on_meta`` skips
the init.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

INIT_FNS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip
"""``torch.nn.init``'s in-place initializers: each returns its tensor untouched inside ``on_meta``."""


def _untouched(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """``with torch.device("meta")`` in which ``torch.nn.init``'s initializers do nothing (module attributes,
    restored on exit: not for use while another thread builds a model it means to initialize)."""
    saved = {name: getattr(nn.init, name) for name in INIT_FNS if hasattr(nn.init, name)}
    for name in saved:
        setattr(nn.init, name, _untouched)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
