"""One RL training step with every loss impl from the same weights: loss and gradients against the reference.

GPU (H200, bf16):
    python benchmarks/loss_parity.py --out benchmarks/results/loss_parity_h200.json
    python benchmarks/loss_parity.py --preset qwen3-0.6b --temperature 0.8 --out benchmarks/results/loss_parity_06b.json
CPU check (fp32, Triton interpreter):
    python benchmarks/loss_parity.py --device cpu --dtype float32 --groups 2 --group-size 2 --completion-len 12

What runs, all through the trainer's own code: the model directory is written once (random init; a
tiny preset as the tests use, or ``qwen3-0.6b``: Qwen3-0.6B shapes with the real 151,936 vocabulary);
the model samples ``--groups`` x ``--group-size`` completions of random prompts at ``--temperature``
(every other one with a masked "environment" span, as multi-turn rollouts have); the engine logprobs
are the fp32 reference logprobs of those tokens plus N(0, ``--logprob-noise``) noise, so the
importance ratio is not 1; rewards are uniform random. ``rollouts_to_samples`` (group advantages of
both signs) and ``pack`` make the micro-batches. Then, per run, ``build_trainer`` loads the model
(fp32 masters, FSDP2 on a 1-rank group, compute in --dtype through FSDP mixed precision) with
``TrainerConfig.loss_impl`` = the impl, and ``train_step`` runs the forward/backward of every
micro-batch with the RL loss (``RLLoss``, --loss-type); an optimizer pre-step hook copies the
gradients (no clipping).

Runs: every impl of --impls in --dtype, plus the reference in the other dtype of {fp32, bf16}: the
reference bf16-vs-fp32 difference (last table row) is the intrinsic bf16 noise floor of this step.

Table columns (row "impl" against the reference of column "vs", the same dtype except the floor row):
- loss: the step's loss per trained token (what the trainer logs); abs loss diff: |loss - loss_ref|.
- grad-norm ratio: ||g|| / ||g_ref|| over all parameters.
- grad rel diff: ||g - g_ref|| / ||g_ref|| over all parameters together.
- worst tensor, worst rel diff: the parameter tensor with the largest ||g - g_ref|| / ||g_ref||.
- max abs diff: max |g - g_ref| over all elements of all tensors.
- vs fp32 ref (bf16 runs): grad rel diff against the fp32 reference (the total error of the bf16 run).
- masked: trained tokens masked (dppo) or clipped (ppo) by the loss.
- tol, ok: the bounds below and whether the row is within them.

Pass/fail. In bf16 an impl's global and worst-tensor grad rel diff and its abs loss diff must be at most
--tol-factor (2) times those of the floor: the impl may add no more error than running the reference
itself in bf16 does. In fp32: grad rel diffs <= --fp32-tol (1e-4), abs loss diff <= 1e-6 + 1e-5 |loss|
(measured on CPU, tests/unit/test_loss_parity_script.py: <= 1.3e-6 and <= 2.6e-8). The exit code is 1
when an impl of --judge fails: by default the Triton kernels (triton, fused); chunked is reported but
not judged, as it rounds the logits to bf16 by design.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IMPLS = ("reference", "chunked", "triton", "fused")
# preset -> defaults: init std, prompt length range, max completion length, micro-batch tokens.
# Tiny: init 0.3 as in the tests (std 0.02 would leave a 64-wide model's distributions near uniform).
SIZES: dict[str, dict[str, Any]] = {
    "qwen3-nano": dict(init_std=0.3, prompt_len=(8, 24), completion_len=48, micro_batch_tokens=256),
    "qwen3-micro": dict(init_std=0.3, prompt_len=(8, 24), completion_len=48, micro_batch_tokens=256),
    "qwen3-1m": dict(init_std=0.3, prompt_len=(8, 24), completion_len=48, micro_batch_tokens=256),
    "qwen3-0.6b": dict(init_std=0.02, prompt_len=(64, 192), completion_len=256, micro_batch_tokens=4096),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="compute dtype (default: bf16 on cuda)"
    )
    p.add_argument("--preset", default="qwen3-nano", choices=sorted(SIZES))
    p.add_argument("--init-std", type=float, default=None, help="random init std (default: per preset)")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    p.add_argument("--loss-type", default="dppo", choices=["dppo", "ppo"])
    p.add_argument("--temperature", type=float, default=1.0, help="sampling and training temperature")
    p.add_argument("--groups", type=int, default=4, help="prompts (groups of the group advantage)")
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    p.add_argument("--completion-len", type=int, default=None, help="max completion tokens (default: per preset)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="packing bound (default: per preset)")
    p.add_argument("--logprob-noise", type=float, default=0.05, help="std of the noise on the engine logprobs")
    p.add_argument("--no-floor", action="store_true", help="skip the other-dtype reference run")
    p.add_argument("--judge", default="triton,fused", help="impls whose failure makes the exit code 1")
    p.add_argument("--tol-factor", type=float, default=2.0, help="bf16: allowed multiple of the noise floor")
    p.add_argument("--fp32-tol", type=float, default=1e-4, help="fp32: allowed grad rel diff")
    p.add_argument("--per-tensor", action="store_true", help="also print every tensor's diffs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=None, help="write (or reuse) the model here (default: temp)")
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = p.parse_args(argv)
    size = SIZES[args.preset]
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.init_std = args.init_std if args.init_std is not None else size["init_std"]
    args.completion_len = args.completion_len or size["completion_len"]
    args.micro_batch_tokens = args.micro_batch_tokens or size["micro_batch_tokens"]
    args.prompt_len = size["prompt_len"]
    impls = args.impls.split(",")
    unknown = set(impls) - set(IMPLS)
    if unknown:
        raise ValueError(f"--impls: unknown {sorted(unknown)}; choose from {IMPLS}")
    args.impls = ["reference"] + [i for i in impls if i != "reference"]  # the baseline always runs, first
    args.judge = args.judge.split(",") if args.judge else []
    if args.prompt_len[1] + args.completion_len > args.micro_batch_tokens:
        raise ValueError("--micro-batch-tokens must hold the longest prompt + --completion-len")
    return args


def write_model(path: Path, preset: str, init_std: float, seed: int, device: str) -> Path:
    """A random-init Qwen3 (fp32, HF format) with the character tokenizer at ``path``; reused if there."""
    from prime_spmd.models import tiny

    if (path / "config.json").is_file():
        return path
    if preset in tiny.PRESETS:
        return tiny.build_tiny_model(path, preset, seed=seed, initializer_range=init_std)
    from transformers import AutoModelForCausalLM, Qwen3Config

    from prime_spmd.models.qwen3 import FLAVORS

    hf = {k: v for k, v in FLAVORS[preset].items() if k != "model_type"}
    eos = tiny.SPECIAL_TOKENS.index("<|im_end|>")
    config = Qwen3Config(**hf, initializer_range=init_std, pad_token_id=0, eos_token_id=eos, bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):  # random init of 0.6B params is slow on CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tiny.build_char_tokenizer().save_pretrained(path)
    return path


@torch.no_grad()
def sample_rollouts(lm: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> list[list[Any]]:
    """``--groups`` groups of ``--group-size`` rollouts sampled from ``lm`` (fp32 weights) at ``--temperature``.

    Engine logprobs: the reference logprobs (teacher-forced fp32, kernels/lm_logprob reference) plus
    noise. Completion lengths are random (as if ended by eos); every other sample has a masked middle
    span (environment tokens: mask 0, logprob 0).
    """
    from prime_spmd.kernels.lm_logprob.op import lm_head_logprobs

    from prime_spmd.models.registry import adapter_for
    from prime_spmd.rl.types import Rollout

    gen = torch.Generator().manual_seed(args.seed)
    adapter = adapter_for(lm)
    weight_VH = adapter.lm_head_weight().float()
    vocab, G, C = weight_VH.shape[0], args.group_size, args.completion_len
    groups = []
    for g in range(args.groups):
        n_p = int(torch.randint(args.prompt_len[0], args.prompt_len[1] + 1, (), generator=gen))
        prompt = torch.randint(5, vocab, (n_p,), generator=gen)  # ids 0-4: special tokens of the char tokenizer
        ids_GT = prompt.repeat(G, 1).to(device)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True  # only picks tokens (0.6B: 3x faster); logprobs are redone below
        try:
            for _ in range(C):
                pos_GT = torch.arange(ids_GT.shape[1], device=device).expand(G, -1)
                hidden_GH = adapter.forward_hidden(ids_GT, pos_GT)[:, -1].float()
                probs_GV = torch.softmax(hidden_GH @ weight_VH.T / args.temperature, dim=-1).cpu()
                ids_GT = torch.cat([ids_GT, torch.multinomial(probs_GV, 1, generator=gen).to(device)], dim=1)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        pos_GT = torch.arange(ids_GT.shape[1], device=device).expand(G, -1)
        hidden_GCH = adapter.forward_hidden(ids_GT, pos_GT)[:, n_p - 1 : -1]  # position t predicts token t + 1
        logprobs_N, _ = lm_head_logprobs(
            hidden_GCH.reshape(G * C, -1), weight_VH, ids_GT[:, n_p:].reshape(-1), args.temperature,
            impl="reference", return_entropy=False,
        )  # fmt: skip
        logprobs_GC = logprobs_N.view(G, C).cpu()
        group = []
        for i in range(G):
            n_c = int(torch.randint(max(2, C // 2), C + 1, (), generator=gen))
            mask = [1] * n_c
            if i % 2 == 1 and n_c >= 8:
                mask[n_c // 3 : n_c // 3 + n_c // 6] = [0] * (n_c // 6)
            noise = torch.randn(n_c, generator=gen) * args.logprob_noise
            lq = [float(logprobs_GC[i, t] + noise[t]) if m else 0.0 for t, m in enumerate(mask)]
            group.append(
                Rollout(
                    example_id=g,
                    sample_idx=i,
                    prompt_ids=prompt.tolist(),
                    completion_ids=ids_GT[i, n_p : n_p + n_c].tolist(),
                    completion_mask=mask,
                    inference_logprobs=lq,
                    reward=float(torch.rand((), generator=gen)),
                )
            )
        groups.append(group)
    return groups


@dataclass
class RunResult:
    label: str
    loss: float
    grad_norm: float
    masked_tokens: float
    grads: dict[str, torch.Tensor]


def run_step(args, ctx, model_dir: Path, impl: str, dtype: str, micro_batches, loss_fn) -> RunResult:
    """Build the trainer (``build_trainer``) with ``impl`` and run one ``train_step``; return loss, grads."""
    from torch.distributed.tensor import DTensor

    from prime_spmd.config.sections import ModelConfig, OptimConfig, TrainerConfig
    from prime_spmd.distributed.fsdp import unwrapped_name
    from prime_spmd.trainer.build import build_trainer
    from prime_spmd.trainer.step import train_step

    model_cfg = ModelConfig(path=str(model_dir), impl="custom", dtype=dtype)
    trainer_cfg = TrainerConfig(
        loss_impl=impl, micro_batch_tokens=args.micro_batch_tokens, seq_len=args.micro_batch_tokens, seed=args.seed
    )
    parts = build_trainer(model_cfg, trainer_cfg, OptimConfig(), ctx)
    grads: dict[str, torch.Tensor] = {}
    named_params = list(parts.policy.named_parameters())

    def capture(optimizer, *_):
        for name, p in named_params:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # 1 rank: a copy, no comm
            grads[unwrapped_name(name.removeprefix("lm."))] = g.detach().float().clone()

    parts.optimizer.register_step_pre_hook(capture)
    stats = train_step(
        parts.policy,
        parts.optimizer,
        parts.scheduler,
        micro_batches,
        loss_fn,
        device=ctx.device,
        temperature=args.temperature,
        max_grad_norm=0.0,  # no clipping: compare the raw gradients
    )
    assert grads and not stats["skipped"], f"{impl} {dtype}: the step was skipped ({stats})"
    label = f"{impl} {'bf16' if dtype == 'bfloat16' else 'fp32'}"
    return RunResult(label, stats["loss"], stats["grad_norm"], stats["masked_tokens"], grads)


def compare(got: RunResult, ref: RunResult) -> dict[str, Any]:
    """Loss and gradient differences of ``got`` against ``ref`` (module docstring: the columns)."""
    per_tensor, diff_sq, ref_sq, got_sq = {}, 0.0, 0.0, 0.0
    for name, g_ref in ref.grads.items():
        g = got.grads[name]
        d = (g - g_ref).norm().item()
        r = g_ref.norm().item()
        diff_sq, ref_sq, got_sq = diff_sq + d * d, ref_sq + r * r, got_sq + g.norm().item() ** 2
        per_tensor[name] = dict(
            rel_diff=d / r if r > 0 else (0.0 if d == 0 else math.inf),
            max_abs_diff=(g - g_ref).abs().max().item(),
            ref_norm=r,
        )
    worst = max(per_tensor, key=lambda n: per_tensor[n]["rel_diff"])
    return dict(
        impl=got.label,
        ref=ref.label,
        loss=got.loss,
        loss_ref=ref.loss,
        loss_abs_diff=abs(got.loss - ref.loss),
        grad_norm=got.grad_norm,  # train_step's (clip_grad_norm_) global norm
        grad_norm_ratio=math.sqrt(got_sq / ref_sq),
        grad_rel_diff=math.sqrt(diff_sq / ref_sq),
        worst_tensor=worst,
        worst_rel_diff=per_tensor[worst]["rel_diff"],
        max_abs_diff=max(t["max_abs_diff"] for t in per_tensor.values()),
        masked_tokens=got.masked_tokens,
        per_tensor=per_tensor,
    )


def check(c: dict[str, Any], floor: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, float]:
    """Tolerances for comparison ``c`` (module docstring); sets c["ok"]."""
    if args.dtype == "float32":
        tol = dict(grad=args.fp32_tol, worst=args.fp32_tol, loss=1e-6 + 1e-5 * abs(c["loss_ref"]))
    elif floor is not None:
        k = args.tol_factor
        tol = dict(grad=k * floor["grad_rel_diff"], worst=k * floor["worst_rel_diff"], loss=k * floor["loss_abs_diff"])
    else:
        c["ok"] = None  # bf16 without the floor run: nothing to judge against
        return {}
    c["ok"] = (
        c["grad_rel_diff"] <= tol["grad"] and c["worst_rel_diff"] <= tol["worst"] and c["loss_abs_diff"] <= tol["loss"]
    )
    return tol


def batch_summary(micro_batches) -> dict[str, float]:
    trained = [mb.loss_mask for mb in micro_batches]
    mask = torch.cat(trained)
    adv = torch.cat([mb.fields["advantages"] for mb in micro_batches])[mask]
    return dict(
        micro_batches=len(micro_batches),
        docs=sum(mb.num_docs for mb in micro_batches),
        tokens=sum(mb.num_tokens for mb in micro_batches),
        trained_tokens=int(mask.sum()),
        positive_adv_tokens=int((adv > 0).sum()),
        negative_adv_tokens=int((adv < 0).sum()),
    )


def print_table(comparisons: list[dict[str, Any]], vs_fp32: dict[str, dict], tols: dict[str, dict]) -> None:
    from benchmarks import common

    columns = ["impl", "vs", "loss", "abs loss diff", "grad-norm ratio", "grad rel diff", "worst tensor"]
    columns += ["worst rel diff", "max abs diff", "vs fp32 ref", "masked", "tol (grad / worst / loss)", "ok"]
    rows = []
    for c in comparisons:
        f32 = vs_fp32.get(c["impl"])
        tol = tols.get(c["impl"])
        rows.append(
            [c["impl"], c["ref"], f"{c['loss']:.7g}", f"{c['loss_abs_diff']:.2e}", f"{c['grad_norm_ratio']:.6f}",
             f"{c['grad_rel_diff']:.2e}", c["worst_tensor"], f"{c['worst_rel_diff']:.2e}", f"{c['max_abs_diff']:.2e}",
             "-" if f32 is None else f"{f32['grad_rel_diff']:.2e}", f"{c['masked_tokens']:.0f}",
             "-" if not tol else f"{tol['grad']:.1e} / {tol['worst']:.1e} / {tol['loss']:.1e}",
             {True: "yes", False: "NO", None: "-"}[c.get("ok")]]
        )  # fmt: skip
    common.print_markdown_table(columns, rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison; print the table; return the results (``passed``: every --judge impl within tolerance)."""
    args = parse_args(argv)
    if args.device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("--device cpu needs TRITON_INTERPRET=1 set before triton is imported")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from benchmarks import common
    from prime_spmd.config.rl_sections import LossConfig, RolloutConfig
    from prime_spmd.config.sections import ModelConfig, TopologyConfig
    from prime_spmd.distributed.groups import init_distributed
    from prime_spmd.models.loading import load_model
    from prime_spmd.rl.loss import make_rl_loss
    from prime_spmd.trainer.packing import pack
    from prime_spmd.trainer.rl_data import Batch, rollouts_to_samples

    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 runs must be fp32 (the default; made explicit)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(
            args.model_dir or Path(tmp) / "model", args.preset, args.init_std, args.seed, args.device
        )
        ctx = init_distributed(TopologyConfig(backend="gloo" if args.device == "cpu" else "auto"))
        try:
            sampler = load_model(ModelConfig(path=str(model_dir), impl="custom"), ctx.device, dtype=torch.float32)
            groups = sample_rollouts(sampler, args, ctx.device)
            del sampler
            rollout_cfg = RolloutConfig(prompts_per_step=args.groups, group_size=args.group_size)
            batch = Batch(index=0, groups=groups)
            samples, _ = rollouts_to_samples(batch, rollout_cfg, args.completion_len, args.micro_batch_tokens)
            (micro_batches,) = pack(samples, args.micro_batch_tokens, 1)
            loss_fn = make_rl_loss(LossConfig(type=args.loss_type))

            def step(impl: str, dtype: str) -> RunResult:
                result = run_step(args, ctx, model_dir, impl, dtype, micro_batches, loss_fn)
                gc.collect()  # the last run's model and AdamW state (FSDP hooks hold reference cycles)
                if ctx.device.type == "cuda":
                    torch.cuda.empty_cache()
                return result

            runs = {impl: step(impl, args.dtype) for impl in args.impls}
            other = None
            if not args.no_floor:
                other = step("reference", "float32" if args.dtype == "bfloat16" else "bfloat16")
        finally:
            ctx.close()
    ref = runs["reference"]
    floor = None
    if other is not None:
        fp32_ref, bf16_ref = (other, ref) if args.dtype == "bfloat16" else (ref, other)
        floor = compare(bf16_ref, fp32_ref)
    comparisons, vs_fp32, tols = [], {}, {}
    for run in runs.values():
        c = compare(run, ref)
        tols[c["impl"]] = check(c, floor, args)
        comparisons.append(c)
        if args.dtype == "bfloat16" and other is not None:
            vs_fp32[c["impl"]] = compare(run, other)
    ref_row = comparisons[0]
    ref_row["ok"] = None  # itself
    tols[ref_row["impl"]] = {}
    summary = batch_summary(micro_batches)
    print(
        f"\n{args.preset}, {args.dtype}, {args.loss_type}, T={args.temperature}, {summary['docs']} sequences, "
        f"{summary['tokens']} tokens ({summary['trained_tokens']} trained; advantage > 0 on "
        f"{summary['positive_adv_tokens']}, < 0 on {summary['negative_adv_tokens']}) in "
        f"{summary['micro_batches']} micro-batches"
    )
    print_table(comparisons + ([dict(floor, ok=None)] if floor else []), vs_fp32, tols)
    if args.per_tensor:
        for c in comparisons[1:] + ([floor] if floor else []):
            print(f"\n{c['impl']} vs {c['ref']}:")
            rows = [[n, f"{t['rel_diff']:.2e}", f"{t['max_abs_diff']:.2e}", f"{t['ref_norm']:.3e}"]
                    for n, t in c["per_tensor"].items()]  # fmt: skip
            common.print_markdown_table(["tensor", "rel diff", "max abs diff", "ref norm"], rows)
    judged = [c for c in comparisons[1:] if c["ok"] is not None and c["impl"].split()[0] in args.judge]
    passed = all(c["ok"] for c in judged)
    names = ", ".join(f"{c['impl']} {'ok' if c['ok'] else 'FAILED'}" for c in judged) or "none"
    print(f"\n{'PASS' if passed else 'FAIL'} (judged: {names})")
    result = dict(
        meta=common.run_metadata(ctx.device),
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        batch=summary,
        comparisons=comparisons,
        floor=floor,
        vs_fp32_ref=vs_fp32,
        tolerances=tols,
        passed=passed,
    )
    if args.out:
        common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
