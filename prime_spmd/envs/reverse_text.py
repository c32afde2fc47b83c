"""Built-in reverse-text environment: reverse a seeded random string; reward is the LCS ratio.

Examples come from the same generator the SFT data uses (``prime_spmd.data.reverse_text``), so a
model fine-tuned on reverse-text SFT data is evaluated on the same distribution. The prompt is one
user message holding the string (no system prompt: the tiny char models have short contexts).
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from prime_spmd.data.reverse_text import example_rng, lcs_ratio, reverse_text_example
from prime_spmd.envs.base import END_MARKERS, Environment, completion_text
from prime_spmd.envs.rollout import Rollout
from prime_spmd.inference.engine import InferenceEngine, Request, SamplingParams

__all__ = ["ReverseTextEnv", "reverse_text_example", "lcs_ratio", "request_seed", "completion_text", "END_MARKERS"]


def request_seed(seed: int, split: str, example_id: int, sample_idx: int) -> int:
    """A 63-bit sampling seed from (seed, split, example id, sample index): stable across runs and batches."""
    digest = hashlib.blake2b(f"{seed}/{split}/{example_id}/{sample_idx}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ReverseTextEnv(Environment):
    """``args``: min_chars, max_chars (string length, inclusive), alphabet, num_train_examples."""

    name = "reverse_text"

    def __init__(self, *, seed: int = 0, num_eval_examples: int = 64, args: dict[str, str] | None = None) -> None:
        args = dict(args or {})
        known = {"min_chars", "max_chars", "alphabet", "num_train_examples"}
        unknown = set(args) - known
        if unknown:
            raise ValueError(f"--env.args: unknown keys {sorted(unknown)} for reverse_text; allowed: {sorted(known)}")
        self.min_chars = int(args.get("min_chars", 5))
        self.max_chars = int(args.get("max_chars", 10))
        self.alphabet = args.get("alphabet", "abcdefghijklmnopqrstuvwxyz")
        self.num_train = int(args.get("num_train_examples", 100_000))
        if not 1 <= self.min_chars <= self.max_chars:
            raise ValueError(f"--env.args: need 1 <= min_chars <= max_chars, got {self.min_chars}, {self.max_chars}")
        self.seed, self.num_eval = seed, num_eval_examples

    def num_examples(self, split: Literal["train", "eval"]) -> int:
        return self.num_train if split == "train" else self.num_eval

    def example(self, split: Literal["train", "eval"], index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_examples(split):
            raise ValueError(f"reverse_text: {split} example {index} out of range [0, {self.num_examples(split)})")
        text, answer = reverse_text_example(
            example_rng(self.seed, split, index), self.min_chars, self.max_chars, self.alphabet
        )
        return {"prompt": [{"role": "user", "content": text}], "answer": answer, "example_id": index}

    def run_groups(
        self,
        engine: InferenceEngine,
        split: Literal["train", "eval"],
        example_ids: list[int],
        group_size: int,
        sampling: SamplingParams,
        seed: int,
        progress: bool = False,
    ) -> list[list[Rollout]]:
        """All ``len(example_ids) * group_size`` requests go to the engine in one continuous batch."""
        examples = [self.example(split, i) for i in example_ids]
        prompts = [engine.render_chat(ex["prompt"]) for ex in examples]
        requests = []
        for ex, prompt in zip(examples, prompts):
            for j in range(group_size):
                sp = SamplingParams(**{f: getattr(sampling, f) for f in SamplingParams.__slots__})
                sp.seed = request_seed(seed, split, ex["example_id"], j)
                requests.append(Request(prompt_ids=prompt, sampling=sp, request_id=f"{split}/{ex['example_id']}/{j}"))
        completions = iter(engine.generate(requests, progress=progress))
        groups = []
        for ex, prompt in zip(examples, prompts):
            group = []
            for j in range(group_size):
                c = next(completions)
                text = completion_text(engine.tokenizer, c.token_ids)
                reward = lcs_ratio(ex["answer"], text)
                group.append(
                    Rollout(
                        example_id=ex["example_id"],
                        sample_idx=j,
                        prompt_ids=list(prompt),
                        completion_ids=list(c.token_ids),
                        completion_mask=[1] * len(c.token_ids),
                        inference_logprobs=list(c.logprobs),
                        reward=reward,
                        metrics={"exact_match": float(text == ex["answer"])},
                        info={
                            "prompt_text": ex["prompt"][0]["content"],
                            "answer": ex["answer"],
                            "completion_text": text,
                            "finish_reason": c.finish_reason,
                        },
                    )
                )
            groups.append(group)
        return groups
