"""--trainer.compile: after the first step, RL- and SFT-shaped steps never recompile the trainer's blocks.

Real runs change every micro-batch's shape: rows of shared prompts (one row or several), rows of one document
(RowLayout), a packed row under a mask, a single document, a rank's dummy micro-batch. Each used to be its own
graph, compiled in whatever step first met it (7-9 s on the H100; /work/notes/recompile-log.md). The CPU runs
dynamo + AOT autograd (aot_eager); inductor's CUDA-only guard (SDPA bias alignment) is covered by the padding
check below."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from prime_spmd.config.rl_sections import LossConfig
from prime_spmd.data.sample import Sample
from prime_spmd.distributed.fsdp import compile_block_forwards
from prime_spmd.models.qwen3.model import Qwen3Args, Qwen3ForCausalLM
from prime_spmd.rl.loss import make_rl_loss
from prime_spmd.trainer.packing import pack
from prime_spmd.trainer.policy import COMPILED_ROW_MULTIPLE, PolicyModel
from prime_spmd.trainer.step import train_step

VOCAB = 96


def _policy() -> PolicyModel:
    args = Qwen3Args(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = Qwen3ForCausalLM(args)
    lm.init_weights(std=0.2, seed=0)
    return PolicyModel(lm)


def _samples(rng: random.Random, groups: int, group_size: int, solo: int = 0, max_completion: int = 12) -> list[Sample]:
    """GRPO groups (a shared prompt of 5-9 tokens, 3..max_completion trained tokens) and ``solo`` samples with a
    prompt of their own (SFT-like: nothing to share)."""
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 9))]
        for _ in range(group_size):
            n = rng.randint(3, max_completion)
            ids = prompt + [rng.randrange(VOCAB) for _ in range(n)]
            adv = rng.uniform(-1, 1)
            lps = [0.0] * len(prompt) + [-rng.uniform(0.1, 3.0) for _ in range(n)]
            out.append(Sample(input_ids=ids, loss_mask=[0] * len(prompt) + [1] * n, fields=_fields(ids, adv, lps)))
    for _ in range(solo):
        ids = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 30))]
        out.append(Sample(input_ids=ids, loss_mask=[0] * 3 + [1] * (len(ids) - 3), fields=_fields(ids, 0.5)))
    return out


def _fields(ids: list[int], adv: float, lps: list[float] | None = None) -> dict[str, list[float]]:
    return {"advantages": [adv] * len(ids), "inference_logprobs": lps or [-1.0] * len(ids)}


def _steps() -> list[tuple[list[Sample], int, int]]:
    """(samples, micro_batch_tokens, ranks: the last rank's micro-batches are trained) of 8 steps; the first has
    only shared-prompt rows, so every other kind first shows up later."""
    rng = random.Random(0)
    return [
        (_samples(rng, 4, 4), 256, 1),  # rows of shared prompts (R >= 2)
        (_samples(rng, 3, 4, max_completion=20), 256, 1),  # other lengths
        (_samples(rng, 1, 4), 256, 1),  # one group: one row under a mask
        (_samples(rng, 0, 0, solo=5), 256, 1),  # nothing shared: RowLayout rows, no mask
        (_samples(rng, 0, 0, solo=1), 256, 1),  # one document: a [1, P] causal row
        (_samples(rng, 0, 0, solo=1), 256, 2),  # the second rank: a dummy micro-batch
        (_samples(rng, 2, 4, solo=3), 40, 1),  # many micro-batches, the last one smaller
        ([Sample(input_ids=list(range(30)), loss_mask=[0] + [1] * 29, fields=_fields(list(range(30)), 1.0))]
         + [Sample(input_ids=[7, 8], loss_mask=[0, 1], fields=_fields([7, 8], 1.0)) for _ in range(3)], 256, 1),
        # one long and 3 two-token documents: too uneven for RowLayout, a packed row under a block mask
    ]  # fmt: skip


def test_compiled_trainer_compiles_in_the_first_step_only() -> None:
    torch._dynamo.reset()
    policy = _policy()
    eager = copy.deepcopy(policy)
    compile_block_forwards(policy.lm.blocks(), backend="aot_eager")
    seen: list[tuple[int, int, bool]] = []  # (rows, tokens, masked) of each model call
    routed = policy.adapter.forward_hidden_routed

    def spy(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None = None):
        seen.append((*ids.shape, mask is not None or bool((pos[:, 1:] != pos[:, :-1] + 1).any())))
        return routed(ids, pos, mask)

    policy.adapter.forward_hidden_routed = spy
    loss_fn = make_rl_loss(LossConfig())
    opts = {}
    for name, p in (("compiled", policy), ("eager", eager)):
        opt = torch.optim.SGD(p.parameters(), lr=1e-2)
        opts[name] = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    counters = torch._dynamo.utils.counters
    counters.clear()
    graphs_after_first = None
    for i, (samples, budget, ranks) in enumerate(_steps()):
        micro_batches = pack(samples, budget, ranks, share_prompts=True)[-1]
        stats = train_step(policy, *opts["compiled"], micro_batches, loss_fn, device=torch.device("cpu"))
        if i == 0:
            graphs_after_first = counters["stats"]["unique_graphs"]
            # the warm-up left no gradient behind: the first update equals the eager model's
            ref = train_step(eager, *opts["eager"], micro_batches, loss_fn, device=torch.device("cpu"))
            assert stats["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6)
            assert stats["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
            for (n, a), b in zip(policy.named_parameters(), eager.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=n)
        assert counters["stats"]["unique_graphs"] == graphs_after_first, (i, dict(counters["stats"]))
    # causal rows and masked ones, one row or several (dynamo specializes a size of 1): 4 graphs, all in step 0
    assert graphs_after_first == 4, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    # every masked row the compiled blocks saw has a multiple of 8 tokens (inductor's SDPA bias alignment guard)
    masked = [(b, t) for b, t, m in seen if m]
    assert masked and all(t % COMPILED_ROW_MULTIPLE == 0 for _, t in masked), masked
    # and every unmasked one (RowLayout rows, one document): the guard stands on x_BTD.size(1) too (SFT on the H100)
    assert all(t % COMPILED_ROW_MULTIPLE == 0 for _, t, _m in seen), seen
    assert {b for b, _ in masked} > {1} and {b for b, _, m in seen if not m} > {1}  # one row and several


def test_blocks_compile_without_size_guarded_fusion(monkeypatch):
    """Inductor's strict mix-order reduction (a norm backward's two reductions fused only above a size) guards on
    the micro-batch's token count: on the H100 every micro-batch of >= 5,120 tokens recompiled the blocks that the
    step-0 warm-up had compiled on tiny rows. The blocks compile in non-strict mode (no size guard) where torch
    has it. CUDA-only lowering: checked here by the options each block's torch.compile receives."""
    from torch._inductor import config

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    policy = _policy()
    blocks = list(policy.lm.model.layers)
    compile_block_forwards(blocks, "inductor")
    assert len(seen) == len(blocks)
    want = {"triton.mix_order_reduction_non_strict_mode": True}
    if hasattr(config.triton, "mix_order_reduction_non_strict_mode"):
        assert all(kw["options"] == want and kw["dynamic"] for kw in seen)
    compile_block_forwards(_policy().lm.model.layers, "aot_eager")
    assert seen[-1]["options"] is None  # other backends take no inductor options


def test_compile_warmup_off_compiles_only_the_kinds_a_run_meets(monkeypatch) -> None:
    """--trainer.compile_warmup off: the first step compiles only the input kinds its micro-batches have (here one:
    rows of shared prompts, against 4 with the warm-up); a later step with a new kind compiles it then (RowLayout
    rows: documents filled several to a row would run under a mask, the kind already met)."""
    from prime_spmd.trainer import policy as policy_mod

    monkeypatch.setattr(policy_mod, "FILL_TOKENS_RATIO", 0.0)
    torch._dynamo.reset()
    lm = _policy().lm
    policy = PolicyModel(lm, compile_warmup=False)
    compile_block_forwards(policy.lm.blocks(), backend="aot_eager")
    loss_fn = make_rl_loss(LossConfig())
    opt = torch.optim.SGD(policy.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    counters = torch._dynamo.utils.counters
    counters.clear()
    steps = _steps()
    for samples, budget, ranks in steps[:2]:  # rows of shared prompts only
        train_step(policy, opt, sched, pack(samples, budget, ranks, share_prompts=True)[-1], loss_fn,
                   device=torch.device("cpu"))  # fmt: skip
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    samples, budget, ranks = steps[3]  # nothing shared: RowLayout rows, a kind not met before
    train_step(policy, opt, sched, pack(samples, budget, ranks, share_prompts=True)[-1], loss_fn,
               device=torch.device("cpu"))  # fmt: skip
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


@pytest.mark.parametrize("warmup", [False, True])
def test_compile_warmup_flag_reaches_the_policy_through_build_trainer(tmp_path, warmup) -> None:
    """--trainer.compile_warmup from the job config through ``build_trainer`` to ``PolicyModel``: on, the first step
    still has the warm-up to run; off (the default), there is none to run."""
    from dataclasses import replace

    from prime_spmd.config.sections import ModelConfig
    from prime_spmd.distributed.groups import init_distributed
    from prime_spmd.models.tiny import build_tiny_model
    from prime_spmd.trainer.build import build_trainer
    from tests.jobs import tiny_rl_cfg

    model = build_tiny_model(tmp_path / "m", preset="qwen3-nano")
    cfg = tiny_rl_cfg(tmp_path / "out", ModelConfig(path=str(model), impl="custom"), steps=1, lr=1e-3,
                      max_async=0, num_inference=0)  # fmt: skip
    cfg = replace(cfg, trainer=replace(cfg.trainer, compile_warmup=warmup))
    ctx = init_distributed(cfg.topology)
    try:
        parts = build_trainer(cfg.model, cfg.trainer, cfg.optim, ctx)
        assert parts.policy._warmed_up is (not warmup)
    finally:
        ctx.close()
