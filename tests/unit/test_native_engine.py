"""Native engine vs transformers on a tiny Qwen3 (fp32): greedy parity, logprob contract,
weight loading, seeds, stop rules, the generic fallback runner and the asyncio front.

Device-aware (the `device` fixture): with a GPU the engines run on CUDA with the compiled fused decode
layer and sampler, one CUDA graph per decode step (asserted in `_engine`); without one, on CPU.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_spmd.inference import runner as runner_mod
from prime_spmd.inference.engine import AsyncEngine, Request, SamplingParams
from prime_spmd.inference.logprobs import mismatch_stats, teacher_forced_logprobs
from prime_spmd.inference.native import NativeEngine
from prime_spmd.models.hf_adapter import HFAdapter
from prime_spmd.models.tiny import build_tiny_model

TEXTS = ["hello world", "abc", "the quick brown fox jumps", "x", "reverse me please", "qwerty uiop"]
# max |engine - teacher-forced| logprob, fp32. CPU: measured 5.5e-6 (greedy test, 2026-12-03).
# CUDA: the compiled decode layer and sampler vs an eager forward; H200 run 2 (2026-12-03, docs/testing.md)
# measured 3.7e-6 (test property max_logprob_diff); 1e-4 also covers the shared-prefill test below.
LOGPROB_ATOL = {"cpu": 1e-5, "cuda": 1e-4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # initializer_range 0.3: a peaky random model whose greedy outputs vary (std 0.02 repeats one token)
    return build_tiny_model(tmp_path_factory.mktemp("nano"), "qwen3-nano", seed=0, initializer_range=0.3)


def _load(path):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def _engine(path, device, **kw):
    """(engine, its model, tokenizer); the model is moved to ``device`` (CUDA: graphs must be on)."""
    model, tok = _load(path)
    kw.setdefault("max_batch_size", 2)
    kw.setdefault("max_model_len", 64)
    eng = NativeEngine(model, tok, device=device, **kw)
    if device.type == "cuda" and isinstance(eng.runner, runner_mod.LlamaStyleRunner):
        # the fused decode layer wherever the model supports it (a test may turn that off: the submodule path)
        assert eng.use_graphs and (eng.runner.layer_args is not None) == eng.runner.adapter.supports_fused_decode()
    return eng, model, tok


def _reqs(tok, sampling: SamplingParams, texts=TEXTS, seed0: int | None = None):
    out = []
    for i, t in enumerate(texts):
        s = SamplingParams(**{f: getattr(sampling, f) for f in sampling.__slots__})
        if seed0 is not None:
            s.seed = seed0 + i
        out.append(Request(prompt_ids=tok.encode(t), sampling=s, request_id=i))
    return out


def _hf_greedy(model, prompt_ids, n):
    ids = torch.tensor([prompt_ids], device=next(model.parameters()).device)
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


def test_greedy_matches_hf_generate_with_continuous_batching(model_dir, device, record_property):
    # 6 prompts of different lengths through 2 slots: finished slots are refilled while others decode
    eng, model, tok = _engine(model_dir, device)
    reqs = _reqs(tok, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    reqs[1].sampling.max_tokens = 5  # finishes early, its slot is refilled mid-flight
    outs = eng.generate(reqs)
    diff = 0.0
    for r, o in zip(reqs, outs):
        assert o.token_ids == _hf_greedy(model, r.prompt_ids, r.sampling.max_tokens), o.request_id
        assert o.finish_reason == "length"
        tf = teacher_forced_logprobs(model, r.prompt_ids, o.token_ids, temperature=0).cpu()
        diff = max(diff, (torch.tensor(o.logprobs) - tf).abs().max().item())
    record_property("max_logprob_diff", diff)
    assert diff < LOGPROB_ATOL[device.type], diff
    assert not eng.has_unfinished()


def test_generic_runner_fallback_matches_hf(model_dir, monkeypatch, device):
    monkeypatch.setattr(HFAdapter, "supports_slot_cache", lambda self: False)
    eng, model, tok = _engine(model_dir, device)
    assert isinstance(eng.runner, runner_mod.GenericRunner)
    reqs = _reqs(tok, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), TEXTS[:3])
    for r, o in zip(reqs, eng.generate(reqs)):
        assert o.token_ids == _hf_greedy(model, r.prompt_ids, 8)
    # config.json's resolved block reads the runner's paths: the generic runner has none of them
    from prime_spmd.config.job import RLJobConfig
    from prime_spmd.config.sections import ModelConfig
    from prime_spmd.trainer.resolved import resolved_settings

    out = resolved_settings(RLJobConfig(model=ModelConfig(path=str(model_dir))), device, engine=eng)
    assert out["inference.native.decode_attention"].startswith("unused (generic runner")
    assert out["inference.native.prefill"] == "modules"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_teacher_forced(model_dir, temperature, device, record_property):
    eng, model, tok = _engine(model_dir, device, max_batch_size=4)
    reqs = _reqs(tok, SamplingParams(temperature=temperature, max_tokens=32, ignore_eos=True), seed0=100)
    outs = eng.generate(reqs)
    trainer = torch.cat(
        [teacher_forced_logprobs(model, r.prompt_ids, o.token_ids, temperature) for r, o in zip(reqs, outs)]
    )
    inference = torch.cat([torch.tensor(o.logprobs) for o in outs])
    stats = mismatch_stats(trainer.cpu(), inference)
    record_property("mismatch_stats", stats)
    # measured on CPU fp32: mean |diff| ~1e-7, KL ~1e-14
    assert stats["mean_abs_diff"] < 1e-5, stats
    assert stats["mismatch_kl"] < 1e-5, stats
    assert len(trainer) == 32 * len(reqs)


def test_load_weights_in_place_matches_model_built_from_new_weights(model_dir, tmp_path, device):
    other = build_tiny_model(tmp_path / "other", "qwen3-nano", seed=1, initializer_range=0.3)
    eng, model, tok = _engine(model_dir, device)
    new_model, _ = _load(other)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    sp = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    eng.load_weights(new_model.state_dict().items())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before  # no re-allocation
    got = eng.generate(_reqs(tok, sp, TEXTS[:4], seed0=7))
    ref_eng, _, _ = _engine(other, device)
    want = ref_eng.generate(_reqs(tok, sp, TEXTS[:4], seed0=7))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    greedy = eng.generate(_reqs(tok, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), TEXTS[:2]))
    assert greedy[0].token_ids == _hf_greedy(new_model, tok.encode(TEXTS[0]), 10)
    with pytest.raises(ValueError, match="unknown parameter 'model.nope.weight'"):
        eng.load_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        eng.load_weights([("model.norm.weight", torch.zeros(3))])


def test_seed_fixes_outputs_across_batch_composition(model_dir, device):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True)
    eng, _, tok = _engine(model_dir, device, max_batch_size=4)
    full = eng.generate(_reqs(tok, sp, seed0=11))
    again = eng.generate(_reqs(tok, sp, seed0=11))
    assert [o.token_ids for o in full] == [o.token_ids for o in again]
    # request 3 alone, in an engine with 1 slot, and shuffled among others in a 3-slot engine
    alone_eng, _, _ = _engine(model_dir, device, max_batch_size=1)
    alone = alone_eng.generate(_reqs(tok, sp, seed0=11)[3:4])
    assert alone[0].token_ids == full[3].token_ids
    eng3, _, _ = _engine(model_dir, device, max_batch_size=3)
    shuffled = list(reversed(_reqs(tok, sp, seed0=11)))
    out3 = {o.request_id: o.token_ids for o in eng3.generate(shuffled)}
    assert [out3[i] for i in range(len(TEXTS))] == [o.token_ids for o in full]
    other_seed = eng.generate(_reqs(tok, sp, seed0=12))
    assert [o.token_ids for o in other_seed] != [o.token_ids for o in full]


def test_stop_ids_stop_strings_eos_and_max_len(model_dir, device):
    eng, model, tok = _engine(model_dir, device)
    prompt = tok.encode(TEXTS[0])
    ref = _hf_greedy(model, prompt, 20)
    # stop id: the 4th greedy token ends the completion (kept)
    sp = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ref[3]], ignore_eos=True)
    o = eng.generate([Request(prompt_ids=prompt, sampling=sp)])[0]
    k = ref.index(ref[3])
    assert o.token_ids == ref[: k + 1] and o.finish_reason == "stop"
    # stop string spanning two tokens
    text = tok.decode(ref)
    stop = text[5:7]
    sp = SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True)
    o = eng.generate([Request(prompt_ids=prompt, sampling=sp)])[0]
    assert o.finish_reason == "stop" and o.text.endswith(stop) and o.text.count(stop) == 1
    assert o.token_ids == ref[: len(o.token_ids)]
    # eos ends the completion unless ignore_eos
    eos = tok.eos_token_id
    sp_eos = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[])
    # make eos the argmax (tied embeddings: also the input); on CUDA the captured graphs read the new row
    eng.model.lm_head.weight.data[eos] += 100.0
    o = eng.generate([Request(prompt_ids=prompt, sampling=sp_eos)])[0]
    assert o.token_ids == [eos] and o.finish_reason == "stop"
    sp_eos.ignore_eos = True
    o = eng.generate([Request(prompt_ids=prompt, sampling=sp_eos)])[0]
    assert len(o.token_ids) == 20 and o.finish_reason == "length"
    # the KV cache length caps a completion
    long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    o = eng.generate([Request(prompt_ids=prompt, sampling=long)])[0]
    assert len(prompt) + len(o.token_ids) == 64 and o.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(Request(prompt_ids=[5] * 64))


@pytest.mark.parametrize("kv_cache", ["slot", "paged"])
def test_multi_step_launches_match_single_steps(model_dir, device, kv_cache):
    """``decode_steps_per_launch`` 4 against 1: the same tokens, logprobs and finish reasons, with launches of 4
    steps once nothing waits for admission (6 requests through 2 slots; the last two run long), a row that stops
    inside a launch (a stop id), max_tokens that are not multiples of 4 and the cache length capping a row; no
    launch takes a row past its max_tokens or the cache (the paged cache reserves only that much)."""
    sp = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    one, _, tok = _engine(model_dir, device, decode_steps_per_launch=1, kv_cache=kv_cache)
    four, _, _ = _engine(model_dir, device, decode_steps_per_launch=4, kv_cache=kv_cache)
    assert one.decode_steps == 1 and four.decode_steps == 4

    def reqs(stop=None):
        rs = _reqs(tok, sp, seed0=3)
        for r, n in zip(rs, (16, 5, 11, 7, 1000, 1000)):  # the last two: capped by the cache length (64)
            r.sampling.max_tokens = n
        rs[5].sampling.stop_token_ids = [stop] if stop is not None else []
        return rs

    launches = []  # (k, request 5's tokens launched before)
    real = four._steps_for

    def steps_for(seqs, nb):
        k = real(seqs, nb)
        for q in seqs:
            room = min(q.req.sampling.max_tokens, four.max_model_len - len(q.req.prompt_ids)) - q.num_launched
            assert k <= room, (q.req.request_id, k, room)
        launches.append((k, next((q.num_launched for q in seqs if q.req.request_id == 5), None)))
        return k

    four._steps_for = steps_for
    free = four.generate(reqs())[5].token_ids
    # a stop id first drawn inside a launch of 4 (at its 1st-3rd step: a launch after n tokens draws n .. n + 3)
    mid = {n + j for k, n in launches if k == 4 and n is not None for j in range(3)}
    at = next(i for i, t in enumerate(free) if i in mid and free.index(t) == i)
    launches.clear()
    want, got = one.generate(reqs(free[at])), four.generate(reqs(free[at]))
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason, g.request_id
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-6)
    assert want[5].finish_reason == "stop" and len(want[5].token_ids) == at + 1
    assert want[4].finish_reason == "length" and len(want[4].prompt_ids) + len(want[4].token_ids) == 64
    assert [k for k, _ in launches].count(4) >= 4, launches  # the last rows' steps ran 4 a launch


def test_async_engine_batches_concurrent_callers(model_dir, device):
    eng, model, tok = _engine(model_dir, device, max_batch_size=4)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    front = AsyncEngine(eng)

    async def main():
        return await asyncio.gather(*(front.generate(tok.encode(t), sp) for t in TEXTS))

    outs = asyncio.run(main())
    for t, o in zip(TEXTS, outs):
        assert o.token_ids == _hf_greedy(model, tok.encode(t), 6)


def test_custom_qwen3_model_runs_on_the_fast_runner(model_dir, device, record_property):
    from prime_spmd.config.sections import ModelConfig
    from prime_spmd.models.loading import load_model

    custom = load_model(ModelConfig(path=str(model_dir), impl="custom"), device, dtype=torch.float32)
    hf_model, tok = _load(model_dir)
    eng = NativeEngine(custom, tok, max_batch_size=2, max_model_len=64, device=device)
    assert isinstance(eng.runner, runner_mod.LlamaStyleRunner)
    assert eng.runner.layer_args is not None  # dense: the fused decode layer, as for HF Qwen3
    assert eng.use_graphs == (device.type == "cuda")
    reqs = _reqs(tok, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), TEXTS[:3])
    for r, o in zip(reqs, eng.generate(reqs)):
        assert o.token_ids == _hf_greedy(hf_model, r.prompt_ids, 10)
    sampled = eng.generate(_reqs(tok, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), seed0=3))
    trainer = torch.cat([teacher_forced_logprobs(custom, o.prompt_ids, o.token_ids, 1.0) for o in sampled])
    stats = mismatch_stats(trainer.cpu(), torch.cat([torch.tensor(o.logprobs) for o in sampled]))
    record_property("mismatch_stats", stats)
    assert stats["mean_abs_diff"] < 1e-5 and stats["mismatch_kl"] < 1e-5, stats


def test_load_weights_keeps_rope_buffers_in_place(tmp_path, device) -> None:
    """Captured CUDA graphs read the RoPE tables by address: a weight update must not replace them
    (it did, and decode after the first sync read freed memory on the H200)."""
    from transformers import AutoModelForCausalLM

    from prime_spmd.inference.native import NativeEngine
    from prime_spmd.models.tiny import build_char_tokenizer, build_tiny_model

    path = build_tiny_model(tmp_path / "m", "qwen3-nano", initializer_range=0.3)
    engine = NativeEngine(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        build_char_tokenizer(),
        max_batch_size=2,
        max_model_len=32,
        device=device,
    )
    cos, sin = engine.runner.cos_TcDh, engine.runner.sin_TcDh
    ptrs = (cos.data_ptr(), sin.data_ptr())
    before = cos.clone()
    new = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "n", "qwen3-nano", seed=1))
    engine.load_weights(new.named_parameters())
    assert (engine.runner.cos_TcDh.data_ptr(), engine.runner.sin_TcDh.data_ptr()) == ptrs
    assert torch.equal(engine.runner.cos_TcDh, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs + compiled decode need a GPU")
def test_cuda_graph_decode_keeps_the_contract(model_dir, record_property):
    """The CUDA path (compiled fused decode layer + sampler, one graph per step and per prefill bucket, host one
    step behind) against HF greedy, the teacher-forced logprobs and the CPU engine's seeded samples."""
    model, tok = _load(model_dir)
    eng = NativeEngine(model.cuda(), tok, max_batch_size=4, max_model_len=64)
    assert eng.use_graphs and eng.runner.layer_args is not None
    greedy = _reqs(tok, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    greedy[2].sampling.max_tokens = 3
    cpu_model, _ = _load(model_dir)
    for r, o in zip(greedy, eng.generate(greedy)):
        assert o.token_ids == _hf_greedy(cpu_model, r.prompt_ids, r.sampling.max_tokens), o.request_id
    assert eng._prefill_graphs._graphs  # the prefills above replayed captured graphs (graphs.PREFILL_GRAPH_MAX_TOKENS)
    sp = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    outs = eng.generate(_reqs(tok, sp, seed0=5))
    trainer = torch.cat([teacher_forced_logprobs(cpu_model, o.prompt_ids, o.token_ids, 1.0) for o in outs])
    stats = mismatch_stats(trainer, torch.cat([torch.tensor(o.logprobs) for o in outs]))
    record_property("mismatch_stats_vs_cpu", stats)
    assert stats["mismatch_kl"] < 1e-6, stats  # fp32 on CUDA vs fp32 on CPU
    cpu_eng, _, _ = _engine(model_dir, torch.device("cpu"), max_batch_size=3)
    want = cpu_eng.generate(_reqs(tok, sp, seed0=5))
    same = sum(o.token_ids == w.token_ids for o, w in zip(outs, want))
    assert same == len(outs), f"{same}/{len(outs)} seeded completions equal across devices"
    # a stop id reached mid-flight: the row decoded after it is dropped
    ref = _hf_greedy(cpu_model, greedy[0].prompt_ids, 20)
    stop = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ref[4]], ignore_eos=True)
    o = eng.generate([Request(prompt_ids=greedy[0].prompt_ids, sampling=stop)])[0]
    assert o.token_ids == ref[: ref.index(ref[4]) + 1] and o.finish_reason == "stop"


def test_groups_prefill_their_prompt_once(model_dir, device):
    """A GRPO group (same prompt, own seeds) admitted together runs one prefill row and copies its
    K/V; completions and logprobs equal those of an engine that prefills every request."""
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    texts = [TEXTS[0]] * 4 + [TEXTS[2]] * 3 + [TEXTS[4]]
    shared, _, tok = _engine(model_dir, device, max_batch_size=8)
    plain, _, _ = _engine(model_dir, device, max_batch_size=8, share_prefill=False)
    got = shared.generate(_reqs(tok, sp, texts, seed0=40))
    want = plain.generate(_reqs(tok, sp, texts, seed0=40))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # CPU: equal to 1e-6. CUDA: the shared row's prefill runs at another GEMM shape (cuBLAS may pick
    # another kernel); passed on the H200 at LOGPROB_ATOL (run 2, 2026-12-03; error not recorded).
    atol = 1e-6 if device.type == "cpu" else LOGPROB_ATOL["cuda"]
    assert torch.allclose(torch.tensor([o.logprobs for o in got]), torch.tensor([o.logprobs for o in want]), atol=atol)
    assert len({tuple(o.token_ids) for o in got[:4]}) > 1  # own seeds: the group's samples differ
    lens = [len(tok.encode(t)) for t in texts]
    assert shared.num_prompt_tokens == plain.num_prompt_tokens == plain.num_prefill_tokens == sum(lens)
    assert shared.num_prefill_tokens == lens[0] + lens[4] + lens[7]


def test_sampled_sequences_follow_the_model_distribution(model_dir, device):
    """Seeded samples of 2-token completions (prefill's sample, then a decode step's) are drawn from the model's
    joint distribution p(t1) p(t2 | t1): a chi-square test over the pairs (expected count >= 5; the rest in one
    cell). Catches a sampler whose reported logprobs are right but whose draws are biased (noise, seeds, steps)."""
    n = 6000
    eng, model, tok = _engine(model_dir, device, max_batch_size=64)
    prompt = tok.encode("reverse me please")
    sp = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    reqs = []
    for i in range(n):
        s = SamplingParams(**{f: getattr(sp, f) for f in sp.__slots__})
        s.seed = 10_000 + i
        reqs.append(Request(prompt_ids=prompt, sampling=s, request_id=i))
    outs = eng.generate(reqs)
    V = model.config.vocab_size
    with torch.no_grad():
        ids = torch.tensor(prompt, device=device)
        p1_V = torch.softmax(model(ids[None]).logits[0, -1].double(), -1)
        both_VL = torch.cat([ids.expand(V, len(prompt)), torch.arange(V, device=device)[:, None]], 1)
        p2_VV = torch.softmax(model(both_VL).logits[:, -1].double(), -1)
    joint = (p1_V[:, None] * p2_VV).flatten().cpu()
    counts = torch.zeros(V * V, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[0] * V + o.token_ids[1]] += 1
    expected = joint * n
    big = expected >= 5
    assert big.sum() >= 10, "too flat a model for the test"
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    crit = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3  # Wilson-Hilferty, p = 0.001
    assert chi2 < crit, (chi2, crit, df)


def test_warmup_runs_every_decode_bucket_and_changes_no_output(model_dir, device):
    # max_model_len 512: length buckets 256 and 512; rows 1, 2, 4
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    cold, _, tok = _engine(model_dir, device, max_batch_size=4, max_model_len=512)
    want = cold.generate(_reqs(tok, sp, seed0=5))
    warm, _, _ = _engine(model_dir, device, max_batch_size=4, max_model_len=512)
    ks = (1, warm.decode_steps) if warm.decode_steps > 1 else (1,)  # CUDA graphs: launches of 1 and 4 steps
    assert warm.warmup(max_len=100) == 3 * len(ks)  # the 256 bucket only
    assert warm.warmup() == 6 * len(ks)
    if warm.use_graphs:
        assert set(warm._graphs) == {(nb, kv, False, False, k) for nb in (1, 2, 4) for kv in (256, 512) for k in ks}
    assert warm.num_prefill_tokens == 0 and warm.num_generated_tokens == 0
    got = warm.generate(_reqs(tok, sp, seed0=5))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-6)
    warm.add_request(_reqs(tok, sp, seed0=5)[0])
    with pytest.raises(ValueError, match="in flight"):
        warm.warmup()


@pytest.mark.parametrize("sampler", ["triton", "triton_lm_head"])
def test_triton_sampler_draws_the_torch_samplers_tokens(model_dir, device, sampler):
    # plain sampling through kernels/gumbel_sample (CPU: the Triton interpreter; "triton_lm_head": decode steps compute the
    # LM head inside the sampling kernel); a greedy request and a top-p one (which falls back to torch)
    reqs = lambda tok: _reqs(tok, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True), seed0=3)  # noqa: E731
    want_eng, _, tok = _engine(model_dir, device, max_batch_size=4, sampler="torch")
    got_eng, _, _ = _engine(model_dir, device, max_batch_size=4, sampler=sampler)
    for make in (reqs, lambda t: _reqs(t, SamplingParams(temperature=0, max_tokens=6), seed0=3)):
        want, got = want_eng.generate(make(tok)), got_eng.generate(make(tok))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)
    topp = _reqs(tok, SamplingParams(temperature=1.0, top_p=0.8, max_tokens=6), seed0=3)
    assert [o.token_ids for o in got_eng.generate(topp)] == [o.token_ids for o in want_eng.generate(topp)]


def test_padded_prefill_matches_the_unpadded_one(model_dir, device):
    """What a captured prefill graph runs (``graphs.pad_prefill``: rows repeated from row 0, ids right-padded to a
    length bucket): the real rows' logits and their slots' K/V at real positions equal an unpadded prefill's, and
    slots outside the batch are not written."""
    from prime_spmd.inference.graphs import pad_prefill

    eng, _, tok = _engine(model_dir, device, max_batch_size=4)
    prompts = [tok.encode(t) for t in TEXTS[:3]]
    t = max(len(p) for p in prompts)
    ids = torch.zeros(3, t, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    slots, last = [2, 0, 3], [len(p) - 1 for p in prompts]
    cache = eng.runner.cache
    dev = eng.device
    want = eng.runner.prefill(ids.to(dev), torch.tensor(slots, device=dev), torch.tensor(last, device=dev))
    want_k = cache.k.clone()
    cache.k.fill_(7.0)
    padded = pad_prefill(ids, slots, last, rows=4, length=32)
    assert padded[0].shape == (4, 32) and padded[1].tolist() == [2, 0, 3, 2] and padded[2].tolist() == last + last[:1]
    got = eng.runner.prefill(*(x.to(dev) for x in padded))
    assert torch.allclose(got[:3], want, atol=1e-5, rtol=1e-5)
    for s, p in zip(slots, prompts):
        assert torch.allclose(cache.k[:, s, :, : len(p)], want_k[:, s, :, : len(p)], atol=1e-5)
    assert bool((cache.k[:, 1] == 7.0).all())  # slot 1 was not in the batch
    with pytest.raises(ValueError, match="does not fit 2 x 32"):
        pad_prefill(ids, slots, last, rows=2, length=32)


def test_step_helpers_match_the_eager_ops(model_dir, device):
    """What the engine compiles on CUDA, checked here compiled on this device: the decode-state update (in place,
    on views of the engine's buffers, rows past nb untouched) and the fused runner's final norm (its weight and eps
    taken from the model: eager, bit-equal to the model's own norm)."""
    from prime_spmd.inference.native import advance_decode_state
    from prime_spmd.inference.runner import compile_exact
    from prime_spmd.models.common.norm import rms_norm

    def buffers():
        g = torch.Generator().manual_seed(0)
        ids, pos, steps = (torch.randint(0, 60, (8,), generator=g).to(device) for _ in range(3))
        out = torch.zeros(2, 8, dtype=torch.float64, device=device)
        return ids, pos, steps, out

    tokens = torch.tensor([5, 7, 9], device=device)
    logprobs = torch.tensor([-0.5, -1.25, -3.0], device=device)
    want, got = buffers(), buffers()
    advance_decode_state(*(t[:3] for t in want[:3]), want[3][:, :3], tokens, logprobs, 63)
    compiled = torch.compile(advance_decode_state)
    compiled(*(t[:3] for t in got[:3]), got[3][:, :3], tokens, logprobs, 63)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert want[0][:3].tolist() == [5, 7, 9] and want[3][1, :3].tolist() == [-0.5, -1.25, -3.0]
    before = buffers()
    assert want[1][:3].tolist() == (before[1][:3] + 1).clamp(max=63).tolist()  # positions advance, inside the cache
    assert want[2][:3].tolist() == (before[2][:3] + 1).tolist() and want[3][0, :3].tolist() == [5.0, 7.0, 9.0]
    assert torch.equal(want[1][3:], buffers()[1][3:])  # rows past nb untouched

    eng, model, _ = _engine(model_dir, device)
    x = torch.randn(3, model.config.hidden_size, device=device)
    if eng.runner.layer_args is not None:
        assert torch.equal(rms_norm(x, *eng.runner.final_norm_args), model.model.norm(x))
        assert torch.allclose(compile_exact(rms_norm)(x, *eng.runner.final_norm_args), model.model.norm(x), atol=1e-6)
    # bf16: compiled as the engine compiles, the norm rounds where HF's eager one does (plain torch.compile keeps the
    # cast's intermediate in fp32: ~1 of 4 outputs an ulp off)
    g = torch.Generator().manual_seed(1)
    xb = (torch.randn(64, 1024, generator=g) * 3).to(device, torch.bfloat16)
    wb = (torch.randn(1024, generator=g) * 0.3 + 1).to(device, torch.bfloat16)
    assert torch.equal(compile_exact(rms_norm)(xb, wb, 1e-6), rms_norm(xb, wb, 1e-6))


@pytest.mark.parametrize("kv_cache", ["slot", "paged"])
def test_released_kv_cache_comes_back_for_the_next_generation(model_dir, device, kv_cache):
    """release_memory (colocated: while the trainer steps) drops the KV cache and the graphs holding its addresses;
    the next generation allocates it anew and samples what an engine that never released it samples."""
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    eng, _, tok = _engine(model_dir, device, max_batch_size=4, kv_cache=kv_cache)
    ref, _, _ = _engine(model_dir, device, max_batch_size=4, kv_cache=kv_cache)
    pools = []
    for seed in (3, 4):
        want = ref.generate(_reqs(tok, sp, seed0=seed))
        got = eng.generate(_reqs(tok, sp, seed0=seed))
        pools.append(eng._graph_pool._pool)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for a, b in zip(got, want):  # CUDA: recaptured graphs; measured 2.4e-6 (H200, 2026-12-06)
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=LOGPROB_ATOL[device.type])
        cache = eng.runner.cache
        kv_bytes = 2 * cache.k.numel() * cache.k.element_size()
        assert eng.release_memory() == kv_bytes > 0
        assert cache.k is None and eng.release_memory() == 0  # released once
    if device.type == "cuda":  # graphs recaptured after a release go to a new pool (GraphPool.new_pool)
        assert None not in pools and pools[0] != pools[1]


def test_warmup_varies_the_length_before_the_rows(model_dir, monkeypatch) -> None:
    """The warm-up runs every length bucket of one row bucket before the next row bucket: the compiled decode layer
    (automatic dynamic shapes) then sees the length change first and compiles each row range once, with the length
    dynamic (5 graphs where lengths-outer compiled 8 on the H100)."""
    eng, _, _ = _engine(model_dir, torch.device("cpu"), max_batch_size=4, max_model_len=1024)
    assert len(eng.batch_buckets) > 1 and len(eng.len_buckets) > 1
    seen = []
    monkeypatch.setattr(eng, "_decode_step", lambda *key: seen.append(key))
    eng.warmup()
    single = [(nb, kv) for nb, kv, _, _, steps in seen if steps == 1]
    assert single == [(nb, kv) for nb in eng.batch_buckets for kv in eng.len_buckets]
    assert single[0][0] == single[1][0] and single[0][1] != single[1][1]


def test_steps_run_without_autograd_even_when_the_caller_has_grad_on(model_dir, device):
    """The engine's weights are parameters that require grad (as loaded); a step run with grad mode on (a new thread,
    the async driver) must still build no autograd graph: at 667582b the LM-head sampler's logprobs required grad
    there, the output buffer took a grad_fn, and the compiled state update recompiled on its requires_grad."""
    eng, model, tok = _engine(model_dir, device)
    assert any(p.requires_grad for p in model.parameters())
    seen, advance = [], eng._advance
    eng._advance = lambda *a: seen.append(torch.is_grad_enabled()) or advance(*a)
    with torch.enable_grad():
        eng.generate(_reqs(tok, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)))
    assert seen and not any(seen) and not eng._out.requires_grad


@pytest.mark.parametrize("warmup", ["off", "on"])
def test_engine_warmup_flag_runs_every_bucket_only_when_on(model_dir, monkeypatch, warmup) -> None:
    """--inference.native.warmup: off (the default) builds the engine with nothing run; on runs the warm-up (every
    decode bucket) in ``build_engine``."""
    from prime_spmd.config.sections import InferenceConfig, ModelConfig
    from prime_spmd.inference import factory

    assert InferenceConfig().native.warmup == "off"
    calls = []
    monkeypatch.setattr(NativeEngine, "warmup", lambda self, *a: calls.append(self) or 0)
    icfg = InferenceConfig(max_batch_size=2)
    icfg.native.warmup = warmup
    eng = factory.build_engine(icfg, ModelConfig(path=str(model_dir)), torch.device("cpu"), 64)
    assert calls == ([eng] if warmup == "on" else [])


def test_graph_stats_count_captures_and_their_seconds(model_dir, monkeypatch) -> None:
    """``graph_stats`` (step metrics ``engine_graphs_captured`` / ``engine_capture_s``): zeros without graphs; each
    ``GraphPool.capture`` adds one graph and the seconds it took (the capture itself stood in for: CPU)."""
    import time

    from prime_spmd.inference.graphs import GraphPool

    eng, _, _ = _engine(model_dir, torch.device("cpu"), max_batch_size=2)
    assert eng.graph_stats() == {"engine_graphs_captured": 0.0, "engine_capture_s": 0.0}
    monkeypatch.setattr(GraphPool, "_capture", lambda self, fn, warmups: time.sleep(0.01) or "graph")
    assert eng._graph_pool.capture(lambda: None, warmups=2) == "graph"
    eng._graph_pool.capture(lambda: None, warmups=2)
    stats = eng.graph_stats()
    assert stats["engine_graphs_captured"] == 2.0 and stats["engine_capture_s"] >= 0.02
