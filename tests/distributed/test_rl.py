"""The RL job across real gloo processes: weight sync bitwise, the async schedule for k = 0, 1, 2,
and exact resume (controller rollout buffer, data position, RNG) in disjoint mode."""

from __future__ import annotations

from pathlib import Path

import torch

from prime_spmd.config.job import RLJobConfig
from prime_spmd.config.sections import ModelConfig
from tests.dist_utils import run_ranks
from tests.jobs import TIMING_KEYS, copy_for_resume, read_metrics, rl_rank, tiny_rl_cfg


def _cfg(out: Path, model: Path, *, k: int, steps: int, num_inference: int, resume: bool = False) -> RLJobConfig:
    model_cfg = ModelConfig(path=str(model))
    return tiny_rl_cfg(
        out, model_cfg, steps=steps, lr=1e-3, max_async=k, num_inference=num_inference, resume=resume, keep_last=3
    )


def _tiny(tmp: Path) -> Path:
    from prime_spmd.models.tiny import build_tiny_model

    return build_tiny_model(tmp / "base", "qwen3-nano", seed=0, initializer_range=0.3)


def test_schedule_lags_for_k_0_1_2_and_exact_resume(tmp_path: Path) -> None:
    model = _tiny(tmp_path)
    for k in (0, 1, 2):
        out = tmp_path / f"k{k}"
        run_ranks(rl_rank, 3, _cfg(out, model, k=k, steps=5, num_inference=1))  # 2 trainer ranks + 1 inference rank
        m = read_metrics(out)
        assert [r["step"] for r in m] == list(range(5))
        assert [r["policy_lag_mean"] for r in m] == [float(min(j, k)) for j in range(5)], k
        assert all(r["policy_lag_max"] == r["policy_lag_mean"] for r in m)
        # Trainer and engine hold the same weights when the batch is on-policy (step 0, and every step
        # at k = 0): fp32 on CPU, only the summation order differs. Measured max 0.0 (2026-12-02).
        on_policy = [r["mismatch_kl"] for r in m if r["policy_lag_mean"] == 0]
        assert on_policy and max(on_policy) < 1e-9, on_policy
        assert all(r["mismatch_kl"] > 0 for r in m if r["policy_lag_mean"] > 0)  # stale weights do show
        assert (out / "hf" / "config.json").is_file()
    # Resume the k=2 run from its step-2 checkpoint in a fresh directory: steps 2..4 must repeat exactly.
    ref = read_metrics(tmp_path / "k2")
    res = tmp_path / "resumed"
    copy_for_resume(tmp_path / "k2", res, 2)
    run_ranks(rl_rank, 3, _cfg(res, model, k=2, steps=5, num_inference=1, resume=True))
    got = read_metrics(res)
    assert [r["step"] for r in got] == list(range(5))
    for a, b in zip(ref[2:], got[2:]):
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == {
            k: v for k, v in b.items() if k not in TIMING_KEYS
        }


def _sync(rank: int, world: int, cfg: RLJobConfig) -> dict[str, torch.Tensor] | None:
    """Build trainer/engines, change the trainer's weights with one SFT-style step, sync, return weights."""
    from prime_spmd.distributed.groups import init_distributed
    from prime_spmd.distributed.topology import CONTROLLER_RANK
    from prime_spmd.inference.factory import build_engine
    from prime_spmd.sync.weights import WeightReceiver, WeightSender
    from prime_spmd.trainer.build import build_trainer, strip_prefix
    from prime_spmd.trainer.checkpoint import full_state_dict
    from prime_spmd.trainer.packing import Sample, pack
    from prime_spmd.trainer.sft import sft_loss
    from prime_spmd.trainer.step import train_step

    ctx = init_distributed(cfg.topology)
    topo = ctx.topo
    engine = build_engine(cfg.inference, cfg.model, ctx.device, 64) if topo.is_inference else None
    out = None
    bucket = cfg.inference.weight_bucket_mb << 20
    if topo.is_trainer:
        parts = build_trainer(cfg.model, cfg.trainer, cfg.optim, ctx)
        samples = [Sample(input_ids=list(range(5, 25)), loss_mask=[1] * 20)] * 4
        mbs = pack(samples, 64, topo.num_trainer_ranks)[topo.trainer_rank]
        train_step(parts.policy, parts.optimizer, parts.scheduler, mbs, sft_loss, device=ctx.device)
        sender = WeightSender(parts.policy.lm, torch.float32, bucket, topo.rank)
        if topo.mode == "colocated":
            sender.copy_to(engine, version=1)
        else:
            if topo.is_controller:
                ctx.weight_bridge.broadcast_object(sender.spec, src=CONTROLLER_RANK, device=ctx.device)
            sender.send(ctx.weight_bridge, ctx.device, version=1)
        sd = strip_prefix(full_state_dict(parts.policy))
        if topo.is_controller:
            out = {"trainer": sd}
    if topo.is_inference:
        if topo.mode == "disjoint":
            spec = ctx.weight_bridge.broadcast_object(None, src=CONTROLLER_RANK, device=ctx.device)
            WeightReceiver(spec, bucket, engine, ctx.device).recv(ctx.weight_bridge)
        assert engine.weights_version == 1, engine.weights_version
        eng = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        out = {**(out or {}), "engine": eng}
    ctx.close()
    return out


def test_weight_sync_is_bitwise_disjoint_and_colocated(tmp_path: Path) -> None:
    model = _tiny(tmp_path)
    disjoint = run_ranks(_sync, 4, _cfg(tmp_path / "d", model, k=1, steps=1, num_inference=2))
    colocated = run_ranks(_sync, 2, _cfg(tmp_path / "c", model, k=1, steps=1, num_inference=0))
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model).state_dict()
    for trainer_sd, engines in (
        (disjoint[0]["trainer"], [disjoint[2], disjoint[3]]),
        (colocated[0]["trainer"], colocated),
    ):
        assert not torch.equal(trainer_sd["model.norm.weight"], initial["model.norm.weight"])  # the step changed it
        for e in engines:
            eng = e["engine"]
            for name, t in trainer_sd.items():
                key = name if name in eng else name.replace("lm_head.weight", "model.embed_tokens.weight")
                assert torch.equal(eng[key], t), name
