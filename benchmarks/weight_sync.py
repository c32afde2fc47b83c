"""Weight-sync benchmark: trainer (FSDP2 over T ranks) -> inference engines over the weight bridge.

Launch with torchrun; the first ``--trainer-ranks`` ranks train, the rest run one native engine
each (tp 1). With no inference ranks (``--trainer-ranks`` = world size) every rank is both and the
colocated in-process copy path (``WeightSender.copy_to``) is timed instead.

    # CPU / gloo
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/weight_sync.py \\
        --shape qwen3-0.6b --trainer-ranks 1 --bucket-mb 256 --iters 5 --out ws.json
    # CUDA / NCCL (NVLink multicast off: NVLS needs fabric/multicast support the lent machines may
    # not expose, and it changes the measured path)
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 benchmarks/weight_sync.py \\
        --shape qwen3-8b --trainer-ranks 1 --bucket-mb 256 --iters 10 --out ws.json

The model is built on the meta device and materialized directly into its FSDP shards (trainer) or
the engine's dtype (inference), filled with seeded random values: no checkpoint on disk. Timings
are medians over ``--iters`` after ``--warmup`` syncs; each sync starts after a barrier of every
rank involved, and on CUDA ends with ``torch.cuda.synchronize`` (NCCL work is asynchronous).
The reference bandwidth is a plain broadcast of one tensor of the same byte count over the same
bridge (disjoint) or one ``copy_`` of that many bytes (colocated). After timing, the engines'
weights are compared with the trainer's (float64 sums per parameter, exact on both sides).

``--lora-rank r`` (issue 20) adds LoRA adapters (alpha 2r, the 7 projections) before FSDP2: only
the adapters travel and each engine merges them into its copy of the base (weights.py), so the
timed sync includes the merge GEMMs. The weight comparison is skipped there (the engine holds merged
weights; tests/unit/test_lora.py and tests/distributed/test_lora_fsdp.py check the merge).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prime_spmd.config.sections import TopologyConfig  # noqa: E402
from prime_spmd.distributed.groups import init_distributed  # noqa: E402
from prime_spmd.distributed.topology import CONTROLLER_RANK  # noqa: E402
from prime_spmd.models.qwen3 import FLAVORS  # noqa: E402

# name -> Qwen3 config fields (HF names)
SHAPES: dict[str, dict] = {
    "tiny": dict(
        vocab_size=101,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    # the real shapes: one source of truth with the other benchmarks (model_type is not a config field)
    **{name: {k: v for k, v in FLAVORS[name].items() if k != "model_type"} for name in ("qwen3-0.6b", "qwen3-8b")},
}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--layers", type=int, default=0, help="override the layer count (0: the shape's own)")
    p.add_argument("--trainer-ranks", type=int, default=1, help="FSDP ranks; the rest are inference ranks")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="engine/wire dtype: auto is bfloat16 on CUDA, float32 on CPU (as --model.dtype)",
    )
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank: sync the adapters only (0: full weights)")
    p.add_argument("--no-check", action="store_true", help="skip the weight comparison after timing")
    p.add_argument("--out", default="", help="JSON file for the results (written by global rank 0)")
    return p.parse_args()


def _build_lm(fields: dict, device: torch.device, dtype: torch.dtype, meta: bool):
    from prime_spmd.models.qwen3.model import Qwen3Args, Qwen3ForCausalLM

    args = Qwen3Args.from_hf_config({**fields, "model_type": "qwen3"})
    with torch.device("meta"):
        lm = Qwen3ForCausalLM(args)
    if not meta:
        lm = lm.to_empty(device=device).to(dtype)
        lm.model.rotary_emb.reset_parameters()
    return lm


@torch.no_grad()
def _fill(lm, seed: int) -> None:
    """Seeded values in every (local) parameter; different on each rank, which is fine: only the
    trainer's values are ever compared, with what the engines received."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for p in lm.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.numel():
            src = torch.empty(local.shape, dtype=torch.float32).uniform_(-0.05, 0.05, generator=g)
            local.copy_(src)


def _sync_cuda(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    a = _args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n_inf = world - a.trainer_ranks
    assert n_inf >= 0, f"--trainer-ranks {a.trainer_ranks} > world size {world}"
    ctx = init_distributed(TopologyConfig(num_inference_ranks=n_inf, timeout_s=600))
    topo, device = ctx.topo, ctx.device
    from prime_spmd.models.loading import resolve_dtype

    wire = resolve_dtype(a.dtype, device)
    fields = dict(SHAPES[a.shape])
    if a.layers:
        fields["num_hidden_layers"] = a.layers
    bucket = a.bucket_mb << 20
    rank = topo.rank
    res: dict = {}
    t_build = time.perf_counter()

    sender = receiver = engine = None
    if topo.is_trainer:
        from prime_spmd.distributed.fsdp import parallelize
        from prime_spmd.distributed.mesh import build_trainer_mesh
        from prime_spmd.sync.weights import WeightSender
        from prime_spmd.trainer.policy import PolicyModel

        lm = _build_lm(fields, device, torch.float32, meta=True)
        if a.lora_rank:
            from prime_spmd.config.sections import LoraConfig
            from prime_spmd.models.lora import apply_lora

            apply_lora(lm, LoraConfig(rank=a.lora_rank, alpha=2.0 * a.lora_rank))
        policy = PolicyModel(lm, "reference")
        mesh = build_trainer_mesh(topo, device)
        parallelize(policy, policy.adapter.block_lists(), mesh, param_dtype=wire, activation_checkpointing=False)
        policy.to_empty(device=device)  # each rank allocates only its FSDP shard (fp32 master weights)
        lm.model.rotary_emb.reset_parameters()
        _fill(lm, seed=1234 + topo.trainer_rank)
        sender = WeightSender(lm, wire, bucket, rank)
    if topo.is_inference:
        from prime_spmd.inference.native import NativeEngine
        from prime_spmd.models.tiny import build_char_tokenizer

        elm = _build_lm(fields, device, wire, meta=False)
        if a.lora_rank:
            _fill(elm, seed=99)  # the base the adapters are merged into
        engine = NativeEngine(
            elm,
            build_char_tokenizer(),
            max_batch_size=1,
            max_model_len=64,
            device=device,
            cuda_graphs=False,
            compile_sampler=False,
        )
    bridge = ctx.weight_bridge
    if topo.mode == "disjoint":
        from prime_spmd.sync.weights import WeightReceiver

        if rank == CONTROLLER_RANK:
            bridge.broadcast_object(sender.spec, src=CONTROLLER_RANK, device=device)
        elif topo.is_inference:
            spec = bridge.broadcast_object(None, src=CONTROLLER_RANK, device=device)
            receiver = WeightReceiver(spec, bucket, engine, device)
    spec = sender.spec if sender is not None else receiver.spec
    numel = sum(int(torch.Size(s).numel()) for s in spec.shapes)
    nbytes = numel * torch.empty((), dtype=spec.dtype).element_size()
    t_build = time.perf_counter() - t_build

    tick = torch.zeros(1, device=device)

    def barrier() -> None:
        # every rank involved in a sync: the trainer role (its all-gathers) and the bridge members
        if topo.is_trainer:
            dist.barrier()
        if bridge is not None:
            bridge.broadcast(tick, src=CONTROLLER_RANK)
        _sync_cuda(device)

    times: list[float] = []
    inner: list[float] = []
    for it in range(a.warmup + a.iters):
        barrier()
        t0 = time.perf_counter()
        if topo.mode == "colocated":
            dt = sender.copy_to(engine, version=it)
        elif topo.is_trainer:
            dt = sum(sender.send(bridge, device, version=it))
        else:
            dt = receiver.recv(bridge)
        _sync_cuda(device)
        if it >= a.warmup:
            times.append(time.perf_counter() - t0)
            inner.append(dt)

    # Raw reference: one tensor of the same byte count, same backend, same members.
    raw: list[float] = []
    if topo.mode == "disjoint" and bridge is not None:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for it in range(a.warmup + a.iters):
            bridge.broadcast(tick, src=CONTROLLER_RANK)
            _sync_cuda(device)
            t0 = time.perf_counter()
            bridge.broadcast(buf, src=CONTROLLER_RANK)
            _sync_cuda(device)
            if it >= a.warmup:
                raw.append(time.perf_counter() - t0)
        del buf
    elif topo.mode == "colocated":
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        for it in range(a.warmup + a.iters):
            _sync_cuda(device)
            t0 = time.perf_counter()
            dst.copy_(src)
            _sync_cuda(device)
            if it >= a.warmup:
                raw.append(time.perf_counter() - t0)
        del src, dst

    # Check: the engines hold exactly the trainer's weights (cast to the wire dtype).
    check = None
    if not a.no_check and not a.lora_rank:
        sums = None
        if topo.is_trainer:
            from prime_spmd.sync.weights import hf_named_parameters

            sums = []
            for _, p in hf_named_parameters(sender.lm):
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                sums.append(full.detach().to(spec.dtype).double().sum().item())
        if topo.mode == "colocated":
            params = dict(engine.model.named_parameters())
            got = [params[n].detach().double().sum().item() for n in spec.names]
            check = got == sums
        elif bridge is not None:
            sums = bridge.broadcast_object(sums, src=CONTROLLER_RANK, device=device)
            if topo.is_inference:
                params = dict(engine.model.named_parameters())
                got = [params[n].detach().double().sum().item() for n in spec.names]
                check = got == sums

    mine = dict(
        rank=rank,
        role="trainer+inference" if topo.mode == "colocated" else ("trainer" if topo.is_trainer else "inference"),
        sync_s=_median(times),
        inner_s=_median(inner),
        raw_s=_median(raw),
        check=check,
        build_s=t_build,
        rss_gb=_rss_gb(),
    )
    # Gather every rank's numbers at global rank 0 through the store (roles have separate groups).
    ctx.store.set(f"ws/{rank}", json.dumps(mine))
    if rank == 0:
        ranks = [json.loads(ctx.store.get(f"ws/{r}")) for r in range(world)]
        sync_s = max(r["sync_s"] for r in ranks)  # a sync is done when the slowest member is done
        raw_s = max((r["raw_s"] for r in ranks if r["raw_s"] == r["raw_s"]), default=float("nan"))
        checks = [r["check"] for r in ranks if r["check"] is not None]
        res = dict(
            shape=a.shape,
            layers=fields["num_hidden_layers"],
            lora_rank=a.lora_rank,
            mode=topo.mode,
            world=world,
            trainer_ranks=a.trainer_ranks,
            inference_ranks=n_inf,
            backend=ctx.backend,
            device=device.type,
            wire_dtype=str(spec.dtype).removeprefix("torch."),
            bucket_mb=a.bucket_mb,
            buckets=len(sender.buckets),
            params=len(spec.names),
            numel=numel,
            bytes=nbytes,
            iters=a.iters,
            sync_s=sync_s,
            sync_gb_s=nbytes / sync_s / 1e9,
            raw_s=raw_s,
            raw_gb_s=nbytes / raw_s / 1e9,
            ratio_of_raw=(nbytes / sync_s) / (nbytes / raw_s),
            check_ok=all(checks) if checks else None,
            per_rank=ranks,
            torch=torch.__version__,
            host=platform.node(),
            cpu_threads=torch.get_num_threads(),
            gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            env={k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NCCL_NVLS_ENABLE") if k in os.environ},
            date=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        print(json.dumps({k: v for k, v in res.items() if k != "per_rank"}, indent=1))
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        ctx.store.set("ws/done", "1")
    else:
        ctx.store.wait(["ws/done"])
    ctx.close()


def _rss_gb() -> float:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
    except Exception:
        return float("nan")


if __name__ == "__main__":
    main()
