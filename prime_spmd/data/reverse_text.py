"""The reverse-text task: seeded random strings and their reversal. Nothing is downloaded."""

from __future__ import annotations

import random


def reverse_text_example(rng: random.Random, min_chars: int, max_chars: int, alphabet: str) -> tuple[str, str]:
    """(text, reversed text) with a length uniform in [min_chars, max_chars]."""
    n = rng.randint(min_chars, max_chars)
    text = "".join(rng.choice(alphabet) for _ in range(n))
    return text, text[::-1]


def example_rng(seed: int, split: str, index: int) -> random.Random:
    """The RNG of example ``index`` of ``split``: examples are independent of iteration order."""
    return random.Random(f"reverse_text/{split}/{seed}/{index}")


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (O(len(a) * len(b)))."""
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_ratio(answer: str, completion: str) -> float:
    """2 * LCS / (len(answer) + len(completion)): 1.0 for an exact match, 0.0 for nothing in common."""
    total = len(answer) + len(completion)
    return 2.0 * lcs_length(answer, completion) / total if total else 1.0
