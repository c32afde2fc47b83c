"""The store-key stop/go protocol between the controller and the inference ranks (disjoint mode).

Trainer ranks agree on a stop through ``train_step``'s all-reduce; inference ranks take no part in
it, so two keys of the job's TCPStore carry the decision across roles:

- an inference rank that got SIGTERM/SIGINT sets ``stop_request_key()``; the controller checks it
  before every step and folds it into its own stop flag;
- after every step j that the schedule follows with a weight sync (``batch_after_step`` is not None),
  the controller sets ``go_key(j)`` to b"go" or b"stop". Inference ranks read it (blocking) before
  they wait for w_(j+1): on b"stop" they flush their rollouts and leave instead of waiting for
  weights that will not come.

Keys carry torchrun's restart count, since its agent store outlives a worker restart.
"""

from __future__ import annotations

import os
from typing import Protocol


class Store(Protocol):
    """The part of ``torch.distributed.Store`` the protocol uses."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


def _attempt() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def go_key(j: int) -> str:
    """Store key the controller sets after step j: b"go" or b"stop"."""
    return f"rl/{_attempt()}/go/{j}"


def stop_request_key() -> str:
    """Store key an inference rank sets when it got SIGTERM/SIGINT."""
    return f"rl/{_attempt()}/stop_request"


def request_stop(store: Store) -> None:
    """Inference rank: ask the controller to stop the run (it sees this before its next step)."""
    store.set(stop_request_key(), "1")


def stop_was_requested(store: Store) -> bool:
    """Controller: whether an inference rank asked to stop (does not block)."""
    return store.check([stop_request_key()])


def post_go(store: Store, j: int, go: bool) -> None:
    """Controller, after step j: tell the inference ranks whether w_(j+1) follows."""
    store.set(go_key(j), "go" if go else "stop")


def wait_go(store: Store, j: int) -> bool:
    """Inference rank: block until the controller finished step j; True on "go", False on "stop"."""
    return store.get(go_key(j)) != b"stop"


def plan_key(b: int) -> str:
    """Store key of batch b's plan (rl/mixture.py), posted by the controller for the inference ranks."""
    return f"rl/{_attempt()}/plan/{b}"
