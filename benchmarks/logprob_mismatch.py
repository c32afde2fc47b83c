"""Trainer-vs-inference logprob mismatch of the native engine (the logprob contract, measured).

Samples completions with the native engine, then recomputes each sampled token's logprob the way
the trainer does: a teacher-forced forward of prompt + completion through ``PolicyModel``
(FSDP-free, same dtype policy: bf16 parameters on CUDA, fp32 logits/softmax), and reports
mean |d| and the mismatch KL mean(exp(d) - d - 1), d = trainer - inference, over all tokens.

    python benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16
    python benchmarks/logprob_mismatch.py --device cpu --model-shape tiny
    python benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --quantization fp8

``--quantization fp8``: the engine samples from FP8 layer weights (``--inference.quantization``); the trainer side stays
the bf16 model, so the KL includes the quantization error. ``--exact`` (``--model.exact``): our model code on both sides
and the batch-invariant kernels: max |diff| and the KL are 0.

    python benchmarks/logprob_mismatch.py --device cuda --model-shape qwen3-0.6b --dtype bfloat16 --exact
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "tiny": dict(preset="qwen3-1m", overrides={"initializer_range": 0.3}),
    "qwen3-0.6b": dict(
        preset="qwen3-1m",
        overrides=dict(
            hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, vocab_size=151936,
        ),
    ),
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--loss-impl", default="auto", choices=["auto", "reference", "triton"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--init-std", type=float, default=0.0, help="initializer_range of the random model (0: shape default)"
    )
    ap.add_argument("--decode-linear", default="auto", choices=["auto", "torch", "triton"], help="the engine's linears")
    ap.add_argument(
        "--sampler", default="auto", choices=["auto", "torch", "triton", "triton_lm_head"], help="the engine's sampler"
    )
    ap.add_argument(
        "--decode-attention",
        default="auto",
        choices=["auto", "bmm", "triton", "triton_qkv"],
        help="the engine's attention",
    )
    ap.add_argument("--kv-cache", default="slot", choices=["slot", "paged"], help="the engine's KV cache")
    ap.add_argument(
        "--prefill",
        default="auto",
        choices=["auto", "layer_fn", "modules"],
        help="the engine's prefill: one layer function (auto, the default: on CUDA) or the model's modules",
    )
    ap.add_argument(
        "--quantization",
        default="none",
        choices=["none", "fp8"],
        help="the engine's weights (--inference.quantization)",
    )
    ap.add_argument(
        "--exact", action="store_true", help="--model.exact: engine and trainer on the batch-invariant kernels"
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from prime_spmd.config.sections import ModelConfig
    from prime_spmd.inference.engine import Request, SamplingParams
    from prime_spmd.inference.native import NativeEngine
    from prime_spmd.inference.runner import prefill_choice
    from prime_spmd.models.loading import load_model, resolve_dtype
    from prime_spmd.models.tiny import build_char_tokenizer, build_tiny_model
    from prime_spmd.trainer.policy import PolicyModel

    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    shape = SHAPES[args.model_shape]
    if args.init_std:
        shape = {**shape, "overrides": {**shape["overrides"], "initializer_range": args.init_std}}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "m", shape["preset"], seed=0, **shape["overrides"])
        mcfg = ModelConfig(path=str(path), impl="custom" if args.exact else "hf")
        engine = NativeEngine(
            load_model(mcfg, device, dtype),
            build_char_tokenizer(),
            max_batch_size=args.requests,
            max_model_len=args.prompt_len + args.new_tokens,
            device=device,
            decode_linear=args.decode_linear,
            sampler=args.sampler,
            decode_attention=args.decode_attention,
            kv_cache=args.kv_cache,
            prefill_layer_fn=prefill_choice(args.prefill),
            quantization=args.quantization,
            exact=args.exact,
        )
        trainer_lm = load_model(mcfg, device, dtype).eval()
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens, ignore_eos=True)
    reqs = [
        Request(
            prompt_ids=torch.randint(5, vocab, (args.prompt_len,), generator=g).tolist(),
            sampling=SamplingParams(**{**{f: getattr(sp, f) for f in SamplingParams.__slots__}, "seed": i}),
            request_id=i,
        )
        for i in range(args.requests)
    ]
    outs = engine.generate(reqs)
    impl = args.loss_impl if args.loss_impl != "auto" else ("triton" if device.type == "cuda" else "reference")
    policy = PolicyModel(trainer_lm, impl, exact=args.exact)
    diffs = []
    with torch.no_grad():
        for r, c in zip(reqs, outs):
            ids = torch.tensor([r.prompt_ids + c.token_ids], device=device)
            pos = torch.arange(ids.shape[1], device=device)[None]
            targets = torch.cat([ids[0, 1:], ids.new_zeros(1)])
            lp, _ = policy.logprobs(ids, pos, targets, args.temperature or 1.0)
            trainer_lp = lp[len(r.prompt_ids) - 1 : -1].double().cpu()
            diffs.append(trainer_lp - torch.tensor(c.logprobs, dtype=torch.float64))
    d = torch.cat(diffs)
    res = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "",
        "dtype": str(dtype),
        "model_shape": args.model_shape,
        "init_std": shape["overrides"].get("initializer_range", 0.02),
        "loss_impl": policy.loss_impl,
        "engine": {
            k: getattr(args, k)
            for k in ("decode_attention", "decode_linear", "sampler", "kv_cache", "prefill", "quantization")
        },
        "exact": args.exact,
        "prefill_layer_fn_ran": getattr(engine.runner, "prefill_layer", None) is not None,
        "tokens": d.numel(),
        "mean_abs_diff": d.abs().mean().item(),
        "max_abs_diff": d.abs().max().item(),
        "mismatch_kl": (torch.exp(d) - d - 1).mean().item(),
        "torch": torch.__version__,
    }
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
