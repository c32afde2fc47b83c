"""What one engine generates for batch b: its share of the batch's prompts, seeded by (run seed, batch).

Used by the inference loop (disjoint mode) and by the trainer loop in colocated mode.
"""

from __future__ import annotations

import hashlib
import time

from prime_spmd.config import RLJobConfig
from prime_spmd.envs.base import Environment
from prime_spmd.inference.engine import InferenceEngine, SamplingParams
from prime_spmd.rl.schedule import version_of_batch
from prime_spmd.rl.types import Batch


def sampling_params(cfg: RLJobConfig) -> SamplingParams:
    s = cfg.sampling
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, max_tokens=s.max_tokens
    )


def batch_example_ids(cfg: RLJobConfig, env: Environment, b: int, engine_index: int, num_engines: int) -> list[int]:
    """Prompts of batch b served by one engine: a contiguous share of the batch's prompt ids."""
    p = cfg.rollout.prompts_per_step
    n = env.num_examples("train")
    ids = [(b * p + i) % n for i in range(p)]
    return ids[engine_index * p // num_engines : (engine_index + 1) * p // num_engines]


def batch_seed(seed: int, b: int) -> int:
    """The seed batch b's requests derive from: (run seed, batch), so a prompt revisited in a later batch
    (the dataset wrapped around) gets new sampling noise, and a resumed run regenerates batch b exactly."""
    digest = hashlib.blake2b(f"rl/{seed}/batch/{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generate_share(
    cfg: RLJobConfig,
    env: Environment,
    engine: InferenceEngine,
    b: int,
    version: int,
    engine_index: int,
    num_engines: int,
) -> Batch:
    """Generate and score this engine's share of batch b with weights version ``version`` (the schedule's).

    Raises ``RuntimeError`` when the engine holds another version (a weight update that did not arrive,
    or arrived twice); every rollout carries the version the engine reported.
    """
    assert version == version_of_batch(b, cfg.rollout.max_async), (b, version)
    if engine.weights_version != version:
        raise RuntimeError(
            f"batch {b}: the engine holds weights version {engine.weights_version}, but the schedule generates "
            f"it with version {version} (max_async {cfg.rollout.max_async})"
        )
    t0 = time.perf_counter()
    ids = batch_example_ids(cfg, env, b, engine_index, num_engines)
    seed = batch_seed(cfg.trainer.seed, b)
    groups = env.run_groups(engine, "train", ids, cfg.rollout.group_size, sampling_params(cfg), seed)
    assert engine.weights_version == version, "weights changed during generation"
    for g in groups:
        for r in g:
            r.policy_version = engine.weights_version
    return Batch(index=b, groups=groups, gen_time_s=time.perf_counter() - t0)


def merge(parts: list[Batch]) -> Batch:
    """One batch from the shares of every engine (all of the same batch index)."""
    assert len({p.index for p in parts}) == 1, [p.index for p in parts]
    return Batch(
        index=parts[0].index,
        groups=[g for p in parts for g in p.groups],
        gen_time_s=max(p.gen_time_s for p in parts),
    )
