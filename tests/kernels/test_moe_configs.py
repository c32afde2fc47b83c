"""MoE launch configs (kernels/moe/configs.py): the table's pick is a valid config for every shape, dtype and
shared-memory budget; the default path compiles from the table and never autotunes; the opt-in switch
(configs.AUTOTUNE / PRIME_SPMD_MOE_AUTOTUNE=1) launches every kernel through its autotuner.

The GPU picks are checked on CPU by turning the interpreter flag off inside ``configs`` (host logic only).
The launches run at tiny shapes on the ``device`` fixture: under TRITON_INTERPRET=1 on CPU (about 10 s for
the file on the 2-core CPU box), compiled on CUDA (there the autotuners get 2 configs each, not 8).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from prime_spmd.kernels.moe import configs, kernel
from prime_spmd.kernels.moe.op import moe_experts

ROOT = Path(__file__).resolve().parents[2]
DIMS = [1, 16, 20, 48, 100, 768, 1536, 2048, 4096, 5000]
# opt-in shared memory per block: RTX 4090 / A100 / H100 and H200 (Triton's max_shared_mem)
BUDGETS = [101376, 166912, 232448]
H200_SMEM = 232448
QWEN3_30B = dict(D=2048, I=768)  # Qwen3-30B-A3B hidden and expert intermediate


@pytest.fixture
def gpu_picks(monkeypatch):
    """``configs.pick`` as on GPU (interpreter flag off, fresh memo)."""
    monkeypatch.setattr(configs, "INTERPRET", False)
    monkeypatch.setattr(configs, "PICKS", {})


def _pick(kernel_name: str, N: int, K: int, elem_bytes: int, budget: int, MW: int | None = None) -> dict:
    c = configs.pick(kernel_name, N, K, block_m=128, elem_bytes=elem_bytes, smem_budget=budget, MW=MW)
    return configs.describe(c)


@pytest.mark.parametrize("kernel_name", configs.KERNELS)
def test_pick_is_valid_for_every_shape(gpu_picks, kernel_name):
    for N in DIMS:
        for K in DIMS:
            for elem_bytes in (2, 4):
                for budget in BUDGETS:
                    MW = K if kernel_name == "grouped_wgrad" else None
                    c = _pick(kernel_name, N, K, elem_bytes, budget, MW)
                    where = (kernel_name, N, K, elem_bytes, budget, c)
                    assert configs.smem_bytes(kernel_name, c, elem_bytes, 128) <= budget, where
                    assert c["num_warps"] in (4, 8) and c["num_stages"] >= 2, where
                    for field in ("BLOCK_N", "BLOCK_K", "BLOCK_MW"):
                        if field in c:
                            assert c[field] >= 16 and c[field] == triton.next_power_of_2(c[field]), where
                    assert c["BLOCK_N"] <= max(16, triton.next_power_of_2(N)), where
                    if MW is not None:
                        assert c["BLOCK_MW"] <= max(16, triton.next_power_of_2(MW)), where
                    else:
                        assert c["BLOCK_K"] <= max(16, triton.next_power_of_2(K)), where


def test_qwen3_30b_picks_are_table_rows_inside_the_search_space(gpu_picks):
    """At the benchmarked shape (bf16, H200) nothing is clamped, and each pick is one the autotuner tries,
    so full autotune can only match or beat it."""
    D, inter = QWEN3_30B["D"], QWEN3_30B["I"]
    gemms = [  # the launches of one forward + backward (op.py)
        ("gate_up", inter, D, None),
        ("grouped_gemm", D, inter, None),  # down projection
        ("dz_swiglu_bwd", inter, D, None),
        ("grouped_gemm", D, 2 * inter, None),  # dx
        ("grouped_wgrad", inter, 1, D),  # dw2
        ("grouped_wgrad", D, 1, 2 * inter),  # dw13
    ]
    for name, N, K, MW in gemms:
        c = _pick(name, N, K, 2, H200_SMEM, MW)
        assert c == configs.TABLE[(name, N >= configs.WIDE_N)], (name, N, K, c)
        assert c in [configs.describe(s) for s in configs.gpu_search_space(name)], (name, c)


def test_pick_errors_name_the_bad_value(gpu_picks):
    with pytest.raises(ValueError, match="unknown MoE kernel 'gate'"):
        _pick("gate", 64, 64, 2, H200_SMEM)
    with pytest.raises(ValueError, match="N=0"):
        _pick("gate_up", 0, 64, 2, H200_SMEM)
    with pytest.raises(ValueError, match="fits 1024 bytes"):
        _pick("gate_up", 768, 2048, 2, 1024)


def _case(device: torch.device, seed: int = 0):
    T, K, D, E, inter = 37, 2, 48, 6, 24
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    tensors = [
        torch.randn(T, D, generator=gen),
        torch.rand(T, K, generator=gen),
        torch.randn(E, 2 * inter, D, generator=gen) * D**-0.5,
        torch.randn(E, D, inter, generator=gen) * inter**-0.5,
    ]
    return ids.to(device), [t.to(device) for t in tensors], torch.randn(T, D, generator=gen).to(device)


def _fwd_bwd(impl: str, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """``impl`` on the case's values rounded to ``dtype``; the reference computes in fp32 on those values."""
    ids, tensors, dout = _case(device)
    rounded = [t.to(dtype) for t in tensors]
    leaves = [(t if impl == "triton" else t.float()).requires_grad_() for t in rounded]
    y = moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], impl=impl)
    return [y, *torch.autograd.grad(y, leaves, dout.to(y.dtype))]


class _Spy:
    """Stands in for an autotuner in kernel.TUNED and counts its launches."""

    def __init__(self, tuner, calls: list[str], name: str):
        self.tuner, self.calls, self.name = tuner, calls, name

    def __getitem__(self, grid):
        self.calls.append(self.name)
        return self.tuner[grid]


@pytest.mark.parametrize("autotune", [False, True])
def test_switch_routes_launches(monkeypatch, autotune, device):
    """Default: every kernel launches with a table pick and no autotuner runs. AUTOTUNE: every kernel goes
    through its autotuner and pick() is not consulted. Both match the fp32 reference (fp32 under the
    interpreter; bf16 on CUDA, where fp32 tiles would run as TF32)."""
    calls: list[str] = []
    monkeypatch.setattr(configs, "AUTOTUNE", autotune)
    monkeypatch.setattr(configs, "PICKS", {})
    if device.type == "cuda":  # two configs with different tiles (dz's reset_to_zero matters), fresh caches
        for tuner in kernel.TUNED.values():
            first = tuner.configs[0]
            other = next(c for c in tuner.configs if c.kwargs != first.kwargs)
            monkeypatch.setattr(tuner, "configs", [first, other])
            monkeypatch.setattr(tuner, "cache", {})
    monkeypatch.setattr(kernel, "TUNED", {name: _Spy(t, calls, name) for name, t in kernel.TUNED.items()})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    got = _fwd_bwd("triton", device, dtype)
    picked = {key[0] for key in configs.PICKS}
    if autotune:
        assert set(calls) == set(configs.KERNELS) and not picked, (calls, picked)
    else:
        assert not calls and picked == set(configs.KERNELS), (calls, picked)
    ref = _fwd_bwd("reference", device, dtype)
    # test_moe.py measured max rel. errors of 5.3e-7 (fp32, interpreter) and 1.1e-2 (bf16 vs the fp32 reference)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    for name, a, b in zip(["out", "dx", "dweights", "dw13", "dw2"], got, ref):
        rel = ((a.float() - b).abs().max() / b.abs().max()).item()
        assert rel < tol, (name, rel)


def test_env_var_turns_autotune_on():
    code = "from prime_spmd.kernels.moe import configs; print(configs.AUTOTUNE)"
    for value, expected in (("1", "True"), ("0", "False")):
        env = dict(os.environ, PRIME_SPMD_MOE_AUTOTUNE=value)
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip() == expected, (value, out.stdout, out.stderr)
