"""An in-process chat harness for verifiers v1 test tasksets (not ours: written as a v1 package would be).

verifiers 0.4's built-in ``null`` harness runs its chat loop as a ``uv run`` script in the runtime;
the ``Harness.launch`` contract also allows the loop to run in-process as long as every model call
goes through the interception endpoint, which is what this harness does (httpx to the loopback
``{endpoint}/chat/completions`` with the rollout's bearer secret). ``feedback`` decides whether the
harness answers the model and asks again (multi-turn) or stops.

Top-level module (no package): verifiers 0.4 resolves taskset and harness ids by importing them as
top-level names, so the tests put this folder on ``sys.path`` (``--env.name tests/envs_v1/<file>.py``
does that).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

CALLS: list[dict] = []
"""Every chat request body this harness sent (tests compare them with the engine's prompts)."""


class ChatHarnessConfig(vf.HarnessConfig):
    max_turns: int | None = None
    """Model calls per rollout at most (None: the harness class's ``MAX_TURNS``)."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    MAX_TURNS = 1
    TOOLS: tuple[Callable[..., Any], ...] = ()
    """Python functions offered to the model as OpenAI function tools; the harness runs the calls itself."""
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    def feedback(self, data: vf.TaskData, reply: str, turn: int) -> str | None:
        """The user's answer to the model's ``reply`` at ``turn`` (0-based), or None to stop."""
        return None

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system_prompt, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(exclude_none=True) for m in prompt or []]
        headers = {"Authorization": f"Bearer {secret}"}
        async with httpx.AsyncClient(timeout=120) as client:
            for turn in range(self.config.max_turns or self.MAX_TURNS):
                body = {"model": ctx.model, "messages": messages}
                if self.TOOLS:
                    body["tools"] = [tool_schema(f) for f in self.TOOLS]
                CALLS.append(body)
                r = await client.post(f"{endpoint}/chat/completions", json=body, headers=headers)
                if r.status_code != 200:
                    return ProgramResult(exit_code=1, stdout="", stderr=f"HTTP {r.status_code}: {r.text}")
                reply = r.json()["choices"][0]["message"]
                if reply.get("tool_calls"):
                    messages.append(
                        {"role": "assistant", "content": reply.get("content"), "tool_calls": reply["tool_calls"]}
                    )
                    messages += [self.run_tool(call) for call in reply["tool_calls"]]
                    continue
                messages.append({"role": "assistant", "content": reply.get("content") or ""})
                answer = self.feedback(data, reply.get("content") or "", turn)
                if answer is None:
                    break
                messages.append({"role": "user", "content": answer})
        return ProgramResult(exit_code=0, stdout="", stderr="")

    def run_tool(self, call: dict) -> dict:
        fn = {f.__name__: f for f in self.TOOLS}[call["function"]["name"]]
        result = fn(**json.loads(call["function"]["arguments"] or "{}"))
        return {"role": "tool", "tool_call_id": call["id"], "content": str(result)}


def tool_schema(fn: Callable[..., Any]) -> dict:
    """An OpenAI function-tool schema for ``fn`` (integer parameters only: enough for these tests)."""
    params = list(inspect.signature(fn).parameters)
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": (fn.__doc__ or "").strip().splitlines()[0],
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "integer"} for p in params},
                "required": params,
            },
        },
    }
