"""The native engine's host-side scheduler (prime_spmd/inference/scheduler.py) without a model: admission into slots,
prompt sharing, the paged cache's block budget and the stop rules."""

from __future__ import annotations

from prime_spmd.inference.engine import Request, SamplingParams
from prime_spmd.inference.scheduler import Scheduler


class CharTokenizer:
    """Token id i is the character chr(i); eos is 0."""

    eos_token_id = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def _req(rid, prompt, **sp) -> Request:
    return Request(prompt_ids=list(prompt), sampling=SamplingParams(**sp), request_id=rid)


def test_admission_fills_lowest_slots_and_groups_identical_prompts():
    released = []
    s = Scheduler(num_slots=3, max_model_len=64, prefill_tokens=64, share_prompts=True, release=released.append)
    for rid, prompt in enumerate([[5, 6], [7], [5, 6], [9, 9, 9]]):
        s.waiting.append(_req(rid, prompt, seed=rid))
    (chunk,) = s.admit()
    assert [q.slot for q in chunk] == [1, 0, 2]  # sorted by (length, prompt): [7] first, then the [5, 6] pair
    assert [q.req.request_id for q in chunk] == [1, 0, 2] and len(s.waiting) == 1  # no free slot for request 3
    leaders, rows = s.leaders(chunk)
    assert [q.req.request_id for q in leaders] == [1, 0] and rows == [0, 1, 1]  # the pair prefills once
    s.start(chunk)
    done = s.record(chunk, [100, 101, 102], [-1.0, -2.0, -3.0])
    assert done == [] and [q.tokens for q in chunk] == [[100], [101], [102]]
    no_share = Scheduler(num_slots=2, max_model_len=64, prefill_tokens=64, share_prompts=False)
    no_share.waiting.extend([_req(0, [5, 6]), _req(1, [5, 6])])
    assert no_share.leaders(no_share.admit()[0])[1] == [0, 1]


def test_prefill_chunks_hold_at_most_prefill_tokens_of_distinct_prompts():
    s = Scheduler(num_slots=8, max_model_len=64, prefill_tokens=8, share_prompts=True)
    s.waiting.extend([_req(0, [1, 2, 3, 4]), _req(1, [1, 2, 3, 4]), _req(2, [5, 6, 7, 8]), _req(3, [9, 9, 9, 9])])
    chunks = s.admit()
    assert [[q.req.request_id for q in c] for c in chunks] == [[0, 1, 2], [3]]  # 2 distinct x 4 tokens per chunk


class Blocks:
    """A paged cache's block arithmetic: 4 positions a block."""

    num_free_blocks = 5

    def blocks_for(self, n: int, shared: int = 0) -> int:
        return -(-n // 4) - shared // 4


def test_paged_admission_waits_for_blocks_in_fifo_order():
    s = Scheduler(num_slots=8, max_model_len=64, prefill_tokens=64, share_prompts=True, blocks=Blocks())
    # 8 + 4 = 12 positions: 3 blocks; the repeat shares the prompt's 2 whole blocks (1 more); then 3 do not fit
    s.waiting.extend([_req(0, range(1, 9), max_tokens=4), _req(1, range(1, 9), max_tokens=4)])
    s.waiting.extend([_req(2, [1], max_tokens=11), _req(3, [1], max_tokens=1)])
    (chunk,) = s.admit()
    assert sorted(q.req.request_id for q in chunk) == [0, 1]
    assert [r.request_id for r in s.waiting] == [2, 3]  # request 3 would fit, but waits behind request 2 (FIFO)


def test_stop_rules_and_release():
    released = []
    s = Scheduler(num_slots=4, max_model_len=10, prefill_tokens=64, share_prompts=True, tokenizer=CharTokenizer(),
                  release=released.append)  # fmt: skip
    s.waiting.extend([
        _req("eos", [65], max_tokens=8),
        _req("ignore", [65], max_tokens=2, ignore_eos=True),
        _req("string", [65], max_tokens=8, stop=["cd"]),
        _req("len", [65] * 8, max_tokens=8),
    ])  # fmt: skip
    (chunk,) = s.admit()
    s.start(chunk)
    by_id = {q.req.request_id: q for q in chunk}
    order = [by_id[r] for r in ("eos", "ignore", "string", "len")]
    assert s.record(order, [ord("a"), 0, ord("c"), ord("x")], [0.0] * 4) == []
    done = s.record(order, [0, 0, ord("d"), ord("y")], [0.0] * 4)
    reasons = {c.request_id: c.finish_reason for c in done}
    # eos stops; ignore_eos runs to max_tokens; "cd" completes on "d"; 8 + 2 positions fill the cache length 10
    assert reasons == {"eos": "stop", "ignore": "length", "string": "stop", "len": "length"}
    assert next(c for c in done if c.request_id == "string").text == "cd"
    assert sorted(released) == sorted(q.slot for q in chunk) and not s.running and len(s.free) == 4
    assert s.num_generated_tokens == 8
