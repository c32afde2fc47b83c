"""What the benchmark scripts share: median timing, the dense matmul ceiling, peak memory, run metadata, output.

Needs only torch (no tyro, no verifiers): the engine benchmark imports it on bare GPU machines.
Import as ``from benchmarks.common import ...`` after putting the repo root on ``sys.path``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: str | torch.device, iters: int, warmup: int = 1) -> float:
    """Median time of ``fn()`` over ``iters`` calls in ms, after ``warmup`` untimed calls.

    CUDA events around each call on GPU, ``time.perf_counter`` on CPU.
    """
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if is_cuda(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_graph(fn, num_layers: int, reps: int) -> float:
    """us per call: ``fn(layer)`` for every layer captured in one CUDA graph, median over replays
    (CPU, a smoke test under TRITON_INTERPRET=1: the layers called in a loop)."""
    if not torch.cuda.is_available():
        return 1e3 * time_ms(lambda: [fn(li) for li in range(num_layers)], "cpu", iters=reps) / num_layers
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for li in range(num_layers):
            fn(li)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for li in range(num_layers):
            fn(li)
    ms = time_ms(g.replay, "cuda", iters=reps, warmup=3)
    return 1e3 * ms / num_layers


def matmul_size(device: str | torch.device) -> int:
    """Side of the square matmul that measures the ceiling: 8192 on GPU, 512 on CPU (a smoke check)."""
    return 8192 if is_cuda(device) else 512


def matmul_ceiling_tflops(device: str | torch.device, dtype: torch.dtype, iters: int, warmup: int = 1) -> float:
    """TFLOP/s of one ``matmul_size``^3 matmul in ``dtype`` (median of ``iters``): what MFU is measured against."""
    size = matmul_size(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / (time_ms(lambda: a @ b, device, iters, warmup) * 1e-3) / 1e12


def peak_mib(fn: Callable[[], Any], device: str | torch.device) -> float | None:
    """Peak memory allocated during ``fn()`` above what was allocated before it, in MiB (None on CPU)."""
    if not is_cuda(device):
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def source_commit() -> str | None:
    """Short commit of the code that runs: git's HEAD, else $PRIME_SPMD_COMMIT (a `git archive` export: the GPU
    suite's runs of a committed tree), else None."""
    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
    return head.stdout.strip() or os.environ.get("PRIME_SPMD_COMMIT") or None


def run_metadata(device: str | torch.device, **extra: Any) -> dict[str, Any]:
    """Date, short commit (``source_commit``), device name and torch version of this run, then ``extra``."""
    return dict(
        date=datetime.date.today().isoformat(),
        commit=source_commit(),
        device=torch.cuda.get_device_name(device) if is_cuda(device) else platform.processor() or "cpu",
        torch=torch.__version__,
        **extra,
    )


def train_step_flops(model_dir: str | Path, num_params: int, model_tokens: float, head_tokens: float) -> float:
    """FLOPs of one training step, forward + backward at 6 per parameter per token: the blocks' parameters times
    the tokens the blocks ran (``model_tokens``: prompt sharing skips a group's prompt copies), plus the LM head's
    times the tokens it ran (``head_tokens``: every packed token). The input embedding (a lookup) counts for
    nothing; attention's quadratic term is left out. ``num_params`` counts tied weights once; the vocab and
    hidden sizes and the tying come from ``model_dir``'s config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head = cfg["vocab_size"] * cfg["hidden_size"]
    blocks = num_params - head * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return 6.0 * (blocks * model_tokens + head * head_tokens)


def add_on_off(ap, flag: str, help: str) -> None:
    """An on/off switch that is on by default: ``--flag`` alone means on (what older commands pass), ``--flag off``
    turns it off."""
    ap.add_argument(flag, nargs="?", const="on", default="on", choices=["on", "off"], help=f"{help} (on by default)")


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON at ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


def print_markdown_table(columns: list[str], rows: list[list[Any]]) -> None:
    """Print a markdown table: a header of ``columns``, then one line per row of already formatted cells."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
