"""Prompts with images in multi-turn chats, token-exact; shared by both verifiers bridges (vf_client.py, vf_v1.py).

No verifiers import. A first prompt with image parts is rendered by the model's ``VisionProcessor`` (each image's
placeholder expanded to its tokens, models/vision.py). A later turn that extends the previous turn's messages is
stitched as for text (chat_render.py: previous prompt ids + completion ids + the bridge ids, never re-rendered);
image parts in the new messages make the template write one ``<|image_pad|>`` each in the bridge, which the
processor expands, and the turn's vision inputs become the earlier images followed by the new ones, each with its
start in the document (``join_vision``): the engine and the trainer place every image's features at its own tokens,
also after the policy sampled an image token. A turn that rewrites the history (or whose bridge cannot be cut out)
is rendered afresh with all its images and counted (``prefix_breaks`` / ``bridge_failures``); the rollout stops
before it (trajectory.py) and carries the images of its last turn (``rollout_vision``).
"""

from __future__ import annotations

from typing import Any

from prime_spmd.envs.chat_render import ChatRenderer
from prime_spmd.models.vision import VisionInputs, VisionProcessor, image_parts, join_vision, no_image_support


def needs_processor(engine: Any, messages: list[dict]) -> VisionProcessor:
    """The engine's ``VisionProcessor``; ``ImageInputError`` naming the model directory when it has none (a
    text-only model) and ``messages`` hold an image."""
    processor = getattr(engine, "processor", None)
    if processor is None:
        model = getattr(engine.tokenizer, "name_or_path", None) or type(getattr(engine, "model", engine)).__name__
        raise no_image_support(f"a prompt with {len(image_parts(messages))} image parts", model)
    return processor


def next_prompt(
    renderer: ChatRenderer,
    processor: VisionProcessor,
    messages: list[dict],
    tools: list[dict] | None,
    kwargs: dict,
    previous: list[dict],
    prompt_ids: list[int],
    completion_ids: list[int],
    vision: VisionInputs | None,
    check_rerender: bool,
) -> tuple[list[int], VisionInputs | None, str | None]:
    """(prompt ids, vision inputs, bridge counter or None) of a later turn of a conversation with images (module doc).

    ``previous``: the last turn's prompt + reply messages, ``prompt_ids`` / ``completion_ids`` its ids, ``vision`` its
    images. ``check_rerender``: compare the stitched ids with a fresh render of ``messages`` whose placeholders are
    expanded with the same images (counted as ``rerender_mismatches`` when they differ).
    """
    n = len(previous)
    stat = "prefix_breaks"
    if len(messages) > n and messages[:n] == previous:
        tail = messages[n:]
        bridge = renderer.bridge_ids(completion_ids, tail, tools, kwargs)
        if bridge is not None:
            head = prompt_ids + completion_ids
            new = processor.images_of(tail, first_message=n)
            if new is not None:
                bridge = processor.expand(bridge, new)
                starts = [] if vision is None else vision.starts_in(head)
                vision = join_vision(vision, new, starts + [len(head) + s for s in new.starts_in(bridge)])
            ids = head + bridge
            if check_rerender and ids != _fresh_ids(renderer, processor, messages, tools, kwargs, vision):
                return ids, vision, "rerender_mismatches"
            return ids, vision, None
        stat = "bridge_failures"
    ids, fresh = processor.render(messages, tools, kwargs)
    return ids, fresh, stat


def _fresh_ids(
    renderer: ChatRenderer,
    processor: VisionProcessor,
    messages: list[dict],
    tools: list[dict] | None,
    kwargs: dict,
    vision: VisionInputs | None,
) -> list[int] | None:
    """``messages`` rendered afresh with ``vision``'s images expanded (None when the placeholders do not match)."""
    ids = renderer.render_ids(messages, tools, kwargs)
    num_images = 0 if vision is None else vision.num_images
    if ids.count(processor.image_token_id) != num_images:
        return None
    return ids if vision is None else processor.expand(ids, vision)


def rollout_vision(turns: list[tuple[list[int], VisionInputs | None]], ids: list[int]) -> VisionInputs | None:
    """The images of a rollout whose ids are ``ids``: those of the latest turn (its prompt ids, its vision inputs)
    whose prompt starts the rollout (turns after a history break are not part of it), without PIL images."""
    for prompt_ids, vision in reversed(turns):
        if ids[: len(prompt_ids)] == prompt_ids:
            return None if vision is None else vision.without_images()
    return None
