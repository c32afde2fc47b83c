"""Quantized generation (``--inference.quantization``): the native engine's FP8 weight copies and the linears that
read them.

``fp8``: every decoder layer's linears (the fused QKV, o, the fused gate/up, down) get a float8 e4m3 copy with one
fp32 scale per output channel (kernels/fp8/reference.py says why per channel), made from the model's own bf16
weights when the runner is built and again at every weight sync (``Fp8Weights.requantize``, in place: captured CUDA
graphs read these buffers). The model keeps its bf16 weights: they are what a weight sync (``NativeEngine.load_weights``),
a LoRA merge and the colocated sharing write or read, so FP8 adds half the linears' bytes (``memory.estimate``).
Embeddings, norms and the LM head stay bf16.

Which GEMM reads the copy: decode steps within the fused kernels' row bounds ``fp8_fused_linear``: one row the FP8
Triton GEMV (``prime_spmd::fp8_decode_linear``, weight-only: fp32 accumulation of bf16 activations times e4m3
weights), more rows the FP8 tile kernel or ``torch._scaled_mm`` as ``kernels.fp8.op.TILE_ROWS_IMPL`` says (a benchmark
setting); prefill and larger decode steps ``fp8_linear`` (``linear_impl``: ``torch._scaled_mm`` with row-wise scales on
CUDA for bf16, activations quantized per row; dequantize + GEMM where ``_scaled_mm`` fails its probe and for fp16;
an fp32 upcast matmul on CPU and for fp32 models).

Layer functions of ``runner.py`` call ``linear`` / ``fused_linear`` with either a bf16 weight or a ``(q, scale)``
pair; the pair is resolved at trace time, so one compiled graph serves the layers of one kind.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from prime_spmd.kernels.fp8 import op as fp8_op
from prime_spmd.kernels.fp8.op import fp8_fused_linear, fp8_linear, quantize_fp8_
from prime_spmd.kernels.fp8.reference import FP8_DTYPE
from prime_spmd.log import logger

Quantization = Literal["none", "fp8"]
FP8_MIN_CAPABILITY = (8, 9)
"""e4m3 conversion in Triton and FP8 tensor cores (``_scaled_mm``): Ada (8.9) and Hopper (9.0) onwards."""
FP8_ALIGN = 16
"""``torch._scaled_mm`` needs K and N multiples of 16 (and the kernels' 16-byte rows of e4m3)."""
WEIGHT_ARGS = (1, 5, 8, 9)
"""Positions of the quantized weights in a runner layer's argument tuple: qkv_w, o_w, gate_up_w, down_w."""


def check_fp8_supported(device: torch.device, dims: dict[str, int], capability: tuple[int, int] | None = None) -> None:
    """ValueError naming ``--inference.quantization`` when ``device`` (a CUDA device below compute capability 8.9;
    ``capability`` overrides the query, for tests) or a dim of ``dims`` (name -> size: a linear's K or N) cannot run
    the FP8 path."""
    if device.type == "cuda":
        cap = capability or torch.cuda.get_device_capability(device)
        if tuple(cap) < FP8_MIN_CAPABILITY:
            raise ValueError(
                f"--inference.quantization fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper: e4m3 "
                f"conversion, FP8 tensor cores); {device} is {cap[0]}.{cap[1]}: use --inference.quantization none"
            )
    bad = {k: v for k, v in dims.items() if v % FP8_ALIGN}
    if bad:
        raise ValueError(
            f"--inference.quantization fp8: the FP8 GEMMs need every linear's in / out features to be a multiple of "
            f"{FP8_ALIGN}; this model has {bad}: use --inference.quantization none"
        )


_LINEAR_IMPL: dict[str, str] = {}


def linear_impl(device: torch.device) -> str:
    """``fp8_linear``'s impl on ``device``: "scaled_mm" on CUDA where a probe GEMM runs (torch builds / GPUs without
    row-wise ``_scaled_mm`` raise), else "dequant"; "reference" elsewhere. Probed once per device type."""
    key = device.type
    if key not in _LINEAR_IMPL:
        impl = "reference"
        if key == "cuda":
            q = torch.zeros(16, 16, dtype=FP8_DTYPE, device=device)
            s = torch.ones(16, device=device)
            try:  # probe: the error types of an unsupported _scaled_mm differ across torch versions
                fp8_linear(torch.zeros(1, 16, dtype=torch.bfloat16, device=device), q, s, impl="scaled_mm")
                impl = "scaled_mm"
            except (RuntimeError, NotImplementedError):
                impl = "dequant"
        _LINEAR_IMPL[key] = impl
    return _LINEAR_IMPL[key]


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``, or for an FP8 ``w = (q, scale)`` the FP8 GEMM: ``linear_impl``'s for bf16 x ("dequant"
    for fp16 x where that is "scaled_mm": row-wise ``_scaled_mm`` writes bf16 only), the fp32 reference for fp32 x
    (fp32 models, tests: rounding x to e4m3 would dwarf their precision)."""
    if isinstance(w, tuple):
        impl = "reference" if x.dtype == torch.float32 else _LINEAR_IMPL.get(w[0].device.type, "reference")
        if impl == "scaled_mm" and x.dtype != torch.bfloat16:
            impl = "dequant"
        return fp8_linear(x, w[0], w[1], b, impl=impl)
    return F.linear(x, w, b)


def fused_linear(x, w, b, norm_w, eps: float, residual, silu_mul: bool) -> torch.Tensor:
    """``prime_spmd::decode_linear`` (kernels/decode_linear), or for an FP8 ``w = (q, scale)`` kernels/fp8's
    ``fp8_fused_linear`` (the FP8 GEMV, tile kernel or ``_scaled_mm`` by rows); arguments as the op's."""
    if isinstance(w, tuple):
        return fp8_fused_linear(x, w[0], w[1], b, norm_w, eps, residual, silu_mul)
    return torch.ops.prime_spmd.decode_linear(x, w, b, norm_w, eps, residual, silu_mul)


class Fp8Weights:
    """The FP8 copies of a runner's layer weights (``WEIGHT_ARGS`` of each ``layer_args`` tuple): per weight an e4m3
    tensor of its shape and an fp32 scale per row, on its device. Built once, quantized at once; ``requantize``
    refreshes them in place. Single process; call from the engine's thread."""

    def __init__(self, layer_args: list[tuple], device: torch.device) -> None:
        self.impl = "triton" if device.type == "cuda" else "reference"
        if self.impl == "triton":
            import prime_spmd.kernels.fp8.kernel  # noqa: F401  (fails here, at build, where Triton is missing)

        self.gemm = linear_impl(device)
        """The prefill / large-step GEMM over the copies (``linear_impl``)."""
        self.sources: list[torch.Tensor] = []  # the bf16 weights (the model's own storage)
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for args in layer_args:
            for i in WEIGHT_ARGS:
                w = args[i]
                q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
                self.sources.append(w)
                self.copies.append((q, torch.empty(w.shape[0], dtype=torch.float32, device=w.device)))
        self.requantize()
        logger.info(
            f"FP8 weights: {len(self.copies)} tensors, {self.nbytes / 2**30:.2f} GiB (quantize: {self.impl}, "
            f"prefill GEMM: {self.gemm}, decode steps past the GEMV: {fp8_op.TILE_ROWS_IMPL})"
        )

    @property
    def nbytes(self) -> int:
        """Device bytes of the copies (e4m3 weights and fp32 scales)."""
        return sum(q.numel() + 4 * s.numel() for q, s in self.copies)

    def layer_args(self, layer_args: list[tuple]) -> list[tuple]:
        """``layer_args`` with each quantized weight replaced by its ``(q, scale)`` pair."""
        out, it = [], iter(self.copies)
        for args in layer_args:
            args = list(args)
            for i in WEIGHT_ARGS:
                args[i] = next(it)
            out.append(tuple(args))
        return out

    @torch.no_grad()
    def requantize(self, params: list[torch.Tensor] | None = None) -> int:
        """Quantize again the weights whose storage one of ``params`` shares (None: all); returns how many. A
        weight sync calls it with the parameters it wrote (a fused QKV tensor is one storage with its q/k/v)."""
        ptrs = None if params is None else {p.untyped_storage().data_ptr() for p in params}
        n = 0
        for w, (q, s) in zip(self.sources, self.copies):
            if ptrs is None or w.untyped_storage().data_ptr() in ptrs:
                quantize_fp8_(w, q, s, impl=self.impl)
                n += 1
        return n


def weight_dims(args: tuple) -> dict[str, int]:
    """The in / out features of one layer's quantized weights (a ``layer_args`` tuple), by name."""
    dims = {}
    for name, i in zip(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), WEIGHT_ARGS):
        dims[f"{name} out"], dims[f"{name} in"] = args[i].shape
    return dims
