"""What one engine generates for batch b: its share of each environment's prompts in the batch's plan,
seeded by (run seed, batch); and its share of an evaluation.

Used by the inference loop (disjoint mode) and by the trainer loop in colocated mode.
"""

from __future__ import annotations

import hashlib
import time

from prime_spmd.config import RLJobConfig
from prime_spmd.config.sections import env_label
from prime_spmd.envs.base import Environment
from prime_spmd.inference.engine import InferenceEngine, SamplingParams
from prime_spmd.rl.isolation import run_isolated
from prime_spmd.rl.mixture import EnvSlot, Plan
from prime_spmd.rl.samples import is_failed
from prime_spmd.rl.schedule import version_of_batch
from prime_spmd.rl.types import Batch, EvalShare


def sampling_params(cfg: RLJobConfig, max_tokens: int = 0) -> SamplingParams:
    """The rollouts' sampling (--sampling.*), with an environment's own ``max_tokens`` when it sets one."""
    s = cfg.sampling
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, max_tokens=max_tokens or s.max_tokens
    )


def share(ids: list[int], engine_index: int, num_engines: int) -> list[int]:
    """One engine's contiguous share of ``ids``."""
    p = len(ids)
    return ids[engine_index * p // num_engines : (engine_index + 1) * p // num_engines]


def batch_example_ids(cfg: RLJobConfig, env: Environment, b: int, engine_index: int, num_engines: int) -> list[int]:
    """Without a plan (one environment, tests): prompts (b * p + i) mod n of batch b, this engine's share."""
    p = cfg.rollout.prompts_per_step
    n = env.num_examples("train")
    return share([(b * p + i) % n for i in range(p)], engine_index, num_engines)


def batch_seed(seed: int, b: int, label: str = "") -> int:
    """The seed batch b's requests derive from: (run seed, batch), so a prompt revisited in a later batch
    (the dataset wrapped around) gets new sampling noise, and a resumed run regenerates batch b exactly.
    In a mixture the environment's label joins in, so two environments' example i get different noise."""
    tag = f"rl/{seed}/batch/{b}" + (f"/{label}" if label else "")
    digest = hashlib.blake2b(tag.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _slots(cfg: RLJobConfig, envs: list[EnvSlot] | Environment) -> list[EnvSlot]:
    if isinstance(envs, list):
        return envs
    return [EnvSlot(label=env_label(cfg.env), cfg=cfg.env, env=envs)]


def generate_share(
    cfg: RLJobConfig,
    envs: list[EnvSlot] | Environment,
    engine: InferenceEngine,
    b: int,
    version: int,
    engine_index: int,
    num_engines: int,
    plan: Plan | None = None,
) -> Batch:
    """Generate and score this engine's share of batch b with weights version ``version`` (the schedule's).

    ``plan`` (the controller's, rl/mixture.py): each environment's prompts of the batch; None: one
    environment, prompts ``batch_example_ids``. Each environment runs isolated (rl/isolation.py): its
    failures become ``Batch.failures``. Raises ``RuntimeError`` when the engine holds another version (a
    weight update that did not arrive, or arrived twice); every rollout carries the version the engine reported.
    """
    assert version == version_of_batch(b, cfg.rollout.max_async), (b, version)
    if engine.weights_version != version:
        raise RuntimeError(
            f"batch {b}: the engine holds weights version {engine.weights_version}, but the schedule generates "
            f"it with version {version} (max_async {cfg.rollout.max_async})"
        )
    t0 = time.perf_counter()
    slots = _slots(cfg, envs)
    batch = Batch(index=b, groups=[])
    for slot in slots:
        if plan is None:
            ids = batch_example_ids(cfg, slot.env, b, engine_index, num_engines)
        else:
            ids = share(plan.get(slot.label, []), engine_index, num_engines)
        if not ids:
            continue
        seed = batch_seed(cfg.trainer.seed, b, slot.label if len(slots) > 1 else "")
        sampling = sampling_params(cfg, slot.cfg.max_tokens)
        groups, failures = run_isolated(
            slot.label, slot.env, engine, "train", ids, cfg.rollout.group_size, sampling, seed
        )
        batch.groups += groups
        batch.group_envs += [slot.label] * len(groups)
        batch.failures += failures
    assert engine.weights_version == version, "weights changed during generation"
    for g in batch.groups:
        for r in g:
            r.policy_version = engine.weights_version
    batch.gen_time_s = time.perf_counter() - t0
    return batch


def merge(parts: list[Batch]) -> Batch:
    """One batch from the shares of every engine (all of the same batch index)."""
    assert len({p.index for p in parts}) == 1, [p.index for p in parts]
    return Batch(
        index=parts[0].index,
        groups=[g for p in parts for g in p.groups],
        gen_time_s=max(p.gen_time_s for p in parts),
        group_envs=[e for p in parts for e in p.group_envs],
        failures=[f for p in parts for f in p.failures],
    )


def eval_share(
    cfg: RLJobConfig, envs: list[EnvSlot], engine: InferenceEngine, version: int, engine_index: int, num_engines: int
) -> EvalShare:
    """This engine's share of every environment's eval split (``--eval.samples_per_example`` samples each)
    with the weights the engine holds (``version``). Seeded the same at every eval, so evals differ by the
    weights only. Failures are isolated and counted, as in training; a failed rollout scores its reward (0),
    as in the ``eval`` job."""
    assert engine.weights_version == version, (engine.weights_version, version)
    t0 = time.perf_counter()
    n = cfg.eval.samples_per_example
    out = EvalShare(version=version, rewards={}, completion_lens={}, truncated={}, failed_groups={})
    for slot in envs:
        ids = share(list(range(slot.env.num_examples("eval"))), engine_index, num_engines)
        seed = batch_seed(cfg.trainer.seed, -1, f"eval/{slot.label}")
        groups, failures = (
            run_isolated(slot.label, slot.env, engine, "eval", ids, n, sampling_params(cfg, slot.cfg.max_tokens), seed)
            if ids
            else ([], [])
        )
        out.rewards[slot.label] = [[r.reward for r in g] for g in groups]
        out.completion_lens[slot.label] = [sum(r.completion_mask) for g in groups for r in g]
        out.truncated[slot.label] = sum(r.info.get("finish_reason") == "length" for g in groups for r in g)
        out.failed_groups[slot.label] = len(failures) + sum(all(is_failed(r) for r in g) for g in groups)
    out.gen_time_s = time.perf_counter() - t0
    return out


def merge_evals(parts: list[EvalShare]) -> EvalShare:
    """One eval result from every engine's share (all of the same version)."""
    assert len({p.version for p in parts}) == 1, [p.version for p in parts]
    labels = list(parts[0].rewards)
    return EvalShare(
        version=parts[0].version,
        rewards={lb: [g for p in parts for g in p.rewards[lb]] for lb in labels},
        completion_lens={lb: [x for p in parts for x in p.completion_lens[lb]] for lb in labels},
        truncated={lb: sum(p.truncated[lb] for p in parts) for lb in labels},
        failed_groups={lb: sum(p.failed_groups[lb] for p in parts) for lb in labels},
        gen_time_s=max(p.gen_time_s for p in parts),
    )
