"""SFT datasets -> tokenized ``Sample``s (loss on completion tokens only).

Row formats of local JSONL / Parquet files:
- ``{"prompt": str, "completion": str}``: the prompt becomes one user message;
- ``{"prompt": [messages], "completion": str | [one assistant message]}``;
- ``{"messages": [..., {"role": "assistant", "content": str}]}``: the last message is the completion.
The prompt is rendered with the tokenizer's chat template (generation prompt added); the
completion is its text plus the eos token. Malformed rows are skipped and counted (the first few
logged) or, with ``--data.bad_rows=error``, stop the run with the row index. A file without a single
well-formed row stops the run before training (``ValueError`` naming the file, the count and the reasons).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from prime_spmd.config.sections import DataConfig
from prime_spmd.data import number_list, visual
from prime_spmd.data.reverse_text import example_rng, reverse_text_example
from prime_spmd.data.sample import Sample
from prime_spmd.log import logger
from prime_spmd.models.vision import ImageInputError, has_images, no_image_support

_SHOWN_BAD_ROWS = 3


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "the tokenizer has no chat_template, which SFT/RL prompts need; use a tokenizer with one "
            "(--model.tokenizer_path) or a model directory that ships it"
        )
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def _check_prompt_messages(msgs: list[dict], field: str) -> list[dict]:
    """The prompt messages, or ValueError: each needs a string role and content (or a list of content parts:
    text and images), and some text or an image."""
    for i, m in enumerate(msgs):
        content = m.get("content")
        ok = isinstance(content, str) or (isinstance(content, list) and all(isinstance(p, dict) for p in content))
        if not isinstance(m.get("role"), str) or not ok:
            got = {k: type(v).__name__ for k, v in m.items()}
            raise ValueError(f"'{field}' message {i} needs a string 'role' and 'content'; got {got}")
    if not any(m["content"].strip() if isinstance(m["content"], str) else m["content"] for m in msgs):
        raise ValueError("empty prompt")
    return msgs


def _row_to_chat(row: Any) -> tuple[list[dict], str]:
    """(prompt messages, completion text) of a row, or ValueError saying what is wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, expected an object")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or len(msgs) < 2 or not all(isinstance(m, dict) for m in msgs):
            raise ValueError("'messages' must be a list of at least 2 message objects")
        last = msgs[-1]
        if last.get("role") != "assistant" or not isinstance(last.get("content"), str):
            raise ValueError("the last message must be {'role': 'assistant', 'content': str}")
        return _check_prompt_messages(msgs[:-1], "messages"), last["content"]
    if "prompt" not in row or "completion" not in row:
        raise ValueError(f"missing field(s): need 'prompt' and 'completion' or 'messages'; got keys {sorted(row)}")
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("empty prompt")
        prompt = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        prompt = _check_prompt_messages(prompt, "prompt")
    else:
        raise ValueError(f"'prompt' must be a non-empty string or a list of messages, got {type(prompt).__name__}")
    if isinstance(completion, list) and len(completion) == 1 and isinstance(completion[0], dict):
        completion = completion[0].get("content")
    if not isinstance(completion, str):
        raise ValueError(f"'completion' must be a string, got {type(completion).__name__}")
    return prompt, completion


def read_rows(path: str, source: str) -> list[Any]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--data.path={path!r}: no such file")
    if source == "jsonl":
        rows = []
        for i, line in enumerate(p.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                rows.append(ValueError(f"line {i + 1} is not valid JSON: {e}"))
        return rows

    return pq.read_table(p).to_pylist()


def _check_some_row_is_good(path: str, rows: list[Any]) -> None:
    """Return at the first well-formed row; ValueError naming ``path`` when there is none (every step would
    train on nothing). Checks the row format only: tokenizing (and ``--trainer.seq_len``) happens per batch."""
    reasons = []
    for i, row in enumerate(rows):
        try:
            if isinstance(row, Exception):
                raise row
            _row_to_chat(row)
            return
        except ValueError as e:
            reasons.append(f"row {i}: {e}")
    shown = "; ".join(reasons[:_SHOWN_BAD_ROWS]) + ("; ..." if len(reasons) > _SHOWN_BAD_ROWS else "")
    raise ValueError(f"--data.path={path!r}: all {len(rows)} rows are bad, nothing to train on ({shown})")


class SFTDataset:
    """Deterministic, position-addressable SFT data: ``batch(step, batch_size)`` is a pure function
    of (seed, step), so resuming at a step needs no iterator state."""

    def __init__(self, cfg: DataConfig, tokenizer, seed: int, seq_len: int, processor=None) -> None:
        """``processor``: the model's ``VisionProcessor`` (prompts with image parts need one)."""
        self.cfg, self.tok, self.seed, self.seq_len = cfg, tokenizer, seed, seq_len
        self.processor = processor
        builtin = ("reverse_text", "number_list", "visual")
        self.rows = None if cfg.source in builtin else read_rows(cfg.path, cfg.source)
        if cfg.source == "number_list":
            self.number_list, rest = number_list.parse_task_args(cfg.args, "--data.args")
            if rest:
                raise ValueError(f"--data.args: unknown keys {sorted(rest)} for number_list")
        if cfg.source == "visual":
            self.visual, rest = visual.parse_task_args(cfg.args, "--data.args")
            if rest:
                raise ValueError(f"--data.args: unknown keys {sorted(rest)} for visual")
            if processor is None:
                raise ValueError(
                    "--data.source=visual needs a vision-language model (e.g. --model.init_tiny qwen3-vl-nano)"
                )
        if self.rows is not None and not self.rows:
            raise ValueError(f"--data.path={cfg.path!r} has no rows")
        if self.rows is not None:
            _check_some_row_is_good(cfg.path, self.rows)
        self.num_bad_rows = 0
        self.num_too_long = 0

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else 2**62

    def example(self, split: str, index: int) -> tuple[list[dict], str]:
        """(prompt messages, completion text) of row/example ``index``."""
        if self.cfg.source == "number_list":
            text, answer = number_list.number_list_example(
                number_list.example_rng(self.seed, split, index), self.number_list
            )
            return [{"role": "user", "content": text}], answer
        if self.cfg.source == "visual":
            return visual.visual_example(visual.example_rng(self.seed, split, index), self.visual)
        if self.rows is None:
            text, rev = reverse_text_example(
                example_rng(self.seed, split, index), self.cfg.min_chars, self.cfg.max_chars, self.cfg.alphabet
            )
            return [{"role": "user", "content": text}], rev
        row = self.rows[index]
        if isinstance(row, Exception):
            raise row
        return _row_to_chat(row)

    def tokenize(self, prompt: list[dict], completion: str) -> Sample:
        vision = None
        if self.processor is not None:
            prompt_ids, vision = self.processor.render(prompt)
        elif has_images(prompt):
            raise no_image_support("SFT prompt", getattr(self.tok, "name_or_path", "?"))
        else:
            prompt_ids = render_prompt(self.tok, prompt)
        completion_ids = list(self.tok.encode(completion, add_special_tokens=False)) + [self.tok.eos_token_id]
        ids = prompt_ids + completion_ids
        loss_mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
        return Sample(input_ids=ids, loss_mask=loss_mask, vision=None if vision is None else vision.without_images())

    def _bad(self, index: int, err: Exception) -> None:
        if self.cfg.bad_rows == "error":
            raise ValueError(f"{self.cfg.path}: row {index}: {err}") from err
        self.num_bad_rows += 1
        if self.num_bad_rows <= _SHOWN_BAD_ROWS:
            more = (
                " (further bad rows are only counted: metric bad_rows)" if self.num_bad_rows == _SHOWN_BAD_ROWS else ""
            )
            logger.warning(f"skipping bad row {index} of {self.cfg.path}: {err}{more}")

    def row_index(self, global_index: int) -> int:
        n = len(self)
        if self.rows is None:
            return global_index
        epoch, pos = divmod(global_index, n)
        perm = list(range(n))
        random.Random(f"sft/{self.seed}/{epoch}").shuffle(perm)
        return perm[pos]

    def batch(self, step: int, batch_size: int) -> list[Sample]:
        """The global batch of optimizer step ``step`` (skipped rows make it shorter, and are counted)."""
        out = []
        for g in range(step * batch_size, (step + 1) * batch_size):
            idx = self.row_index(g)
            try:
                prompt, completion = self.example("train", idx)
            except ValueError as e:
                self._bad(idx, e)
                continue
            try:
                sample = self.tokenize(prompt, completion)
            except ImageInputError as e:  # an unreadable image, or images for a text-only model: stop, naming the row
                raise ValueError(f"--data.path={self.cfg.path!r}: row {idx}: {e}") from e
            if len(sample.input_ids) > self.seq_len:
                self.num_too_long += 1
                n_prompt = sample.loss_mask.count(0)
                what = f"prompt alone has {n_prompt} tokens" if n_prompt >= self.seq_len else "prompt + completion"
                if sample.vision is not None:
                    what += f" ({sum(sample.vision.tokens_per_image())} of them image tokens)"
                err = f"{what} ({len(sample.input_ids)} tokens in all) > --trainer.seq_len={self.seq_len}"
                self._bad(idx, ValueError(err + "; raise --trainer.seq_len or shorten the row"))
                continue
            out.append(sample)
        return out
