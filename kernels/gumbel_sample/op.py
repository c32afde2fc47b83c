"""The entry point the native engine uses: ``gumbel_sample(..., impl=...)``.

``reference``: pure PyTorch (reference.py), any device. ``triton``: the kernels (kernel.py) as the
``torch.library`` op ``prime_spmd::gumbel_sample``, with a fake impl so it sits inside ``torch.compile`` and
CUDA-graph capture. Inference only: no backward.

Legend: see reference.py (B rows, V vocabulary).
"""

from __future__ import annotations

from typing import Literal

import torch

from kernels.gumbel_sample.reference import gumbel_sample_reference

GumbelSampleImpl = Literal["reference", "triton"]


def check_inputs(logits_BV, temperature_B, seeds_B, steps_B) -> None:
    """ValueError naming the bad shape or dtype (host-side metadata only: no device sync)."""
    if logits_BV.ndim != 2 or logits_BV.stride(-1) != 1:
        raise ValueError(
            f"gumbel_sample: logits must be [B, V] with a contiguous last dim, got {tuple(logits_BV.shape)}"
        )
    b = logits_BV.shape[0]
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
    from kernels.gumbel_sample import kernel

    return kernel.gumbel_sample(logits_BV, temperature_B, seeds_B, steps_B)


@gumbel_sample_op.register_fake
def _(logits_BV, temperature_B, seeds_B, steps_B):
    b = logits_BV.shape[0]
    return logits_BV.new_empty(b, dtype=torch.int64), logits_BV.new_empty(b, dtype=torch.float32)
