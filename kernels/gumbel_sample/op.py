"""The entry point the native engine uses: ``gumbel_sample(..., impl=...)``.

``reference``: pure PyTorch (reference.py), any device. ``triton``: the kernels (kernel.py) as the
``torch.library`` op ``prime_spmd::gumbel_sample``, with a fake impl so it sits inside ``torch.compile`` and
CUDA-graph capture. Inference only: no backward.

Legend: see reference.py (B rows, V vocabulary).
"""

from __future__ import annotations

from typing import Literal

import torch
from prime_spmd.kernels.gumbel_sample.reference import gumbel_sample_lm_head_reference, gumbel_sample_reference

GumbelSampleImpl = Literal["reference", "triton"]


def check_inputs(logits_BV, temperature_B, seeds_B, steps_B) -> None:
    """ValueError naming the bad shape or dtype (host-side metadata only: no device sync)."""
    if logits_BV.ndim != 2 or logits_BV.stride(-1) != 1:
        raise ValueError(
            f"gumbel_sample: logits must be [B, V] with a contiguous last dim, got {tuple(logits_BV.shape)}"
        )
    _check_rows(logits_BV.shape[0], temperature_B, seeds_B, steps_B)


def _check_rows(b: int, temperature_B, seeds_B, steps_B) -> None:
    """ValueError unless the per-row parameters are [b] of their dtypes."""
    for name, t, dtype in (("temperature", temperature_B, torch.float32), ("seeds", seeds_B, torch.int64),
                           ("steps", steps_B, torch.int64)):  # fmt: skip
        if tuple(t.shape) != (b,) or t.dtype != dtype:
            raise ValueError(f"gumbel_sample: {name} must be {dtype} [{b}], got {t.dtype} {list(t.shape)}")


def gumbel_sample(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    seeds_B: torch.Tensor,
    steps_B: torch.Tensor,
    impl: GumbelSampleImpl = "reference",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], logprobs float32 [B]): one Gumbel-max sample per row (greedy where temperature <= 0)
    and its log-probability under ``log_softmax(logits / T)`` (reference.py). No side effects."""
    check_inputs(logits_BV, temperature_B, seeds_B, steps_B)
    if impl == "reference":
        return gumbel_sample_reference(logits_BV, temperature_B, seeds_B, steps_B)
    if impl == "triton":
        return torch.ops.prime_spmd.gumbel_sample(logits_BV, temperature_B, seeds_B, steps_B)
    raise ValueError(f"unknown gumbel sample impl {impl!r}; choose reference or triton")


@torch.library.custom_op("prime_spmd::gumbel_sample", mutates_args=())
def gumbel_sample_op(
    logits_BV: torch.Tensor, temperature_B: torch.Tensor, seeds_B: torch.Tensor, steps_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels (kernel.gumbel_sample); inputs as ``gumbel_sample`` above."""
    from prime_spmd.kernels.gumbel_sample import kernel

    return kernel.gumbel_sample(logits_BV, temperature_B, seeds_B, steps_B)


@gumbel_sample_op.register_fake
def _(logits_BV, temperature_B, seeds_B, steps_B):
    b = logits_BV.shape[0]
    return logits_BV.new_empty(b, dtype=torch.int64), logits_BV.new_empty(b, dtype=torch.float32)


def gumbel_sample_lm_head(
    hidden_BD: torch.Tensor,
    weight_VD: torch.Tensor,
    temperature_B: torch.Tensor,
    seeds_B: torch.Tensor,
    steps_B: torch.Tensor,
    impl: GumbelSampleImpl = "reference",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gumbel_sample`` of the logits ``hidden_BD @ weight_VD.T`` (fp32 accumulation). "triton" computes them
    tile by tile inside the sampling kernel (never written out), for B <= ``kernel.LM_HEAD_MAX_ROWS``."""
    from prime_spmd.kernels.gumbel_sample.kernel import LM_HEAD_MAX_ROWS

    if hidden_BD.ndim != 2 or weight_VD.ndim != 2 or hidden_BD.shape[1] != weight_VD.shape[1]:
        raise ValueError(
            f"gumbel_sample_lm_head: want hidden [B, D] and weight [V, D]; got {tuple(hidden_BD.shape)}, "
            f"{tuple(weight_VD.shape)}"
        )
    if hidden_BD.dtype != weight_VD.dtype or hidden_BD.stride(-1) != 1 or weight_VD.stride(-1) != 1:
        raise ValueError(
            f"gumbel_sample_lm_head: hidden ({hidden_BD.dtype}) and weight ({weight_VD.dtype}) need one dtype and "
            "contiguous last dims"
        )
    _check_rows(hidden_BD.shape[0], temperature_B, seeds_B, steps_B)
    if impl == "reference":
        return gumbel_sample_lm_head_reference(hidden_BD, weight_VD, temperature_B, seeds_B, steps_B)
    if impl != "triton":
        raise ValueError(f"unknown gumbel sample impl {impl!r}; choose reference or triton")
    if hidden_BD.shape[0] > LM_HEAD_MAX_ROWS:
        raise ValueError(f"gumbel_sample_lm_head: at most {LM_HEAD_MAX_ROWS} rows, got {hidden_BD.shape[0]}")
    return torch.ops.prime_spmd.gumbel_sample_lm_head(hidden_BD, weight_VD, temperature_B, seeds_B, steps_B)


@torch.library.custom_op("prime_spmd::gumbel_sample_lm_head", mutates_args=())
def gumbel_sample_lm_head_op(
    hidden_BD: torch.Tensor,
    weight_VD: torch.Tensor,
    temperature_B: torch.Tensor,
    seeds_B: torch.Tensor,
    steps_B: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels (kernel.gumbel_sample_lm_head); inputs as ``gumbel_sample_lm_head`` above."""
    from prime_spmd.kernels.gumbel_sample import kernel

    return kernel.gumbel_sample_lm_head(hidden_BD, weight_VD, temperature_B, seeds_B, steps_B)


@gumbel_sample_lm_head_op.register_fake
def _(hidden_BD, weight_VD, temperature_B, seeds_B, steps_B):
    b = hidden_BD.shape[0]
    return hidden_BD.new_empty(b, dtype=torch.int64), hidden_BD.new_empty(b, dtype=torch.float32)
