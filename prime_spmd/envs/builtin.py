"""What the built-in environments (reverse_text, number_list, visual) share: one user message per example, every
request of a call in one continuous batch, a per-request seed, and a scorer of the decoded completion."""

from __future__ import annotations

import abc
import hashlib
from typing import Any, Literal

from prime_spmd.envs.base import Environment, completion_text
from prime_spmd.envs.rollout import Rollout
from prime_spmd.inference.engine import InferenceEngine, Request, SamplingParams
from prime_spmd.models.vision import has_images


def prompt_text(content: str | list) -> str:
    """A message's text: the content string, or its text parts joined (image parts left out)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def request_seed(seed: int, split: str, example_id: int, sample_idx: int) -> int:
    """A 63-bit sampling seed from (seed, split, example id, sample index): stable across runs and batches."""
    digest = hashlib.blake2b(f"{seed}/{split}/{example_id}/{sample_idx}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class BuiltinEnv(Environment):
    """An environment whose ``example`` is one user message with an ``answer``, scored by ``score``."""

    @abc.abstractmethod
    def score(self, answer: str, text: str) -> tuple[float, float]:
        """(reward, exact_match) of the completion ``text`` (decoded, cut at the first end token)."""

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
        # prompts with image parts (envs/visual.py) render with the model's image processor
        rendered = [
            engine.render_prompt(ex["prompt"]) if has_images(ex["prompt"]) else (engine.render_chat(ex["prompt"]), None)
            for ex in examples
        ]
        prompts = [ids for ids, _ in rendered]
        visions = [None if v is None else v.without_images() for _, v in rendered]  # what rollouts carry
        requests = []
        for ex, (prompt, vision) in zip(examples, rendered):
            for j in range(group_size):
                sp = SamplingParams(**{f: getattr(sampling, f) for f in SamplingParams.__slots__})
                sp.seed = request_seed(seed, split, ex["example_id"], j)
                rid = f"{split}/{ex['example_id']}/{j}"
                requests.append(Request(prompt_ids=prompt, sampling=sp, request_id=rid, vision=vision))
        completions = iter(engine.generate(requests, progress=progress))
        groups = []
        for ex, prompt, vision in zip(examples, prompts, visions):
            group = []
            for j in range(group_size):
                c = next(completions)
                text = completion_text(engine.tokenizer, c.token_ids)
                reward, exact = self.score(ex["answer"], text)
                group.append(
                    Rollout(
                        example_id=ex["example_id"],
                        sample_idx=j,
                        prompt_ids=list(prompt),
                        completion_ids=list(c.token_ids),
                        completion_mask=[1] * len(c.token_ids),
                        inference_logprobs=list(c.logprobs),
                        reward=reward,
                        metrics={"exact_match": exact},
                        vision=vision,
                        info={
                            "prompt_text": prompt_text(ex["prompt"][0]["content"]),
                            "answer": ex["answer"],
                            "completion_text": text,
                            "finish_reason": c.finish_reason,
                        },
                    )
                )
            groups.append(group)
        return groups


class GeneratedTaskEnv(BuiltinEnv):
    """A built-in whose examples a seeded generator draws (number_list, visual): ``--env.args`` are the task's
    fields (``parse_args``) plus ``num_train_examples``; example ``index`` of a split comes from its own RNG
    (``draw``), so examples do not depend on iteration order."""

    def __init__(self, *, seed: int = 0, num_eval_examples: int = 64, args: dict[str, str] | None = None) -> None:
        self.task, rest = self.parse_args(args, "--env.args")
        num_train = rest.pop("num_train_examples", "100000")
        if rest:
            raise ValueError(f"--env.args: unknown keys {sorted(rest)} for {self.name}")
        self.num_train = int(num_train)
        self.seed, self.num_eval = seed, num_eval_examples

    @staticmethod
    @abc.abstractmethod
    def parse_args(args: dict[str, str] | None, flag: str) -> tuple[Any, dict[str, str]]:
        """(the task, the keys it did not take)."""

    @abc.abstractmethod
    def draw(self, split: Literal["train", "eval"], index: int) -> tuple[Any, str]:
        """(prompt messages, answer) of example ``index`` of ``split``."""

    def num_examples(self, split: Literal["train", "eval"]) -> int:
        return self.num_train if split == "train" else self.num_eval

    def example(self, split: Literal["train", "eval"], index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_examples(split):
            raise ValueError(f"{self.name}: {split} example {index} out of range [0, {self.num_examples(split)})")
        prompt, answer = self.draw(split, index)
        return {"prompt": prompt, "answer": answer, "example_id": index}
