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
    """(hidden_TD, weight_VD, targets_T, temperature) on ``device``, drawn from the CPU generator ``gen``,
    which the caller keeps drawing from.

    Targets include both vocabulary edges; temperature "per_token" becomes a [T] tensor in [0.5, 1.5).
    """
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    targets[0], targets[-1] = 0, vocab - 1  # vocabulary edges
    if temperature == "per_token":
        temperature = (torch.rand(num_tokens, generator=gen) + 0.5).to(device)
    return hidden, weight, targets.to(device), temperature


def pin_one_config(monkeypatch, autotuners, test_id: str, fits=None) -> None:
    """On CUDA, restrict each Triton autotuner to one of its configs, picked by a hash of the test id
    among those for which ``fits(config)`` holds (all when ``fits`` is None).

    Each autotuned kernel compiles every config for every new specialization (dtype, EVEN_D, the
    divisibility of each int argument), and the tiny cases hit many; one config per test keeps the
    compile count to about one per specialization, while the grid as a whole runs different configs.
    The autotuner skips a config that cannot launch (OutOfResources) only when it has several: a pinned
    one must launch, hence ``fits``. Real shapes, fully autotuned: tests/gpu/.
    A no-op without CUDA (the interpreter runs one fixed config).
    """
    if not torch.cuda.is_available():
        return
    index = zlib.crc32(test_id.encode())
    for tuner in autotuners:
        configs = [c for c in tuner.configs if fits is None or fits(c)]
        if not configs:
            name = getattr(getattr(tuner, "base_fn", None), "__name__", "autotuner")
            raise ValueError(f"no config of {name} fits: {[str(c) for c in tuner.configs]}")
        monkeypatch.setattr(tuner, "configs", [configs[index % len(configs)]])


def max_shared_memory() -> int:
    """Bytes of shared memory one Triton program may use on the current GPU (Triton's launch limit)."""
    import triton

    return triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())["max_shared_mem"]


def lm_head_shared_memory(config, element_size: int = 4) -> int:
    """Estimated shared memory of the LM-head kernels (kernels/lm_logprob/kernel.py) for one config:
    the pipelined loop over D keeps num_stages - 1 copies of the [BLOCK_T, BLOCK_D] hidden and
    [BLOCK_D, BLOCK_V] weight tiles. fp32 (element_size 4) is the largest case.

    On the H200 (227 KiB, run 1 of scripts/test_gpu.sh), the two fp32 tests pinned to 64 x 256 x 64 in
    4 stages (240 KiB by this estimate) failed and every fp32 test pinned to another config (<= 192 KiB)
    passed; tests/kernels/test_lm_logprob.py::test_unfit_configs_are_out_of_resources checks the cause.
    """
    kw = config.kwargs
    return (config.num_stages - 1) * (kw["BLOCK_T"] + kw["BLOCK_V"]) * kw["BLOCK_D"] * element_size


def lm_head_config_fits(config) -> bool:
    """Whether an LM-head config fits the current GPU's shared memory with fp32 inputs (the estimate above)."""
    return lm_head_shared_memory(config) <= max_shared_memory()
