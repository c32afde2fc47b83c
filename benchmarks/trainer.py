"""Benchmark a full training step (forward, loss, backward, AdamW) on fake data: tokens/s and MFU.

GPU (H200, bf16):
    python benchmarks/trainer.py --flavor qwen3-0.6b --impls custom,hf --out benchmarks/results/trainer_dense.json
    python benchmarks/trainer.py --flavor qwen3-moe-8l --impls custom,hf --out benchmarks/results/trainer_moe.json
CPU smoke check:   python benchmarks/trainer.py --device cpu --small
LoRA vs full (issue 20; H200 numbers in docs/benchmarks.md):
    python benchmarks/trainer.py --flavor qwen3-0.6b --impls custom --lora_rank 0,16 --out benchmarks/results/trainer_lora.json

Models are random-init from the flavor's HF config (prime_spmd/models/qwen3/__init__.py FLAVORS):
``custom`` is our Qwen3ForCausalLM (MoE experts: --moe_impl), ``hf`` is transformers' model with sdpa.
Both run final hidden states (the model family's adapter, prime_spmd/models/adapter.py), then the LM-head logprob kernel
(kernels/lm_logprob ``lm_head_logprobs``, impl triton on GPU, reference on CPU) and loss = -mean logprob,
on one device without FSDP. This is not the trainer's own step: PolicyModel (trainer/policy.py) wraps the
LM as an FSDP root and on CUDA uses the loss-fused kernel (``fused_lm_head_loss``) with the RL/SFT loss.
Params and compute in bf16 on GPU, AdamW (fused on CUDA), one sequence of --tokens tokens
(--doc_len packs it into documents). MFU = model FLOPs / step time / --peak_tflops, with
model FLOPs per token = 6 * (active matmul params incl. LM head) + 6 * L * 2 * N * Dh * S_eff
(causal attention, S_eff = mean attended keys per token); the measured 8192^3 matmul ceiling is
reported beside it. ``--lora_rank r`` (r > 0) adds LoRA adapters (alpha = 2r, the 7 projections,
prime_spmd/models/lora.py) and trains only them; model FLOPs stay the full model's forward and
backward (the frozen base still needs activation grads; its weight-grad GEMMs are skipped, so MFU
is a lower bound there). Each row also reports the bytes one weight sync sends in bf16
(``sync_bytes``: every parameter, or the adapters only) and the trainable parameter count.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="tiny model and batch (CPU check)")
    p.add_argument("--flavor", default="qwen3-0.6b", help="qwen3-0.6b | qwen3-moe-8l | qwen3-30b-a3b")
    p.add_argument("--impls", default="custom,hf", help="comma-separated subset of custom,hf")
    p.add_argument("--moe_impl", default="triton", choices=["triton", "grouped_mm", "reference"])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (one packed row)")
    p.add_argument("--doc_len", type=int, default=0, help="pack documents of this length (0: one document)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (median reported) after 2 warmup steps")
    p.add_argument("--lora_rank", default="0", help="comma-separated LoRA ranks to run (0: full fine-tuning)")
    p.add_argument("--peak_tflops", type=float, default=989.0, help="bf16 dense peak for MFU (H200 SXM: 989)")
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    return p.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prime_spmd.kernels.lm_logprob.op import lm_head_logprobs  # noqa: E402

from benchmarks import common  # noqa: E402
from prime_spmd.config.sections import LoraConfig  # noqa: E402
from prime_spmd.models.lora import apply_lora  # noqa: E402
from prime_spmd.models.qwen3 import FLAVORS  # noqa: E402
from prime_spmd.models.qwen3.hf import build_model  # noqa: E402
from prime_spmd.models.qwen3.model import Qwen3Args, set_moe_impl  # noqa: E402
from prime_spmd.models.registry import adapter_for  # noqa: E402
from prime_spmd.sync.weights import build_spec  # noqa: E402

SMALL = dict(
    model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, rope_theta=1e4,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
)  # fmt: skip


def build(impl: str, cfg: dict, device: str, dtype: torch.dtype) -> torch.nn.Module:
    if impl == "custom":
        model = build_model(Qwen3Args.from_hf_config(cfg), device, dtype)
        model.init_weights()
        set_moe_impl(model, ARGS.moe_impl if device == "cuda" else "reference")
        return model
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**cfg)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation="sdpa")
    return model


def model_flops_per_token(cfg: dict, seq_tokens: int, doc_len: int) -> float:
    a = Qwen3Args.from_hf_config(cfg)
    D, L, H, Dh, Nkv = a.hidden_size, a.num_hidden_layers, a.num_attention_heads, a.head_dim, a.num_key_value_heads
    attn_params = D * (H + 2 * Nkv) * Dh + H * Dh * D
    mlp_params = 0
    for i in range(L):
        if a.is_moe_layer(i):
            mlp_params += 3 * D * a.moe_intermediate_size * a.num_experts_per_tok + D * a.num_experts
        else:
            mlp_params += 3 * D * a.intermediate_size
    params = L * attn_params + mlp_params + D * a.vocab_size
    doc = doc_len or seq_tokens
    s_eff = (doc + 1) / 2  # causal: a token attends to (position + 1) keys on average
    return 6 * params + 6 * L * 2 * H * Dh * s_eff


def step_fn(model, opt, ids, pos, targets, lm_impl):
    adapter = adapter_for(model)

    def step():
        h = adapter.forward_hidden(ids, pos)
        w = adapter.lm_head_weight()
        logp, _ = lm_head_logprobs(h.flatten(0, 1), w, targets, impl=lm_impl, return_entropy=False)
        loss = -logp.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def main() -> None:
    device = ARGS.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = SMALL if ARGS.small else FLAVORS[ARGS.flavor]
    T = 64 if ARGS.small else ARGS.tokens
    doc_len = 16 if ARGS.small and not ARGS.doc_len else ARGS.doc_len
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (1, T + 1), generator=gen).to(device)
    inputs, targets = ids[:, :-1], ids[0, 1:]
    pos = (torch.arange(T) % doc_len if doc_len else torch.arange(T))[None].to(device)
    ceiling = common.matmul_ceiling_tflops(device, dtype, 10, warmup=2)
    flops = model_flops_per_token(cfg, T, doc_len) * T
    lm_impl = "triton" if device == "cuda" else "reference"
    results = []
    runs = [(impl, int(r)) for impl in ARGS.impls.split(",") for r in ARGS.lora_rank.split(",")]
    for impl, lora_rank in runs:
        model = build(impl, cfg, device, dtype)
        if lora_rank:
            apply_lora(model, LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank))
        trainable = [p for p in model.parameters() if p.requires_grad]
        spec = build_spec(model, torch.bfloat16)
        sync_bytes = 2 * sum(torch.Size(s).numel() for s in spec.shapes)
        opt = torch.optim.AdamW(trainable, lr=1e-5, fused=device == "cuda")
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = common.time_ms(step_fn(model, opt, inputs, pos, targets, lm_impl), device, ARGS.steps, warmup=2)
        row = dict(
            impl=impl, flavor="small" if ARGS.small else ARGS.flavor, tokens=T, doc_len=doc_len, lora_rank=lora_rank,
            trainable_params=sum(p.numel() for p in trainable), sync_bytes=sync_bytes,
            moe_impl=ARGS.moe_impl if impl == "custom" else "hf", step_ms=ms, tokens_per_s=T / (ms * 1e-3),
            tflops=flops / (ms * 1e-3) / 1e12, mfu_pct=100 * flops / (ms * 1e-3) / 1e12 / ARGS.peak_tflops,
            pct_of_matmul_ceiling=100 * flops / (ms * 1e-3) / 1e12 / ceiling,
            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        )  # fmt: skip
        results.append(row)
        print(json.dumps(row))
        del model, opt
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"\nmatmul ceiling {ceiling:.0f} TFLOP/s; MFU vs {ARGS.peak_tflops:.0f} TFLOP/s peak")
    columns = ["impl", "flavor", "lora r", "tokens", "step ms", "tokens/s", "TFLOP/s", "MFU", "% of ceiling", "peak GiB",
               "sync MB"]  # fmt: skip
    table = [
        [f"{r['impl']} ({r['moe_impl']})", r["flavor"], r["lora_rank"] or "full", r["tokens"], f"{r['step_ms']:.1f}",
         f"{r['tokens_per_s']:.0f}",
         f"{r['tflops']:.1f}", f"{r['mfu_pct']:.1f}%", f"{r['pct_of_matmul_ceiling']:.1f}%",
         "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}", f"{r['sync_bytes'] / 1e6:.2f}"]
        for r in results
    ]  # fmt: skip
    common.print_markdown_table(columns, table)
    if ARGS.out:
        common.write_json(
            ARGS.out, dict(meta=common.run_metadata(device, matmul_ceiling_tflops=ceiling), results=results)
        )


if __name__ == "__main__":
    main()
