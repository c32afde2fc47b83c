"""Classic verifiers rollout results -> token-exact ``Rollout`` s (both paths of verifiers_bridge.py).

The counters, the failure rules and the stitching rule are in verifiers_bridge.py's and
trajectory.py's module docs.
"""

from __future__ import annotations

import math
from typing import Any

from verifiers.utils.message_utils import normalize_messages

from prime_spmd.envs.rollout import Rollout
from prime_spmd.envs.trajectory import COUNTERS, failed_rollout, stitch_turns
from prime_spmd.envs.vf_client import STATS_KEY, ChatRenderer, to_template_message


def failed_group(vf_env: Any, renderer: ChatRenderer, example_id: int, inputs: list[dict]) -> list[Rollout]:
    """The rollouts of a group whose environment code raised: no completion, ``group_errors``."""
    prompt = [to_template_message(m) for m in vf_messages(inputs[0]["prompt"])]
    prompt_ids = renderer.render_ids(prompt, tools_of(vf_env), {})
    return [failed_rollout(example_id, k, prompt_ids, "group_errors") for k in range(len(inputs))]


def vf_messages(prompt: Any) -> list[Any]:
    """A RolloutInput prompt (string or messages) as verifiers messages."""
    return list(normalize_messages(prompt, field_name="prompt"))


def tools_of(vf_env: Any) -> list[dict] | None:
    """The environment's tool definitions in the chat-template format (None without tools)."""
    defs = getattr(vf_env, "tool_defs", None) or []
    return [{"type": "function", "function": t.model_dump(exclude_none=True)} for t in defs] or None


def output_to_rollout(out: dict[str, Any], example_id: int, sample_idx: int, renderer: ChatRenderer) -> Rollout:
    """One verifiers ``RolloutOutput`` (with the ``trajectory`` state column), or the final ``State`` itself
    (the single-turn fast path; it has the same keys), as a token-exact ``Rollout``.

    Turn i+1's prompt ids must start with turn i's prompt + completion ids (the client builds them
    so); the ids between are environment tokens (mask 0). A turn that does not extend the sequence
    (the environment rewrote its history) ends the sample there: later turns are dropped and
    counted in ``turns_dropped``, so no token the engine did not see in that context is trained.
    """
    # ``dict.get``: verifiers' ``State.get`` forwards only its input fields (prompt, answer, info,
    # example_id) to ``state["input"]``; for every other key it is the dict's own, without two Python calls.
    get = dict.get
    stats = dict(get(out, STATS_KEY) or {})
    steps = [s for s in (get(out, "trajectory") or []) if s.get("tokens") is not None]
    if not steps:
        prompt_ids = renderer.render_ids([to_template_message(m) for m in vf_messages(out["prompt"])], None, {})
        counter = {"timeout_reached": "env_timeouts", "prompt_too_long": "overlong_prompts"}.get(
            get(out, "stop_condition") or "", "env_errors"
        )
        return failed_rollout(example_id, sample_idx, prompt_ids, counter)
    st = stitch_turns([s["tokens"] for s in steps])
    prompt_ids, completion_ids, mask, logprobs, used = (
        st.prompt_ids,
        st.completion_ids,
        st.completion_mask,
        st.logprobs,
        st.used,
    )
    metrics = {c: float(stats.get(c, 0)) for c in COUNTERS}
    if get(out, "error") is not None:
        metrics["env_errors"] += 1.0
    if get(out, "stop_condition") == "timeout_reached":
        metrics["env_timeouts"] += 1.0
    reward = get(out, "reward")
    if reward is None or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        metrics["reward_errors"] += 1.0
        reward = 0.0
    if get(out, "stop_condition") == "prompt_too_long":
        metrics["overlong_prompts"] += 1.0
    failed = any(metrics[c] > 0 for c in ("reward_errors", "reward_timeouts", "env_errors", "env_timeouts"))
    for key, value in (get(out, "metrics") or {}).items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            metrics[f"env/{key}"] = float(value)
    metrics["num_turns"] = float(len(steps))
    metrics["turns_dropped"] = float(len(steps) - used)
    metrics["failed"] = float(failed)
    return Rollout(
        example_id=example_id,
        sample_idx=sample_idx,
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        completion_mask=mask,
        inference_logprobs=logprobs,
        reward=0.0 if failed else float(reward),
        metrics=metrics,
        info={
            "answer": out.get("answer", ""),
            "finish_reason": "length" if steps[-1].get("is_truncated") else "stop",
            "stop_condition": get(out, "stop_condition"),
        },
    )
