"""Run ``verifiers`` environments (classic API, verifiers>=0.3.1,<0.4) in-process, token-exact.

``load_verifiers_environment(cfg)`` loads an environment by id (``vf.load_environment``), by
``module:function`` import path, or from a ``.py`` file, and wraps it as our ``Environment``.
``VerifiersEnvironment.run_groups`` runs ``env.run_group(..., state_columns=["trajectory", ...])``
for every example concurrently, with an ``EngineClient`` (prime_spmd/envs/vf_client.py) over one
``AsyncEngine``, so all rollouts of the call share the engine's continuous batch.
Each result becomes a ``Rollout`` built from the trajectory's token ids only (no re-tokenization):

    prompt_ids      = turn 0's prompt ids
    completion_ids  = turn 0 completion + (env tokens + completion) of each later turn
    completion_mask = 1 on engine-sampled tokens, 0 on env tokens

Failures never stop the run (docs/environments.md): a reward function that raises, hangs past
``reward_timeout_s`` or returns garbage (vf_rewards.py), an environment error (a ``vf.Error`` the
environment records in ``state["error"]``), a rollout past ``rollout_timeout_s``, or an exception
escaping ``run_group`` (the whole group) all give reward 0 and ``metrics["failed"] = 1`` plus a
counter naming the cause; the caller decides whether to drop failed samples. Bad image input is not
such a failure: an image the processor cannot read, or an image given to a text-only model, raises a
``ValueError`` naming the environment (``EngineClient.input_errors``).
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import importlib.util
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import verifiers as vf

from prime_spmd.config.sections import EnvConfig
from prime_spmd.envs.base import Environment
from prime_spmd.envs.rollout import Rollout
from prime_spmd.envs.vf_client import SEED_KEY, STATS_KEY, ChatRenderer, EngineClient, refuse_sampling_overrides
from prime_spmd.envs.vf_output import failed_group, output_to_rollout
from prime_spmd.envs.vf_rewards import guard_rubric
from prime_spmd.inference.engine import AsyncEngine, EngineFailure, InferenceEngine, SamplingParams

logger = logging.getLogger("prime_spmd")
MODEL = "prime-spmd"  # the model name run_group gets (our client serves the one engine)


def parse_env_args(args: dict[str, str]) -> dict[str, Any]:
    """``--env.args`` values are strings; JSON values (numbers, booleans, lists, objects) are decoded."""
    out: dict[str, Any] = {}
    for k, v in args.items():
        try:
            out[k] = json.loads(v) if isinstance(v, str) else v
        except json.JSONDecodeError:
            out[k] = v
    return out


def import_vf_environment(name: str, args: dict[str, Any]) -> Any:
    """A classic verifiers environment object from ``name``:

    - ``pkg.module:function`` or ``path/to/file.py:function``: call that function with ``args``;
    - ``path/to/file.py``: call the file's ``load_environment``;
    - anything else: ``vf.load_environment(name, **args)`` (an installed environment package).
    """
    target, _, func_name = name.partition(":")
    if target.endswith(".py") or func_name:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise ValueError(f"--env.name {name!r}: no such file {path}")
            spec = importlib.util.spec_from_file_location(f"ps_env_{path.stem}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        fn = getattr(module, func_name or "load_environment", None)
        if fn is None:
            raise ValueError(f"--env.name {name!r}: {target} has no function {func_name or 'load_environment'}")
        env = fn(**args)
    else:
        env = vf.load_environment(name, **args)
    if not isinstance(env, vf.Environment):
        raise ValueError(f"--env.name {name!r} returned {type(env).__name__}, not a verifiers Environment")
    return env


def load_verifiers_environment(cfg: EnvConfig) -> VerifiersEnvironment:
    """Load ``cfg.name`` with ``cfg.args`` (see ``import_vf_environment``) and wrap it.

    ``cfg.reward_timeout_s`` and ``cfg.rollout_timeout_s`` (0: no limit) go to ``VerifiersEnvironment``.
    """
    env = import_vf_environment(cfg.name, parse_env_args(cfg.args))
    return VerifiersEnvironment(
        env,
        name=cfg.name,
        num_eval_examples=cfg.num_eval_examples,
        seed=cfg.seed,
        reward_timeout_s=cfg.reward_timeout_s or None,
        rollout_timeout_s=cfg.rollout_timeout_s or None,
        train_on_eval_split=cfg.train_on_eval_split,
        group_timeout_s=cfg.group_timeout_s or None,
    )


class VerifiersEnvironment(Environment):
    """Our ``Environment`` over a classic verifiers environment object (see module doc).

    ``reward_timeout_s``: limit per reward-function call (None: no limit, plain functions run inline).
    ``rollout_timeout_s``: sets the environment's ``timeout_seconds`` when it has none (a rollout
    past it stops with ``stop_condition == "timeout_reached"``; counted as ``env_timeouts``).
    ``check_rerender``: count turns whose stitched prompt differs from a fresh render of the messages.
    ``train_on_eval_split``: an environment without a train dataset trains on its eval split (with a
    warning); without it, asking for the train split of such an environment raises ``ValueError``.
    ``group_timeout_s``: limit per group on the ``run_group`` path (None: none); past it the group fails.
    """

    def __init__(
        self,
        vf_env: Any,
        *,
        name: str = "verifiers",
        num_eval_examples: int = 64,
        seed: int = 0,
        reward_timeout_s: float | None = 60.0,
        rollout_timeout_s: float | None = None,
        check_rerender: bool = True,
        train_on_eval_split: bool = False,
        group_timeout_s: float | None = None,
    ) -> None:
        self.vf_env = vf_env
        self.group_timeout_s = group_timeout_s
        self.train_on_eval_split = train_on_eval_split
        self.name = name
        self.num_eval_examples = num_eval_examples
        self.seed = seed
        self.check_rerender = check_rerender
        guard_rubric(vf_env.rubric, reward_timeout_s)
        if rollout_timeout_s is not None and getattr(vf_env, "timeout_seconds", None) is None:
            vf_env.timeout_seconds = rollout_timeout_s
        self._splits: dict[str, Any] = {}
        self._rows: dict[tuple[str, int], dict[str, Any]] = {}
        self._plain_rows: dict[tuple[str, int], bool] = {}
        self._renderer: ChatRenderer | None = None

    def _split(self, split: Literal["train", "eval"]) -> Any:
        if split not in self._splits:
            if split == "train":
                ds = self.vf_env.get_dataset() if self.vf_env.build_dataset() is not None else None
                if ds is None:
                    if not self.train_on_eval_split:
                        raise ValueError(
                            f"environment {self.name!r} has no train split (no `dataset`); training on its "
                            "eval split would report eval rewards of prompts it trained on. Give it a train "
                            "dataset, or pass --env.train_on_eval_split true to train on the eval split anyway"
                        )
                    logger.warning(
                        f"environment {self.name!r} has no train split: it trains on its EVAL split "
                        "(--env.train_on_eval_split); its eval rewards are then not held out"
                    )
                    ds = self.vf_env.get_eval_dataset()
            else:
                ds = self.vf_env.get_eval_dataset(n=self.num_eval_examples)
            self._splits[split] = ds
        return self._splits[split]

    def num_examples(self, split: Literal["train", "eval"]) -> int:
        return len(self._split(split))

    def example(self, split: Literal["train", "eval"], index: int) -> dict[str, Any]:
        return copy.deepcopy(self._row(split, index))

    def _row(self, split: Literal["train", "eval"], index: int) -> dict[str, Any]:
        """The cached dataset row (not a copy: callers must not mutate it)."""
        key = (split, index)
        if key not in self._rows:  # a datasets row read costs ~0.1 ms; rollouts re-read their example
            row = dict(self._split(split)[index])
            row.setdefault("answer", "")
            self._rows[key] = row
            self._plain_rows[key] = is_plain_tree(row)
        return self._rows[key]

    def run_groups(
        self,
        engine: InferenceEngine,
        split: Literal["train", "eval"],
        example_ids: list[int],
        group_size: int,
        sampling: SamplingParams,
        seed: int,
    ) -> list[list[Rollout]]:
        """See ``Environment.run_groups``. Runs its own event loop (``asyncio.run``): call it from sync code."""
        coro = self.arun_groups(engine, split, example_ids, group_size, sampling, seed)
        return asyncio.run(self._with_executor(coro))

    async def _with_executor(self, coro: Any) -> Any:
        # verifiers runs two asyncio.to_thread calls per rollout turn (parse_response_tokens,
        # state_to_output). A fresh loop's default executor starts its threads anew on every call
        # (Thread.start waits for the thread to run: ~0.6 ms each under load); a kept pool does not.
        asyncio.get_running_loop().set_default_executor(_KEPT_EXECUTOR)
        return await coro

    async def arun_groups(
        self,
        engine: InferenceEngine,
        split: Literal["train", "eval"],
        example_ids: list[int],
        group_size: int,
        sampling: SamplingParams,
        seed: int,
    ) -> list[list[Rollout]]:
        """``run_groups`` inside a running event loop; every group runs concurrently (``run_group`` each)."""
        aengine = AsyncEngine(engine)
        client = EngineClient(
            aengine,
            base=sampling,
            check_rerender=self.check_rerender,
            renderer=self._renderer,
            fixed_sampling=split == "train",
        )
        self._renderer = client.renderer  # reused by the next call: its prompt cache stays warm
        inputs = [(eid, [self._input(split, eid, k, seed) for k in range(group_size)]) for eid in example_ids]
        try:
            groups = list(await asyncio.gather(*(self._run_group(client, eid, inp) for eid, inp in inputs)))
        finally:  # also steps requests of cancelled rollouts (timeouts) to the end: the engine is left empty
            await aengine.aclose()
        if aengine.failure is not None:
            raise EngineFailure("the inference engine failed during verifiers rollouts") from aengine.failure
        refuse_sampling_overrides(self.name, client.refused_overrides, sampling)
        if client.input_errors:  # bad input, not a failed sample (verifiers recorded it as the rollout's error)
            raise ValueError(f"environment {self.name!r}: {client.input_errors[0]}") from client.input_errors[0]
        return groups

    def _input(self, split: str, example_id: int, sample_idx: int, seed: int) -> dict[str, Any]:
        # A shallow copy: verifiers' init_state deep-copies its input before anything mutates it
        # (a RolloutRow by copy_tree, when the row is a plain tree: checked once per cached row).
        cached = self._row(split, example_id)  # type: ignore[arg-type]
        row = RolloutRow(cached) if self._plain_rows[(split, example_id)] else dict(cached)
        row["example_id"] = example_id
        # Request seeds derive from (run seed, example, sample, turn): independent of batch composition.
        row[SEED_KEY] = sample_seed(seed, example_id, sample_idx)
        return row

    async def _run_group(self, client: EngineClient, example_id: int, inputs: list[dict]) -> list[Rollout]:
        try:
            # The environment's own sampling_args, as vf's generate() would pass them (run_group does
            # not read them itself); the client refuses distribution changes for training rollouts.
            sampling_args = copy.deepcopy(getattr(self.vf_env, "sampling_args", None) or {})
            run = self.vf_env.run_group(inputs, client, MODEL, sampling_args, state_columns=["trajectory", STATS_KEY])
            outputs = await asyncio.wait_for(run, self.group_timeout_s)  # past it: TimeoutError, the group fails
        # An exception escaping run_group comes from environment code (env_response, setup_state,
        # a group reward outside the guard); the run goes on with the group failed and counted.
        except Exception as e:  # noqa: BLE001
            logger.warning("verifiers run_group failed for example %d: %s: %s", example_id, type(e).__name__, e)
            for row in inputs:
                client.visions.pop(row.get(SEED_KEY), None)
            return failed_group(self.vf_env, client.renderer, example_id, inputs)
        rollouts = []
        for k, out in enumerate(outputs):
            rollouts.append(output_to_rollout(out, example_id, k, client.renderer))
            r = rollouts[-1]  # its images (vision-language models): those of its last turn
            r.vision = client.pop_vision(inputs[k].get(SEED_KEY), r.prompt_ids + r.completion_ids)
        return rollouts


class RolloutRow(dict):
    """A RolloutInput whose ``copy.deepcopy`` (verifiers' ``init_state`` makes one per rollout) is
    ``copy_tree``: a plain dict equal to ``deepcopy`` of the dict, in ~2 us instead of ~6.5 for a chat row
    here. Only for rows that ``is_plain_tree`` accepts (``_input`` checks each cached row once)."""

    def __deepcopy__(self, memo: dict) -> dict:
        return copy_tree(self)


_ATOMIC = frozenset({str, int, float, bool, type(None)})


def copy_tree(x: Any) -> Any:
    """``copy.deepcopy`` of a plain tree (``is_plain_tree``): new dicts and lists, atomic values shared
    (``deepcopy`` shares them too); anything else goes to ``copy.deepcopy``."""
    t = type(x)
    if t in _ATOMIC:
        return x
    if t is list:
        return [copy_tree(v) for v in x]
    if t is dict or t is RolloutRow:
        return {k: copy_tree(v) for k, v in x.items()}
    return copy.deepcopy(x)


def is_plain_tree(x: Any, seen: set[int] | None = None) -> bool:
    """True when ``x`` holds only atomic values, lists and dicts with atomic keys, and no list or dict
    twice (``deepcopy`` would keep such sharing, ``copy_tree`` does not)."""
    seen = set() if seen is None else seen
    t = type(x)
    if t in _ATOMIC:
        return True
    if t not in (list, dict) or id(x) in seen:
        return False
    seen.add(id(x))
    if t is list:
        return all(is_plain_tree(v, seen) for v in x)
    return all(type(k) in _ATOMIC and is_plain_tree(v, seen) for k, v in x.items())


class _KeptThreadPool(ThreadPoolExecutor):
    """The event loops' default executor, kept for the process: ``asyncio.run``'s shutdown of it is a no-op
    (its idle workers exit with the interpreter, as every ``ThreadPoolExecutor``'s do)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        return None


_KEPT_EXECUTOR = _KeptThreadPool(thread_name_prefix="ps-vf-to-thread")


def _new_executor_in_child() -> None:
    # A forked child has none of the parent's worker threads, but the pool would count them as idle.
    global _KEPT_EXECUTOR
    _KEPT_EXECUTOR = _KeptThreadPool(thread_name_prefix="ps-vf-to-thread")


os.register_at_fork(after_in_child=_new_executor_in_child)


def sample_seed(seed: int, example_id: int, sample_idx: int) -> int:
    """Base seed of one sample; its request at turn t is seeded ``turn_seed(sample_seed(...), t)``."""
    return (seed * 1_000_003 + example_id) * 1_009 + sample_idx
