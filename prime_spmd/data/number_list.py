"""The number-list task: a seeded list of random integers and its reversal (or sorted copy). Nothing is downloaded.

The prompt is ``"<transform>: 12 5 731 8"``; the answer is the transformed list written the same way. The
answer's length follows the prompt's (``min_items`` to ``max_items`` items), so generations vary in length
with the prompt, as in reasoning RL. With the Qwen3 tokenizer, which writes each digit as one token, an item
of d digits and its separator cost d + 1 tokens: 20-200 items of 1-3 digits give ~60-600 answer tokens
(``sep=", "`` adds one more token an item: ~80-800).

Reward: the LCS ratio over the item sequences, ``2 * LCS(answer items, output items) / (len(answer) +
len(output))``: 1.0 for the exact list, partial credit for every answer item written in the right relative
order, and a penalty for missing and extra items alike. Chosen over "fraction of positions right", which gives
~0 to an answer that drops or repeats one early item (every later position shifts), so a model that is nearly
right would see almost no signal. Parsing is forgiving: items are the maximal runs of digits (a leading ``-``
kept) in the output; text that holds no integer scores 0.0. Scoring never raises.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

TRANSFORMS = ("reverse", "sort")
_INT = re.compile(r"-?\d+")


@dataclass(frozen=True, slots=True)
class NumberListTask:
    """The task's knobs; ``--env.args`` / ``--data.args`` keys of the same names (strings on the CLI)."""

    min_items: int = 5
    """Shortest list."""
    max_items: int = 20
    """Longest list (inclusive)."""
    min_digits: int = 1
    """Fewest digits an item has (no leading zeros: a d-digit item lies in [10^(d-1), 10^d), 1 digit: [0, 9])."""
    max_digits: int = 2
    """Most digits an item has."""
    transform: Literal["reverse", "sort", "mixed"] = "reverse"
    """reverse the list, sort it ascending, or one of the two per example (seeded; named in the prompt)."""
    sep: str = " "
    """Separator between items, in the prompt and the answer."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_items <= self.max_items:
            raise ValueError(
                f"number_list args: need 1 <= min_items <= max_items, got {self.min_items}, {self.max_items}"
            )
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(
                f"number_list args: need 1 <= min_digits <= max_digits <= 9, got {self.min_digits}, {self.max_digits}"
            )
        if self.transform not in (*TRANSFORMS, "mixed"):
            raise ValueError(f"number_list args: transform {self.transform!r}: choose reverse, sort or mixed")
        if not self.sep or any(c.isdigit() or c == "-" for c in self.sep):
            raise ValueError(f"number_list args: sep {self.sep!r} must be non-empty, without digits or '-'")


def parse_task_args(args: dict[str, str] | None, flag: str) -> tuple[NumberListTask, dict[str, str]]:
    """(the task of the known keys of ``args``, the other keys). ``flag`` names the CLI flag in errors."""
    args = dict(args or {})
    ints = ("min_items", "max_items", "min_digits", "max_digits")
    kw: dict = {}
    for key in ints:
        if key in args:
            value = args.pop(key)
            try:
                kw[key] = int(value)
            except ValueError:
                raise ValueError(f"{flag}: {key} must be an integer, got {value!r}") from None
    for key in ("transform", "sep"):
        if key in args:
            kw[key] = args.pop(key)
    try:
        return NumberListTask(**kw), args
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def example_rng(seed: int, split: str, index: int) -> random.Random:
    """The RNG of example ``index`` of ``split``: examples are independent of iteration order."""
    return random.Random(f"number_list/{split}/{seed}/{index}")


def number_list_example(rng: random.Random, task: NumberListTask) -> tuple[str, str]:
    """(prompt text, answer text) of one example drawn from ``rng``."""
    n = rng.randint(task.min_items, task.max_items)
    items = []
    for _ in range(n):
        d = rng.randint(task.min_digits, task.max_digits)
        items.append(rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1))
    transform = rng.choice(TRANSFORMS) if task.transform == "mixed" else task.transform
    out = items[::-1] if transform == "reverse" else sorted(items)
    return f"{transform}: {task.sep.join(map(str, items))}", task.sep.join(map(str, out))


def parse_items(text: str) -> list[str]:
    """The integers written in ``text``, in order, as canonical strings (maximal digit runs, a leading '-'
    kept, leading zeros dropped); [] when none. Strings, not ints: ``int()`` of a run of over 4300 digits
    raises, and a sampled completion may hold one."""
    out = []
    for m in _INT.findall(text):
        sign, digits = ("-", m[1:]) if m[0] == "-" else ("", m)
        digits = digits.lstrip("0") or "0"
        out.append("0" if digits == "0" else sign + digits)
    return out


def lcs_length(a: list, b: list) -> int:
    """Length of the longest common subsequence of two item sequences.

    Bit-parallel (Hyyrö 2004, with Python ints as bit vectors): O(len(b)) big-int operations on len(a)-bit
    words. A 200 x 190 pair takes ~0.05 ms against ~5 ms for the O(n m) table in pure Python (2-core CPU),
    which at 128 samples of 200 items would add ~0.7 s of scoring to every step.
    """
    if not a or not b:
        return 0
    match: dict = {}
    for i, x in enumerate(a):
        match[x] = match.get(x, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for y in b:
        u = v & match.get(y, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - v.bit_count()


def item_lcs_ratio(answer: str, completion: str) -> float:
    """The reward: ``2 * LCS / (len(answer items) + len(completion items))`` over parsed items, in [0, 1].
    A completion with no integer in it scores 0.0."""
    want, got = parse_items(answer), parse_items(completion)
    if not got or not want:
        return 0.0
    return 2.0 * lcs_length(want, got) / (len(want) + len(got))
