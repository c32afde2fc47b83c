"""Native-engine throughput with images beside text-only prompts, on a random-weight Qwen3-VL.

For each ``--images`` count (0: text only) the same model serves ``--prompts`` prompts x ``--group-size`` samples
(a GRPO step's shape): prefill tokens/s (requests with max_tokens 1: the vision encoder once per prompt, the prompt
forward, the first token), decode tokens/s (the rest of ``--new-tokens``, no eos) and the vision encoder's share
(``image_features`` of one prompt's images, timed alone); with ``--train`` also a trainer step's time split and peak
memory on the same samples (``train_steps``: a bf16 copy with bf16 AdamW, not the fp32 masters of the trainer). Each prompt holds ``--prompt-tokens`` text tokens plus its
images (``--image-size`` pixels square: (size / 32)^2 LM tokens an image at the 2b shape).

``--rl-steps N`` then runs ``python -m prime_spmd rl`` (configs/visual/rl.toml, colocated on the one device, max_async
1) for N steps on a random ``--shape`` model written in the engine's dtype: the built-in ``visual`` environment with
``--image-size`` images, ``--prompts`` x ``--group-size`` samples of ``--new-tokens`` tokens (eos allowed), no evals;
its metrics.jsonl gives each step's time split (generate, train, weight sync, wait), samples/s and trained tokens/s
(over the step's time), peak memory and mismatch KL, and their medians over steps >= 2 (the first two compile and
capture graphs) that sync weights and generate the next batch (not the last two).

The engine runs Qwen3-VL through prime_spmd/inference/vision_kv_runner.py: prefill eager (images, MRoPE positions,
DeepStack), decode on the text engine's path (the fused decode layer, compiled, CUDA graphs on CUDA; ``--no-cuda-graphs``
runs it eager, the baseline to compare on the same GPU). Each row and the JSON say which decode ran: ``cuda_graphs``
(graphs captured and replayed), ``fused_decode`` (the fused layer, else transformers' submodules), ``decode_attention``
and ``decode_linear``.

    python benchmarks/vlm.py --device cuda --shape qwen3-vl-2b --images 0,1 --train --out vlm.json   # H100: < 4 min
    python benchmarks/vlm.py --device cuda --shape qwen3-vl-2b --images 0,1 --rl-steps 6 --out vlm.json
    python benchmarks/vlm.py --device cpu --shape qwen3-vl-nano --images 0,1 --prompts 2 --group-size 2 --new-tokens 4
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prime_spmd.inference.engine import Request, SamplingParams  # noqa: E402
from prime_spmd.inference.native import NativeEngine  # noqa: E402
from prime_spmd.models.vision import VisionProcessor  # noqa: E402
from prime_spmd.models.vlm import (  # noqa: E402
    VLM_BPE_TOKENS,
    VLM_PRESETS,
    VLMAdapter,
    build_image_processor,
    build_tiny_vlm,
    build_vl_tokenizer,
    tiny_vlm_config,
)
from prime_spmd.rl.schedule import batch_after_step  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RL_KEYS = {  # metrics.jsonl key -> this script's name (prime_spmd/rl/loop.py, rl/samples.py)
    "step_time_s": "step_s",
    "gen_time_s": "generate_s",
    "train_time_s": "train_s",
    "train_fwd_bwd_s": "train_fwd_bwd_s",
    "train_optim_s": "train_optim_s",
    "weight_sync_s": "weight_sync_s",
    "wait_s": "wait_s",
    "train_samples": "samples",
    "trained_tokens": "trained_tokens",
    "too_long_samples": "too_long_samples",
    "completion_len_mean": "completion_len_mean",
    "mismatch_kl": "mismatch_kl",
    "peak_memory_gib": "peak_memory_gib",
}


def build(shape: str, device: torch.device, dtype: torch.dtype, image_size: int, tokenizer_files: Path | None = None):
    """(model, tokenizer, processor): random weights of ``shape``, the processor sized for ``image_size`` images."""
    from transformers import Qwen3VLForConditionalGeneration

    tok = build_vl_tokenizer(VLM_BPE_TOKENS.get(shape, 0), tokenizer_files)
    cfg = tiny_vlm_config(shape, tok)
    torch.manual_seed(0)
    with device:
        model = Qwen3VLForConditionalGeneration(cfg).to(dtype).eval()
    merge = cfg.vision_config.spatial_merge_size
    images = build_image_processor(cfg.vision_config.patch_size, merge, max_pixels=image_size * image_size)
    return model, tok, VisionProcessor(tok, images, cfg.image_token_id, merge)


def prompts(proc: VisionProcessor, n: int, images: int, text_tokens: int, size: int) -> list:
    """``n`` (ids, vision) prompts, each ``images`` random-noise images then about ``text_tokens`` text tokens."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        parts = []
        for _ in range(images):
            pixels = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8).numpy()
            parts.append({"type": "image", "image": Image.fromarray(pixels)})
        parts.append({"type": "text", "text": " ".join(f"w{(i * 7 + k) % 97}" for k in range(text_tokens // 2))})
        out.append(proc.render([{"role": "user", "content": parts}]))
    return out


def run(eng: NativeEngine, ps: list, group: int, max_tokens: int, tag: str) -> tuple[float, int, int]:
    """(seconds, prompt tokens, generated tokens) of one generate over ``ps`` x ``group`` requests."""
    reqs = [
        Request(
            prompt_ids=ids,
            vision=v,
            request_id=f"{tag}/{i}/{j}",
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i * group + j),
        )
        for i, (ids, v) in enumerate(ps)
        for j in range(group)
    ]
    eng.reset_cache()  # drops the cached image features: every timed generate encodes its prompts' images
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    done = eng.generate(reqs)
    sync()
    return time.perf_counter() - t0, sum(len(r.prompt_ids) for r in reqs), sum(len(c.token_ids) for c in done)


def decode_path(eng: NativeEngine) -> dict:
    """Which decode the engine ran: CUDA graphs replayed (any captured), the fused decode layer, its kernels."""
    r = eng.runner
    return {
        "cuda_graphs": bool(eng.use_graphs and eng._graphs),
        "num_decode_graphs": len(eng._graphs),
        "fused_decode": r.layer_args is not None,
        "decode_attention": r.attention,
        "decode_linear": r.linear if r.layer_args is not None else "modules",
    }


def encoder_ms(model, vision, device: torch.device) -> float:
    """Median ms of ``image_features`` over one prompt's images (5 runs after 2 warm-ups)."""
    adapter, v = VLMAdapter(model), vision.to(device)
    times = []
    for k in range(7):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            adapter.image_features([v])
        sync()
        if k >= 2:
            times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def train_steps(model, ps: list, group: int, new_tokens: int, device: torch.device, steps: int = 3) -> dict:
    """A trainer step's time split and memory on ``ps`` x ``group`` samples (prompt + ``new_tokens`` random completion
    tokens, every completion token trained): ``PolicyModel`` (the trainer's packed forward: the encoder once per
    prompt) over 8192-token micro-batches and AdamW, on a copy of the model in its dtype (bf16 on CUDA: the real
    trainer computes in bf16 too but keeps fp32 masters, so its optimizer step and memory are larger: 16 bytes a
    parameter against 8 here); medians of ``steps`` after one warm-up."""
    import copy

    from prime_spmd.data.sample import Sample
    from prime_spmd.trainer.packing import pack
    from prime_spmd.trainer.policy import PolicyModel
    from prime_spmd.trainer.sft import sft_loss

    lm = copy.deepcopy(model).train()
    policy = PolicyModel(lm, loss_impl="reference" if device.type == "cpu" else "fused", share_prompts=False)
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=1e-6)
    g = torch.Generator().manual_seed(1)
    samples = []
    for ids, v in ps:
        for _ in range(group):
            tail = torch.randint(10, 4000, (new_tokens,), generator=g).tolist()
            samples.append(Sample(input_ids=ids + tail, loss_mask=[0] * len(ids) + [1] * new_tokens, vision=v))
    mbs = pack(samples, max(8192, max(len(s.input_ids) for s in samples)), 1)[0]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fb, op = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for k in range(steps + 1):
        sync()
        t0 = time.perf_counter()
        for mb in mbs:
            mb = mb.to(device)
            fields = {**mb.fields, "loss_mask": mb.loss_mask.float()}
            out = policy(mb.input_ids, mb.position_ids, mb.targets, 1.0, sft_loss, fields, vision=mb.vision or None)
            out.loss_sum.backward()
        sync()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if k:
            fb.append(t1 - t0)
            op.append(time.perf_counter() - t1)
    tokens = sum(len(s.input_ids) for s in samples)
    fwd_bwd = sorted(fb)[len(fb) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    del lm, policy, opt
    return {
        "micro_batches": len(mbs),
        "tokens": tokens,
        "fwd_bwd_s": fwd_bwd,
        "optim_s": sorted(op)[len(op) // 2],
        "train_tokens_per_s": tokens / fwd_bwd,
        "peak_gib": peak,
    }


def rl_seq_len(proc: VisionProcessor, image_size: int, new_tokens: int) -> int:
    """``--trainer.seq_len`` that holds a visual prompt (its ``image_size`` image's tokens, the question, the chat
    template) plus ``new_tokens``, with 64 tokens to spare, rounded up to a multiple of 64."""
    from prime_spmd.data.visual import VisualTask, example_rng, visual_example

    messages, _ = visual_example(example_rng(0, "train", 0), VisualTask(image_size=image_size))
    ids, _ = proc.render(messages)
    return -(-(len(ids) + new_tokens + 64) // 64) * 64


def rl_steps(args: argparse.Namespace, dtype: torch.dtype, seq_len: int) -> dict:
    """``args.rl_steps`` RL steps (``python -m prime_spmd rl`` in a child process, colocated on ``args.device``) on a
    random ``args.shape`` model written to a temporary directory; returns {"config", "steps": per-step rows,
    "median": medians over the steady steps}. A random model's groups mostly score alike (all 0): they are trained
    anyway (--rollout.no_drop_zero_advantage_groups), so a step trains every sample. The child is killed past
    ``args.rl_limit_s``; SystemExit unless every step was logged by then (the final checkpoint may still be
    writing)."""
    n = args.prompts * args.group_size
    with tempfile.TemporaryDirectory(prefix="vlm_rl_") as tmp:
        model = build_tiny_vlm(
            Path(tmp) / "model",
            preset=args.shape,
            dtype=dtype,
            tokenizer_files=args.tokenizer_files,
            max_pixels=args.image_size * args.image_size,
            device=args.device,
        )
        if args.device.startswith("cuda"):
            gc.collect()  # the engine (CUDA graphs) and the models this process built
            torch.cuda.empty_cache()
        out = Path(tmp) / "rl"
        # --env.args takes only the keys the recipe's [env.args] has: the recipe gets the image size there
        recipe = (ROOT / "configs/visual/rl.toml").read_text()
        assert recipe.count("[env.args]\n") == 1, "configs/visual/rl.toml: one [env.args] table expected"
        recipe_path = Path(tmp) / "rl.toml"
        recipe_path.write_text(recipe.replace("[env.args]\n", f'[env.args]\nimage_size = "{args.image_size}"\n'))
        cmd = [sys.executable, "-m", "prime_spmd", "rl", "--config", str(recipe_path),
               "--model.path", str(model), "--output_dir", str(out), "--trainer.max_steps", str(args.rl_steps),
               "--rollout.max_async", "1", "--rollout.prompts_per_step", str(args.prompts),
               "--rollout.group_size", str(args.group_size), "--rollout.no_drop_zero_advantage_groups",
               "--inference.max_batch_size", str(n), "--sampling.max_tokens", str(args.new_tokens),
               "--trainer.seq_len", str(seq_len), "--trainer.micro_batch_tokens", str(max(8192, seq_len)),
               # without it the 2B shape's step ran out of memory on the H100 (~37 GiB of activations an 8k micro-batch)
               "--trainer.activation_checkpointing",
               "--eval.interval_steps", "0", "--ckpt.interval_steps", "0", "--ckpt.no_save_hf",
               "--log.no_progress", "--log.no_plots"]  # fmt: skip
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, cwd=ROOT)

        def stop(signum: int, _frame) -> None:  # a `timeout` over this script: the child must not keep the device
            child.kill()
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, stop)
        try:
            rc = child.wait(timeout=args.rl_limit_s)
        except subprocess.TimeoutExpired:  # fine if every step was logged: the final checkpoint was writing
            child.kill()
            child.wait()
            rc = None
        wall = time.perf_counter() - t0
        metrics = out / "metrics.jsonl"
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = []
    for row in rows:
        if "step_time_s" not in row:  # an eval-only row
            continue
        s = {"step": row["step"], **{name: row[k] for k, name in RL_KEYS.items() if k in row}}
        s["samples_per_s"] = s["samples"] / s["step_s"]
        s["trained_tokens_per_s"] = s["trained_tokens"] / s["step_s"]
        steps.append(s)
    if rc or len(steps) < args.rl_steps:
        what = f"killed at --rl-limit-s {args.rl_limit_s}" if rc is None else f"rc={rc}"
        raise SystemExit(f"prime_spmd rl failed ({what}) after {len(steps)} of {args.rl_steps} steps")
    # steady state: from step 2 (the first steps compile and capture graphs), the steps that sync weights and generate
    # a batch (max_async 1: not the last two); else every step from 2, else all
    late = [s for s in steps if s["step"] >= 2 and batch_after_step(s["step"], 1, args.rl_steps) is not None]
    late = late or [s for s in steps if s["step"] >= 2] or steps
    median = {k: statistics.median(s[k] for s in late) for k in steps[0] if k != "step"}
    config = {"seq_len": seq_len, "prompts": args.prompts, "group_size": args.group_size,
              "max_tokens": args.new_tokens, "image_size": args.image_size, "dtype": str(dtype).removeprefix("torch."),
              "median_steps": [s["step"] for s in late], "wall_s": wall, "killed_in_final_save": rc is None,
              "argv": cmd[1:]}  # fmt: skip
    return {"config": config, "steps": steps, "median": median}


def print_rl(rl: dict) -> None:
    """The RL steps' table: a row a step, then the medians."""
    c = rl["config"]
    print(
        f"RL: {c['prompts']} prompts x {c['group_size']} samples, {c['max_tokens']} new tokens, {c['image_size']}px "
        f"images, seq_len {c['seq_len']}, {c['dtype']}; {c['wall_s']:.0f} s with start-up"
    )
    print(
        "| step | step s | generate s | train s | weight sync s | wait s | samples/s | trained tok/s | peak GiB "
        "| mismatch KL |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in [*rl["steps"], {"step": f"median of {c['median_steps']}", **rl["median"]}]:
        print(
            f"| {s['step']} | {s['step_s']:.2f} | {s['generate_s']:.2f} | {s['train_s']:.2f} "
            f"| {s['weight_sync_s']:.2f} | {s['wait_s']:.2f} | {s['samples_per_s']:.1f} "
            f"| {s['trained_tokens_per_s']:.0f} | {s.get('peak_memory_gib', 0.0):.1f} | {s['mismatch_kl']:.2e} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="qwen3-vl-2b", choices=sorted(VLM_PRESETS))
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--images", default="0,1", help="images per prompt, comma-separated (0: text only)")
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="text tokens per prompt (about)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--train", action="store_true", help="also time a trainer step per --images count")
    ap.add_argument("--tokenizer-files", type=Path, default=None, help="dir with the qwen-3 tokenizer's two files")
    ap.add_argument("--rl-steps", type=int, default=0, help="then N steps of prime_spmd rl on the visual env (0: off)")
    ap.add_argument("--rl-limit-s", type=int, default=240, help="time limit of the RL child process, start-up included")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eager (no CUDA graphs, no compiled layer)")
    ap.add_argument("--repeats", type=int, default=3, help="time each prefill and generate this often; the fastest")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    model, tok, proc = build(args.shape, device, dtype, args.image_size, args.tokenizer_files)
    counts = [int(x) for x in args.images.split(",")]
    all_prompts = {k: prompts(proc, args.prompts, k, args.prompt_tokens, args.image_size) for k in counts}
    max_len = max(len(ids) for ps in all_prompts.values() for ids, _ in ps) + args.new_tokens + 1
    n_seqs = args.prompts * args.group_size
    eng = NativeEngine(
        model,
        tok,
        max_batch_size=n_seqs,
        max_model_len=max_len,
        device=device,
        dtype=dtype,
        cuda_graphs=not args.no_cuda_graphs,
    )
    run(eng, all_prompts[counts[0]][:1], 1, 2, "warm")  # first kernels, allocator
    rows = []
    for k in counts:
        ps = all_prompts[k]
        # untimed first: the first generate of a kind compiles and allocates (on the H100 a timed first prefill with
        # images took longer than the whole generate after it, giving a negative decode time)
        run(eng, ps, args.group_size, args.new_tokens, f"warm{k}")
        before = eng.runner.num_encoded_images
        t_pre, n_prompt, _ = run(eng, ps, args.group_size, 1, f"pre{k}")
        encoded = eng.runner.num_encoded_images - before
        t_all, _, n_gen = run(eng, ps, args.group_size, args.new_tokens, f"all{k}")
        for r in range(args.repeats - 1):  # the fastest of each: one noisy prefill can outlast a whole generate
            t_pre = min(t_pre, run(eng, ps, args.group_size, 1, f"pre{k}.{r}")[0])
            t_all = min(t_all, run(eng, ps, args.group_size, args.new_tokens, f"all{k}.{r}")[0])
        t_dec = t_all - t_pre
        if t_dec <= 0:
            raise SystemExit(f"images {k}: generate took {t_all:.3f} s, its prefill alone {t_pre:.3f} s: not timed")
        enc = encoder_ms(model, ps[0][1], device) if k else 0.0
        rows.append(
            {
                "images": k,
                "image_tokens_per_prompt": sum(ps[0][1].tokens_per_image()) if k else 0,
                "prompt_tokens": len(ps[0][0]),
                "sequences": n_seqs,
                "images_encoded_per_generate": encoded,
                "prefill_s": t_pre,
                "prefill_tokens_per_s": n_prompt / t_pre,
                "decode_tokens_per_s": (n_gen - n_seqs) / t_dec,
                "generate_s": t_all,
                "encoder_ms_per_prompt": enc,
                **decode_path(eng),
            }
        )
    mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"{args.shape} {dtype} on {name}; {args.prompts} prompts x {args.group_size} samples, {args.new_tokens} new tokens"
    )
    print(
        "| images | image tok | prompt tok | prefill tok/s | decode tok/s | encoder ms/prompt | encoded/generate "
        "| decode path |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        path = f"{'graphs' if r['cuda_graphs'] else 'eager'}, {'fused' if r['fused_decode'] else 'submodules'}"
        print(
            f"| {r['images']} | {r['image_tokens_per_prompt']} | {r['prompt_tokens']} | {r['prefill_tokens_per_s']:.0f} "
            f"| {r['decode_tokens_per_s']:.1f} | {r['encoder_ms_per_prompt']:.1f} | {r['images_encoded_per_generate']} "
            f"| {path}, {r['decode_attention']}, {r['decode_linear']} |"
        )
    print(f"peak GPU memory {mem:.1f} GiB", flush=True)  # the engine's numbers stand even if a train step fails
    if args.train:
        for r in rows:
            r["train"] = train_steps(model, all_prompts[r["images"]], args.group_size, args.new_tokens, device)
        print(
            "| images | micro-batches | tokens | fwd+bwd s | optimizer s | train tok/s | peak GiB (engine + trainer) |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            t = r["train"]
            print(
                f"| {r['images']} | {t['micro_batches']} | {t['tokens']} | {t['fwd_bwd_s']:.2f} | {t['optim_s']:.2f} "
                f"| {t['train_tokens_per_s']:.0f} | {t['peak_gib']:.1f} |"
            )
    result = {"shape": args.shape, "device": name, "rows": rows, "peak_gib": mem}
    if args.out:  # written now too: the engine's numbers stand if the RL run fails
        args.out.write_text(json.dumps(result, indent=1))
    if args.rl_steps:
        seq_len = rl_seq_len(proc, args.image_size, args.new_tokens)
        del eng, model  # the RL child needs the device's memory
        result["rl"] = rl_steps(args, dtype, seq_len)
        print_rl(result["rl"])
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
