"""Chat-template rendering, the multi-turn bridge and tool-call parsing, shared by both verifiers bridges.

No verifiers import: the classic bridge (vf_client.py, verifiers 0.3) and the v1 bridge (vf_v1.py,
verifiers 0.4) both build prompts with ``ChatRenderer`` (see vf_client.py's module doc for the
multi-turn bridge and why history is never re-rendered) and parse the engine's text with
``split_tool_calls``.
"""

from __future__ import annotations

import json
import re
from typing import Any

_MARK = "\x1fPS_BRIDGE_MARK\x1f"
"""Placeholder assistant content used to find where the template closes an assistant turn."""
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def turn_seed(base_seed: int, turn: int) -> int:
    """The request seed of turn ``turn`` of a sample whose base seed is ``base_seed``."""
    return (base_seed * 1_000_003 + turn) % (2**63)


def split_tool_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """Split Hermes/Qwen-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks out of ``text``.

    Returns (content without the parsed blocks, [(name, arguments as a JSON string)]). A block whose
    JSON does not parse or has no ``name`` stays in the content (the environment sees the raw text;
    no call is made).
    """
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name = obj["name"]
            args = obj.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            continue
        if not isinstance(name, str):
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append((name, args if isinstance(args, str) else json.dumps(args)))
    kept.append(text[pos:])
    return ("".join(kept).strip() if calls else text), calls


class ChatRenderer:
    """Chat-template rendering and the multi-turn bridge for one tokenizer (see module doc)."""

    def __init__(self, tokenizer: Any) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat_template; verifiers environments need one")
        self.tokenizer = tokenizer
        self._close_cache: dict[str, str] = {}
        self._ids_cache: dict[str, list[int]] = {}

    def render_text(self, messages: list[dict], tools: list[dict] | None, gen: bool, kwargs: dict) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=gen, tokenize=False, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        # The template's text already holds any BOS; add_special_tokens=False avoids a second one.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render_ids(self, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> list[int]:
        # The samples of a group share their first prompt: render + encode once (~0.6 ms each, measured).
        key = json.dumps([messages, tools, kwargs], sort_keys=True, default=str)
        ids = self._ids_cache.get(key)
        if ids is None:
            if len(self._ids_cache) >= 4096:
                self._ids_cache.clear()
            ids = self._ids_cache[key] = self.encode(self.render_text(messages, tools, True, kwargs))
        return list(ids)

    def assistant_close(self, kwargs: dict) -> str:
        """The text a template appends after an assistant message's content (Qwen: ``<|im_end|>\\n``)."""
        key = json.dumps(kwargs, sort_keys=True)
        if key not in self._close_cache:
            msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
            text = self.render_text(msgs, None, False, kwargs)
            idx = text.rfind(_MARK)
            if idx < 0:
                raise ValueError("the chat template drops assistant content; multi-turn bridging needs it rendered")
            self._close_cache[key] = text[idx + len(_MARK) :]
        return self._close_cache[key]

    def bridge_ids(
        self, completion_ids: list[int], tail: list[dict], tools: list[dict] | None, kwargs: dict
    ) -> list[int] | None:
        """Environment token ids between a sampled completion and the next generation prompt.

        = the part of the assistant close the engine did not sample (all of it when the completion
        did not end with the close's first token, e.g. truncated) + the ``tail`` messages rendered
        after an assistant turn + the generation prompt. None when the template renders the tail in
        a way that cannot be cut out (then the caller re-renders the whole prompt).
        """
        close = self.assistant_close(kwargs)
        last = self.tokenizer.decode(completion_ids[-1:], skip_special_tokens=False) if completion_ids else ""
        remainder = close[len(last) :] if last and close.startswith(last) else close
        dummy = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        text = self.render_text(dummy + tail, tools, True, kwargs)
        idx = text.find(_MARK)
        after = text[idx + len(_MARK) :] if idx >= 0 else ""
        if idx < 0 or not after.startswith(close):
            return None
        return self.encode(remainder + after[len(close) :])

    def stitch_ids(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        kwargs: dict,
        previous: list[dict],
        prompt_ids: list[int],
        completion_ids: list[int],
        check_rerender: bool,
    ) -> tuple[list[int], str | None]:
        """The next turn's prompt ids and the bridge counter to bump (None: stitched cleanly).

        ``previous`` are the last turn's prompt + reply messages, ``prompt_ids`` / ``completion_ids`` its
        token ids. When ``messages`` extend ``previous``, the ids are those + ``bridge_ids`` of the new
        tail (never re-rendered: see vf_client.py's module doc); else, or when ``bridge_ids`` is None,
        ``messages`` rendered afresh. Counters: ``prefix_breaks`` (no extension), ``bridge_failures``
        (no bridge), ``rerender_mismatches`` (with ``check_rerender``: stitched ids != a fresh render).
        """
        n = len(previous)
        if len(messages) > n and messages[:n] == previous:
            bridge = self.bridge_ids(completion_ids, messages[n:], tools, kwargs)
            if bridge is not None:
                ids = prompt_ids + completion_ids + bridge
                if check_rerender and ids != self.render_ids(messages, tools, kwargs):
                    return ids, "rerender_mismatches"
                return ids, None
            stat = "bridge_failures"
        else:
            stat = "prefix_breaks"
        return self.render_ids(messages, tools, kwargs), stat
