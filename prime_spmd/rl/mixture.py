"""The controller's mixture of environments: which prompts of which environment go into each batch.

Every rank loads every environment (``load_envs``); only the controller (global rank 0) holds a
``Mixture``, decides each batch's prompts (``plan``) and publishes them to the generating ranks
(rl/roles.py). What it decides from, all saved in checkpoints (``state_dict``), so a resumed run plans
the same batches:

- composition: each of a batch's ``--rollout.prompts_per_step`` slots goes to the environment with the
  most accumulated credit, every environment gaining ``weight / sum(weights)`` per slot (smooth weighted
  round robin): a batch holds within one prompt of each environment's quota and a run's counts follow
  the ratios exactly; ``--rollout.curriculum`` may replace the weights per batch;
- order: each environment walks a seeded permutation of its train split, a new one per epoch;
- difficulty filtering (``--rollout.filter_difficulty``): a prompt whose last group was all solved
  (every reward >= 1 - 1e-6) or earned nothing (every reward <= 1e-6) is skipped when the walk meets
  it, and re-checked (planned again ahead of the walk) ``--rollout.filter_recheck_steps`` batches after
  the batch that showed it;
- failures: each environment's groups and failed groups (rl/isolation.py); past
  ``--rollout.max_env_failure_rate`` the run stops with a message naming the environment.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from prime_spmd.config import RLJobConfig
from prime_spmd.config.sections import EnvConfig, env_label
from prime_spmd.envs.base import Environment
from prime_spmd.envs.loader import load_environment
from prime_spmd.rl.hooks import import_function
from prime_spmd.rl.types import Batch

PASS = 1.0 - 1e-6
"""A sample passes (eval pass@k, filtering) when its reward is at least this, as in the ``eval`` job."""
NOTHING = 1e-6
"""A group earned nothing when every reward is at most this."""
MIN_GROUPS_FOR_FAILURE_RATE = 4

Plan = dict[str, list[int]]
"""A batch's prompts: environment label -> train example ids, in the order the environments are listed."""


@dataclass(kw_only=True)
class EnvSlot:
    """One environment of the run: its label (metrics, plans), its config and the loaded environment."""

    label: str
    cfg: EnvConfig
    env: Environment


def load_envs(cfg: RLJobConfig) -> list[EnvSlot]:
    """Load every environment of the run ([[envs]], else [env]); every rank calls it."""
    return [EnvSlot(label=env_label(c), cfg=c, env=load_environment(c)) for c in cfg.environments()]


class Mixture:
    """The controller's batch planner and per-environment counters (see the module doc)."""

    def __init__(self, cfg: RLJobConfig, slots: list[EnvSlot]) -> None:
        self.labels = [s.label for s in slots]
        self.base_weights = {s.label: s.cfg.weight for s in slots}
        self.sizes = {s.label: s.env.num_examples("train") for s in slots}
        self.prompts_per_step = cfg.rollout.prompts_per_step
        self.seed = cfg.trainer.seed
        self.filter = cfg.rollout.filter_difficulty
        self.recheck_steps = cfg.rollout.filter_recheck_steps
        self.max_failure_rate = cfg.rollout.max_env_failure_rate
        self.curriculum = (
            import_function(cfg.rollout.curriculum, "rollout.curriculum") if cfg.rollout.curriculum else None
        )
        self._perms: dict[tuple[str, int], list[int]] = {}
        # --- state (state_dict) ---
        self.credit = {label: 0.0 for label in self.labels}
        self.cursor = {label: 0 for label in self.labels}
        self.skip_until: dict[tuple[str, int], int] = {}
        self.recheck: list[tuple[int, str, int]] = []
        self.plans: dict[int, Plan] = {}
        self.plan_counts: dict[int, dict[str, dict[str, float]]] = {}
        self.groups = {label: 0 for label in self.labels}
        self.failed_groups = {label: 0 for label in self.labels}

    # ---- planning -------------------------------------------------------------------------------
    def weights_at(self, b: int) -> dict[str, float]:
        """The weights batch b is composed by: the [[envs]] weights, or the curriculum's for step b."""
        if self.curriculum is None:
            return dict(self.base_weights)
        got = self.curriculum(b)
        if not isinstance(got, dict) or set(got) - set(self.labels):
            raise ValueError(f"--rollout.curriculum returned {got!r} for step {b}: keys must be among {self.labels}")
        weights = {label: float(got.get(label, 0.0)) for label in self.labels}
        if any(w < 0 for w in weights.values()) or not any(w > 0 for w in weights.values()):
            raise ValueError(f"--rollout.curriculum returned {got!r} for step {b}: weights must be >= 0, one > 0")
        return weights

    def apportion(self, weights: dict[str, float]) -> dict[str, int]:
        """Prompts per environment for one batch (smooth weighted round robin over the batch's slots)."""
        total = sum(weights.values())
        counts = {label: 0 for label in self.labels}
        for _ in range(self.prompts_per_step):
            for label in self.labels:
                self.credit[label] += weights[label] / total
            pick = max(self.labels, key=lambda lb: (self.credit[lb], -self.labels.index(lb)))
            self.credit[pick] -= 1.0
            counts[pick] += 1
        return counts

    def plan(self, b: int) -> Plan:
        """Batch b's prompts (decided once: a batch planned before a checkpoint keeps its plan on resume)."""
        if b not in self.plans:
            weights = self.weights_at(b)
            counts = self.apportion(weights)
            self.plan_counts[b] = {lb: {"skipped": 0.0, "rechecked": 0.0, "weight": weights[lb]} for lb in self.labels}
            self.plans[b] = {label: self._take(label, counts[label], b) for label in self.labels}
        return self.plans[b]

    def _order(self, label: str, pos: int) -> int:
        n = self.sizes[label]
        epoch, i = divmod(pos, n)
        key = (label, epoch)
        if key not in self._perms:
            perm = list(range(n))
            random.Random(f"mixture/{self.seed}/{label}/{epoch}").shuffle(perm)
            self._perms = {k: v for k, v in self._perms.items() if k[0] != label}  # one epoch per env in memory
            self._perms[key] = perm
        return self._perms[key][i]

    def _take(self, label: str, n: int, b: int) -> list[int]:
        ids: list[int] = []
        counts = self.plan_counts[b][label]
        due = [x for x in self.recheck if x[1] == label and x[0] <= b]
        for item in due[:n]:
            self.recheck.remove(item)
            self.skip_until.pop((label, item[2]), None)
            ids.append(item[2])
            counts["rechecked"] += 1
        skipped_in_a_row = 0
        while len(ids) < n:
            eid = self._order(label, self.cursor[label])
            self.cursor[label] += 1
            if self.skip_until.get((label, eid), -1) > b and skipped_in_a_row < self.sizes[label]:
                counts["skipped"] += 1
                skipped_in_a_row += 1
                continue
            ids.append(eid)
        return ids

    # ---- observing trained batches -----------------------------------------------------------
    def observe(self, batch: Batch) -> tuple[dict[str, float], str | None]:
        """Controller, when batch j is taken: update filtering and failure counts from its groups.

        Returns (per-environment metrics of the planning: prompts, weight, skipped, rechecked, filtered;
        the stop message when an environment's failure rate passed ``--rollout.max_env_failure_rate``)."""
        from prime_spmd.rl.samples import is_failed  # samples -> advantages -> hooks; not at import (no cycle)

        if len(getattr(batch, "group_envs", [])) != len(batch.groups) or "" in batch.group_envs:
            # a batch from a checkpoint written before mixtures (one environment, no labels)
            assert len(self.labels) == 1, "a batch without environment labels in a mixture"
            batch.group_envs, batch.failures = self.labels * len(batch.groups), getattr(batch, "failures", [])
        b = batch.index
        counts = self.plan_counts.pop(b, {label: {} for label in self.labels})
        plan = self.plans.pop(b, {})
        metrics: dict[str, float] = {}
        filtered = {label: 0 for label in self.labels}
        for label, group in zip(batch.group_envs, batch.groups):
            self.groups[label] += 1
            ok = [r for r in group if not is_failed(r)]
            if not ok:
                self.failed_groups[label] += 1
                continue
            solved = all(r.reward >= PASS for r in ok)
            nothing = all(r.reward <= NOTHING for r in ok)
            if self.filter and (solved or nothing) and (label, group[0].example_id) not in self.skip_until:
                due = b + self.recheck_steps
                self.skip_until[(label, group[0].example_id)] = due
                self.recheck.append((due, label, group[0].example_id))
                filtered[label] += 1
        for label, _eid, _reason in batch.failures:
            self.groups[label] += 1
            self.failed_groups[label] += 1
        for label in self.labels:
            metrics[f"env/{label}/prompts"] = float(len(plan.get(label, [])))
            for key, value in counts.get(label, {}).items():
                metrics[f"env/{label}/{key}" + ("_prompts" if key != "weight" else "")] = value
            metrics[f"env/{label}/filtered_prompts"] = float(filtered[label])
        return metrics, self.failure_message()

    def failure_message(self) -> str | None:
        """The stop message when an environment failed more than ``--rollout.max_env_failure_rate`` of its groups."""
        for label in self.labels:
            n, bad = self.groups[label], self.failed_groups[label]
            if n >= MIN_GROUPS_FOR_FAILURE_RATE and bad / n > self.max_failure_rate:
                return (
                    f"environment {label!r} failed {bad} of its {n} groups so far ({bad / n:.0%}), more than "
                    f"--rollout.max_env_failure_rate={self.max_failure_rate}: see the warnings above for its errors "
                    "(raised, timed out, or bad rewards); fix the environment or raise the flag"
                )
        return None

    # ---- checkpoints ------------------------------------------------------------------------
    STATE = ("credit", "cursor", "skip_until", "recheck", "plans", "plan_counts", "groups", "failed_groups")

    def state_dict(self) -> dict[str, Any]:
        """Everything planning depends on (plain Python data; pickled into the checkpoint)."""
        return {"labels": list(self.labels), **{k: getattr(self, k) for k in self.STATE}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["labels"] != self.labels:
            raise ValueError(
                f"the checkpoint's environments {state['labels']} differ from this run's {self.labels}: resume "
                "with the same [[envs]] (labels and order)"
            )
        for k in self.STATE:
            setattr(self, k, state[k])
