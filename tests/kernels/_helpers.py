"""What the LM-head kernel tests share: NaN-poisoned buffers, the relative error, and the random inputs."""

import torch


def nan_empty(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stands in for a kernel's empty-buffer helper: NaN everywhere, so an unwritten element fails a comparison."""
    return torch.full(shape, float("nan"), device=like.device, dtype=dtype)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp32."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def make_lm_head_inputs(num_tokens, hidden_size, vocab, dtype, temperature, gen: torch.Generator):
    """(hidden_NH, weight_VH, targets_N, temperature) drawn from ``gen``, which the caller keeps drawing from.

    Targets include both vocabulary edges; temperature "per_token" becomes a [N] tensor in [0.5, 1.5).
    """
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    targets[0], targets[-1] = 0, vocab - 1  # vocabulary edges
    if temperature == "per_token":
        temperature = torch.rand(num_tokens, generator=gen) + 0.5
    return hidden, weight, targets, temperature
