"""Shared pieces of the Qwen3-VL tests (tests/unit/test_vlm*.py, tests/gpu/test_vlm_gpu.py,
tests/vllm_venv/test_vlm_v1.py): the tiny random model (``tiny_vlm``, which each module's ``vlm`` fixture returns) and
the trainer's logprobs of one document, which the engine's sampled-token logprobs are checked against
(``trainer_logprobs``, ``assert_engine_matches_trainer``). Imports only prime_spmd, torch and transformers, so the
vLLM venv can use it too."""

from __future__ import annotations

import pytest
import torch

from prime_spmd.inference.engine import Completion, Request, SamplingParams
from prime_spmd.models.vision import VisionInputs, load_vision_processor
from prime_spmd.models.vlm import VLMAdapter, build_tiny_vlm


def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(model dir, model, tokenizer, processor) of a random qwen3-vl-nano (seed 0; fp32, eval, on the CPU) written
    to a new temp dir: the body of the test modules' ``vlm`` fixtures (module scope)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm"), seed=0)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return path, model, tok, load_vision_processor(str(path), tok)


def group_requests(prompts: list, group: int, max_tokens: int, seed_step: int, tag: str = "") -> list[Request]:
    """``group`` requests a (ids, vision) prompt, ids ``{tag}{p}/{j}``, sampled at temperature 1 for exactly
    ``max_tokens`` tokens (eos ignored) with seed ``seed_step * p + j``."""
    return [
        Request(
            prompt_ids=list(ids),
            vision=v,
            request_id=f"{tag}{p}/{j}",
            sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed_step * p + j, ignore_eos=True),
        )
        for p, (ids, v) in enumerate(prompts)
        for j in range(group)
    ]


def trainer_logprobs(model, ids: list[int], vision: VisionInputs | None) -> torch.Tensor:
    """[T-1] fp32 on the CPU: log p(ids[t+1] | ids[:t+1]) of the trainer's forward over one document
    (``VLMAdapter.forward_hidden_vision``; ``forward_hidden`` for a text-only one), on the model's device."""
    device = model.lm_head.weight.device
    x = torch.tensor([ids], device=device)
    pos = torch.arange(x.shape[1], device=device)[None]
    adapter = VLMAdapter(model)
    with torch.no_grad():
        if vision is None:
            h = adapter.forward_hidden(x, pos)
        else:
            h = adapter.forward_hidden_vision(x, pos, [(0, vision.to(device))])
        lp = torch.log_softmax(model.lm_head(h)[0].float(), -1)
    return lp[:-1].gather(-1, x[0, 1:, None])[:, 0].cpu()


def completion_logprob_diff(model, request: Request, completion: Completion) -> torch.Tensor:
    """[len(completion.token_ids)]: the engine's sampled-token logprobs minus the trainer's."""
    trainer = trainer_logprobs(model, request.prompt_ids + completion.token_ids, request.vision)
    return torch.tensor(completion.logprobs) - trainer[len(request.prompt_ids) - 1 :]


def assert_engine_matches_trainer(model, requests: list[Request], completions: list[Completion], atol: float) -> None:
    """Each completion's sampled-token logprobs equal the trainer's on its request's prompt to ``atol``."""
    assert len(requests) == len(completions)
    for r, c in zip(requests, completions):
        diff = completion_logprob_diff(model, r, c)
        torch.testing.assert_close(
            diff, torch.zeros_like(diff), atol=atol, rtol=0, msg=lambda m, rid=r.request_id: f"{rid}: {m}"
        )
