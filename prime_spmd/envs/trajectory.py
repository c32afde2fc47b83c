"""Turns (the engine's prompt/completion ids of each model call) -> one token-exact ``Rollout``.

Shared by the classic verifiers bridge (verifiers_bridge.py) and the v1 bridge (vf_v1.py); no
verifiers import. The rule (docs/environments.md, "The token-exactness contract"): turn i+1's prompt
ids must start with turn i's prompt + completion ids; the ids between are environment tokens (mask 0,
logprob 0.0). A turn that does not extend the sequence (the environment rewrote its history) ends
the sample there, so no token the engine did not see in that context is trained.
"""

from __future__ import annotations

from dataclasses import dataclass

from prime_spmd.envs.rollout import Rollout

COUNTERS = (
    "reward_errors",
    "reward_timeouts",
    "env_errors",
    "env_timeouts",
    "overlong_prompts",
    "group_errors",
    "prefix_breaks",
    "bridge_failures",
    "rerender_mismatches",
)
"""Per-rollout counters always present in ``Rollout.metrics`` (0.0 when nothing happened)."""


@dataclass(slots=True)
class Stitched:
    """The sample built from a list of turns: ``used`` turns of them, the rest dropped after a break."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    logprobs: list[float]
    used: int


def stitch_turns(turns: list[dict]) -> Stitched:
    """Chain turns (dicts with ``prompt_ids``, ``completion_ids``, ``completion_mask``,
    ``completion_logprobs``; at least one) into one sample, stopping at the first turn whose prompt
    does not extend the sequence so far."""
    first = turns[0]
    prompt_ids = list(first["prompt_ids"])
    completion_ids = list(first["completion_ids"])
    mask = list(first["completion_mask"])
    logprobs = [float(x) for x in first["completion_logprobs"]]
    used = 1
    for tok in turns[1:]:
        seen = len(prompt_ids) + len(completion_ids)
        step_prompt = list(tok["prompt_ids"])
        if step_prompt[: len(prompt_ids)] != prompt_ids or step_prompt[len(prompt_ids) : seen] != completion_ids:
            break
        used += 1
        env_ids = step_prompt[seen:]
        completion_ids += env_ids + list(tok["completion_ids"])
        mask += [0] * len(env_ids) + list(tok["completion_mask"])
        logprobs += [0.0] * len(env_ids) + [float(x) for x in tok["completion_logprobs"]]
    return Stitched(prompt_ids, completion_ids, mask, logprobs, used)


def failed_rollout(example_id: int, sample_idx: int, prompt_ids: list[int], counter: str) -> Rollout:
    """A sample with no completion, reward 0, ``metrics["failed"] = 1`` and ``counter`` set."""
    metrics = {c: 0.0 for c in COUNTERS}
    metrics[counter] = 1.0
    metrics["failed"] = 1.0
    return Rollout(
        example_id=example_id,
        sample_idx=sample_idx,
        prompt_ids=prompt_ids,
        completion_ids=[],
        completion_mask=[],
        inference_logprobs=[],
        reward=0.0,
        metrics=metrics,
        info={"failed": counter},
    )
