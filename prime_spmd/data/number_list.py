"""The number-list task: a seeded list of random integers (or words) and its reversal (or sorted copy). Nothing
is downloaded.

The prompt is ``"<transform>: 12 5 731 8"``; the answer is the transformed list written the same way. The
answer's length follows the prompt's (``min_items`` to ``max_items`` items), so generations vary in length
with the prompt, as in reasoning RL. With the Qwen3 tokenizer, which writes each digit as one token, an item
of d digits and its separator cost d + 1 tokens: 20-200 items of 1-3 digits give ~60-600 answer tokens
(``sep=", "`` adds one more token an item: ~80-800).

``items="words"``: distinct words drawn from ``WORDS`` (512 lowercase words that the Qwen3 tokenizer writes as
one token, with or without a leading space) instead of integers: ``"reverse: this, model, open"``. An item is
one token, so reversing is a content lookup (find the word just written in the prompt, write the one before it)
rather than matching multi-token items among repeated digits: a 0.6B model from scratch plateaued at the digits'
entropy on integer lists within the one-call SFT budget (docs/benchmarks.md, "Learning benchmark"). With
``sep=", "`` a word costs 2 tokens: 128-480 words give ~256-960 answer tokens.

``transform="count"``: the prompt names two integers, ``"count: 317 to 519"``, and the answer counts from one to the
other (min_items to max_items items, all with the start's number of digits). Each item follows from the one before
it at a fixed offset, with no lookup into the prompt but its two ends: a 0.6B model from scratch learns it within
~65 SFT steps on an H100 where both reversals stayed at the items' entropy. With 3-digit items and ``sep=", "`` an
item costs 5 tokens: 50-200 items give ~250-1000 answer tokens. An answer that stops early, runs past the end or
skips a number keeps partial credit for every number in order.

Reward: the LCS ratio over the item sequences, ``2 * LCS(answer items, output items) / (len(answer) +
len(output))``: 1.0 for the exact list, partial credit for every answer item written in the right relative
order, and a penalty for missing and extra items alike. Chosen over "fraction of positions right", which gives
~0 to an answer that drops or repeats one early item (every later position shifts), so a model that is nearly
right would see almost no signal. Parsing is forgiving: items are the maximal runs of digits (a leading ``-``
kept; words: of ASCII letters, lowercased) in the output; text that holds no item scores 0.0. Scoring never raises.

What guessing scores (the reward's floor; tests/unit/test_number_list.py checks these): random integers of the
answer's length score 0.44 / 0.16 / 0.05 for 1 / 2 / 3-digit items (alphabets of 10, 90, 900 values share long
subsequences by chance); for words, the prompt's own words in a random order (the best guess without reversing)
score 2 E[LIS of a random permutation] / 2n: 0.34 at 20 words, 0.15 at 128, 0.08 at 480; words drawn at random
from ``WORDS`` score 0.04-0.08.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

TRANSFORMS = ("reverse", "sort")
_INT = re.compile(r"-?\d+")
_WORD = re.compile(r"[A-Za-z]+")
WORDS = tuple(
    """
this that with return from class public have self cont will your const void else more they data name true null
their time which false value about string over type inter part work when other been were file would year some
there said comm like also than static just result them into what list case first import char only print back
need start user under then people should test make after right long array read form trans want comp number size
where while spec look could know hand most break every point error text show find used play help these pass down
even item last event again high line does before dist state cons here final very model call well object years
java view pres many being good using stud child param echo person style method expect prot found post such think
much http count inst gener check open next follow href bool game path each sign those system best same create
made mark group world main color report take free action index real build input table head must order contin
double place oper week prop struct code still assert field cour team second going range fact home left direct
allow page around rece really image target both level config local quest float poss fore great month super title
life incre catch change book three base conf during power width label date match node care effect since full
turn body produ stand block keep throw things come custom source await prov mill chang output email disc might
never hard intern called height small access uint little port status appe update link given better feel always
parent less valid sure prom search orig invest says temp rest mult site values video cert prof cell player cost
total stat load clear techn short done belie health args days online javax organ reason within design cent
school func init stop later client love json able give copy appro either lead family option exist offer water
step times four room once talk grow mass mean until market area length kind light side camp miss based plan away
button render near author along begin thing doesn single anal rights women season dest didn sent recent money
auto query window least expl column record making close past write move city tell select font course late amount
async hold para price today polit attack means story meet sort task review switch above word cover having employ
large host role deal press though points ever ident conc server files often info space store format prob face
save items social major food comb send params diff makes global except news device below media fail black added
came delete card https root handle comput claim enter night doing pick watch human girl strong house track pack
wait throws terms apply others fund users future mode took games needs known exec seen border live hope young
study limit sizeof went fire visit token months anim learn decl mind quick admin series bill frame draw comes
elect filter larg remove front util associ printf
""".split()
)


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
    transform: Literal["reverse", "sort", "mixed", "count"] = "reverse"
    """reverse the list, sort it ascending, or one of the two per example (seeded; named in the prompt); count: the
    prompt names two integers of min_digits to max_digits digits, ``"count: 347 to 512"``, min_items to max_items
    apart, and the answer counts from the first to the second (items=numbers only)."""
    sep: str = " "
    """Separator between items, in the prompt and the answer."""
    items: Literal["numbers", "words"] = "numbers"
    """numbers: integers of min_digits to max_digits digits; words: distinct words of ``WORDS`` (one token each
    in the Qwen3 tokenizer; the digit fields are ignored; max_items <= 512)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_items <= self.max_items:
            raise ValueError(
                f"number_list args: need 1 <= min_items <= max_items, got {self.min_items}, {self.max_items}"
            )
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(
                f"number_list args: need 1 <= min_digits <= max_digits <= 9, got {self.min_digits}, {self.max_digits}"
            )
        if self.transform not in (*TRANSFORMS, "mixed", "count"):
            raise ValueError(f"number_list args: transform {self.transform!r}: choose reverse, sort, mixed or count")
        if self.transform == "count" and self.items != "numbers":
            raise ValueError(f"number_list args: transform count counts integers: items {self.items!r} needs numbers")
        if self.transform == "count" and self.max_items > _count_capacity(self.max_digits):
            raise ValueError(
                f"number_list args: transform count: {self.max_items} items do not fit between two "
                f"{self.max_digits}-digit integers (raise max_digits or lower max_items)"
            )
        if not self.sep or any(c.isdigit() or c.isalpha() or c == "-" for c in self.sep):
            raise ValueError(f"number_list args: sep {self.sep!r} must be non-empty, without digits, letters or '-'")
        if self.items not in ("numbers", "words"):
            raise ValueError(f"number_list args: items {self.items!r}: choose numbers or words")
        if self.items == "words" and self.max_items > len(WORDS):
            raise ValueError(f"number_list args: items=words draws distinct words: max_items <= {len(WORDS)}")


def _count_capacity(digits: int) -> int:
    """How many integers have ``digits`` digits (0-9 for one digit)."""
    return 10 if digits == 1 else 9 * 10 ** (digits - 1)


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
    for key in ("transform", "sep", "items"):
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
    if task.transform == "count":  # every item of the answer stays within the start's number of digits
        lo_d = max(task.min_digits, min(d for d in range(1, 10) if _count_capacity(d) >= n))
        d = rng.randint(lo_d, task.max_digits)  # lo_d <= max_digits: __post_init__ checks max_items fits
        lo = 0 if d == 1 else 10 ** (d - 1)
        start = rng.randint(lo, 10**d - n)
        return f"count: {start} to {start + n - 1}", task.sep.join(map(str, range(start, start + n)))
    items: list = []
    if task.items == "words":
        items = rng.sample(WORDS, n)
    for _ in range(n if task.items == "numbers" else 0):
        d = rng.randint(task.min_digits, task.max_digits)
        items.append(rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1))
    transform = rng.choice(TRANSFORMS) if task.transform == "mixed" else task.transform
    out = items[::-1] if transform == "reverse" else sorted(items)
    return f"{transform}: {task.sep.join(map(str, items))}", task.sep.join(map(str, out))


def parse_items(text: str, items: str = "numbers") -> list[str]:
    """The integers written in ``text``, in order, as canonical strings (maximal digit runs, a leading '-'
    kept, leading zeros dropped); [] when none. Strings, not ints: ``int()`` of a run of over 4300 digits
    raises, and a sampled completion may hold one. ``items="words"``: the maximal runs of ASCII letters,
    lowercased."""
    if items == "words":
        return [w.lower() for w in _WORD.findall(text)]
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


def item_lcs_ratio(answer: str, completion: str, items: str = "numbers") -> float:
    """The reward: ``2 * LCS / (len(answer items) + len(completion items))`` over parsed items (``items``: numbers
    or words, as the task's field), in [0, 1]. A completion with no item in it scores 0.0."""
    want, got = parse_items(answer, items), parse_items(completion, items)
    if not got or not want:
        return 0.0
    return 2.0 * lcs_length(want, got) / (len(want) + len(got))
