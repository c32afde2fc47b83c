"""What the LM-head kernel tests share: NaN-poisoned buffers, the relative error, and the random inputs.

Inputs are drawn on the CPU from a seeded generator and then moved to the test's device, so a CUDA run
checks the same numbers as the CPU run (the Triton kernels never see a CPU tensor on a GPU machine).
"""

import zlib

import torch


def nan_empty(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stands in for a kernel's empty-buffer helper: NaN everywhere, so an unwritten element fails a comparison."""
    return torch.full(shape, float("nan"), device=like.device, dtype=dtype)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp32."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def make_lm_head_inputs(num_tokens, hidden_size, vocab, dtype, temperature, gen: torch.Generator, device="cpu"):
    """(hidden_NH, weight_VH, targets_N, temperature) on ``device``, drawn from the CPU generator ``gen``,
    which the caller keeps drawing from.

    Targets include both vocabulary edges; temperature "per_token" becomes a [N] tensor in [0.5, 1.5).
    """
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    targets[0], targets[-1] = 0, vocab - 1  # vocabulary edges
    if temperature == "per_token":
        temperature = (torch.rand(num_tokens, generator=gen) + 0.5).to(device)
    return hidden, weight, targets.to(device), temperature


def pin_one_config(monkeypatch, autotuners, test_id: str) -> None:
    """On CUDA, restrict each Triton autotuner to one of its configs, picked by a hash of the test id.

    Each autotuned kernel compiles every config for every new specialization (dtype, EVEN_K, the
    divisibility of each int argument), and the tiny cases hit many; one config per test keeps the
    compile count to about one per specialization, while the grid as a whole runs different configs.
    Real shapes, fully autotuned: tests/gpu/. A no-op without CUDA (the interpreter runs one fixed config).
    """
    if not torch.cuda.is_available():
        return
    index = zlib.crc32(test_id.encode())
    for tuner in autotuners:
        monkeypatch.setattr(tuner, "configs", [tuner.configs[index % len(tuner.configs)]])
