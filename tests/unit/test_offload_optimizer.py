"""HostOffloadAdamW (--trainer.offload optimizer) against torch.optim.AdamW: same updates, moments on the host,
chunked streaming, and a state_dict round trip that resumes the same trajectory."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from prime_spmd.trainer.offload import HostMasterAdamW, HostOffloadAdamW


def _params(seed: int, device: torch.device) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (11,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]


def _groups(params):
    return [
        {"params": [params[0], params[2]], "weight_decay": 0.1},
        {"params": [params[1], params[3]], "weight_decay": 0.0},
    ]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g).to(p.device)
        p.grad = None if (step == 1 and i == 3) else grad  # one step without a grad


def test_matches_torch_adamw_across_chunks_and_resume(device) -> None:
    """On CUDA (scripts/test_gpu.sh) the moments are pinned host memory and the chunks stream on a side stream."""
    ref_p, off_p = _params(0, device), _params(0, device)
    kw = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6)
    ref = torch.optim.AdamW(_groups(ref_p), foreach=False, **kw)
    # 64 bytes: 8 elements' moments a chunk -> the 35- and 24-element parameters span several chunks, chunks mix
    # parameters' segments, and the device staging stays at 8 elements whatever the largest parameter
    off = HostOffloadAdamW(_groups(off_p), chunk_bytes=64, **kw)
    for step in range(4):
        _grads(ref_p, step)
        _grads(off_p, step)
        ref.step()
        off.step()
        assert off._staging[0].shape == (2, 8)
        assert all(float(off.state[p]["step"]) == step + 1 - (step >= 1 and i == 3) for i, p in enumerate(off_p))
    for a, b in zip(ref_p, off_p):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-7)  # measured max |diff| ~1e-8 (foreach vs per-tensor ops)
    for p in off_p:
        for m in ("exp_avg", "exp_avg_sq"):
            assert off.state[p][m].device.type == "cpu" and off.state[p][m].is_pinned() == (device.type == "cuda")
    # resume: a new optimizer loaded from the state_dict continues exactly like the original
    saved, cont_p = off.state_dict(), [torch.nn.Parameter(p.detach().clone()) for p in off_p]
    resumed = HostOffloadAdamW(_groups(cont_p), chunk_bytes=1 << 20, **kw)
    resumed.load_state_dict(copy.deepcopy(saved))
    assert all(resumed.state[p]["exp_avg"].device.type == "cpu" for p in cont_p)
    for step in range(4, 6):
        _grads(off_p, step)
        _grads(cont_p, step)
        _grads(ref_p, step)
        off.step()
        resumed.step()
        ref.step()
    for a, b, c in zip(off_p, cont_p, ref_p):
        torch.testing.assert_close(b, a, rtol=0, atol=0)  # one chunk or many: the same per-element arithmetic
        torch.testing.assert_close(a, c, rtol=2e-6, atol=2e-7)


def test_pinned_moments_are_registered_at_their_exact_size(monkeypatch) -> None:
    """Pinned moments of at least REGISTER_MIN_BYTES are ordinary host memory of their exact size registered with
    CUDA (torch's pinned allocator would round each up to a power of two), and unregistered with the tensor; smaller
    ones ask torch's pinned allocator. CUDA stands in as a recorder here; tests/gpu/test_offload_gpu.py runs it."""
    from prime_spmd.trainer import offload

    calls: list[tuple] = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - the CUDA runtime's name
            calls.append(("register", ptr, nbytes, flags))
            return 0

        def cudaHostUnregister(self, ptr):  # noqa: N802
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    big = offload._host_zeros(torch.Size([3, 1000]), pin=True, register_min_bytes=12_000)
    assert big.shape == (3, 1000) and not big.any() and big.dtype == torch.float32
    assert calls == [("register", big.data_ptr(), 12_000, 0)]  # 3 x 1000 fp32: exactly its bytes
    ptr = big.data_ptr()
    del big
    gc.collect()
    assert calls[-1] == ("unregister", ptr)
    asked = []
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: asked.append(kw) or torch.empty(0))
    offload._host_zeros(torch.Size([2, 1000]), pin=True, register_min_bytes=12_000)  # below: torch's pinned memory
    offload._host_zeros(torch.Size([3, 1000]), pin=False, register_min_bytes=12_000)  # not pinned: plain memory
    assert [kw.get("pin_memory") for kw in asked] == [True, False] and len(calls) == 2
    monkeypatch.undo()  # torch.zeros back
    fail = FakeCudart()
    fail.cudaHostRegister = lambda *a: 2  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fail)
    with pytest.raises(RuntimeError, match="--trainer.offload optimizer: cudaHostRegister of 12000 bytes"):
        offload._host_zeros(torch.Size([3, 1000]), pin=True, register_min_bytes=12_000)


def _coeffs(params, step: int, micro: int) -> list[torch.Tensor | None]:
    """Micro-batch ``micro`` of ``step``: a bf16 coefficient a parameter (None: one step without a grad for it)."""
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    out = []
    for i, p in enumerate(params):
        out.append(None if (step == 1 and i == 3) else torch.randn(p.shape, generator=g).to(p.device, torch.bfloat16))
    return out


def _backward(params, step: int, micro: int) -> None:
    """One micro-batch's backward into bf16 parameters: the gradient of (p * c).sum() is c, exact in bf16."""
    sum((p * c).float().sum() for p, c in zip(params, _coeffs(params, step, micro)) if c is not None).backward()


def test_master_offload_matches_fp32_adamw_on_bf16_parameters(device) -> None:
    """HostMasterAdamW (--trainer.offload master): bf16 parameters, fp32 masters and moments on the host. Two
    micro-batches a step sum in fp32 through the hooks (no bf16 gradient is left on the parameters); the masters follow
    torch's AdamW over fp32 copies fed the same fp32 sums, each parameter holds its master cast to bf16 in the same
    storage, ``zero_grad`` frees the sums, and a state_dict round trip resumes the same trajectory."""
    kw = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6)
    bf = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params(0, device)]
    ptrs = [p.data_ptr() for p in bf]
    ref_p = [torch.nn.Parameter(p.detach().float()) for p in bf]
    ref = torch.optim.AdamW(_groups(ref_p), foreach=False, **kw)
    off = HostMasterAdamW(_groups(bf), chunk_bytes=96, **kw)  # 8 elements a chunk (three fp32 states each)

    def step(k: int, opt: HostMasterAdamW, params) -> None:
        for micro in range(2):
            _backward(params, k, micro)
        assert all(p.grad is None for p in params)  # taken by the hooks
        want = [
            None if c0 is None else c0.float() + c1.float()
            for c0, c1 in zip(_coeffs(params, k, 0), _coeffs(params, k, 1))
        ]
        got = {id(g): g for g in opt.gradients()}
        assert len(got) == sum(w is not None for w in want)
        for p, w in zip(params, want):
            if w is not None:
                assert torch.equal(opt._acc[p], w)
        opt.step()
        opt.zero_grad()
        assert opt.gradients() == []

    for k in range(4):
        for p, c0, c1 in zip(ref_p, _coeffs(bf, k, 0), _coeffs(bf, k, 1)):
            p.grad = None if c0 is None else c0.float() + c1.float()
        ref.step()
        step(k, off, bf)
        assert off._staging[0].shape == (3, 8)
    for p, r, ptr in zip(bf, ref_p, ptrs):
        master = off.state[p]["master"]
        assert master.device.type == "cpu" and master.dtype == torch.float32
        assert master.is_pinned() == (device.type == "cuda")
        torch.testing.assert_close(master.to(device), r.detach(), rtol=2e-6, atol=2e-7)
        assert torch.equal(p.detach(), master.to(device).to(torch.bfloat16)) and p.data_ptr() == ptr
    saved = off.state_dict()
    cont = [torch.nn.Parameter(p.detach().clone()) for p in bf]
    resumed = HostMasterAdamW(_groups(cont), chunk_bytes=1 << 20, **kw)
    resumed.load_state_dict(copy.deepcopy(saved))
    assert all(resumed.state[p]["master"].device.type == "cpu" for p in cont)
    for k in range(4, 6):
        step(k, off, bf)
        step(k, resumed, cont)
    for a, b in zip(bf, cont):
        assert torch.equal(a, b)
        assert torch.equal(off.state[a]["master"], resumed.state[b]["master"])


def test_master_offload_is_refused_with_several_trainer_ranks_or_lora() -> None:
    from prime_spmd.config.sections import LoraConfig, ModelConfig
    from prime_spmd.trainer.build import check_master_offload

    check_master_offload(ModelConfig(path="m"), 1)
    with pytest.raises(ValueError, match=r"--trainer.offload master runs on one trainer rank \(this job has 2\)"):
        check_master_offload(ModelConfig(path="m"), 2)
    with pytest.raises(ValueError, match=r"--model.lora.rank 8 .* --trainer.offload optimizer"):
        check_master_offload(ModelConfig(path="m", lora=LoraConfig(rank=8)), 1)


@pytest.mark.parametrize("cls", [HostOffloadAdamW, HostMasterAdamW])
def test_resume_keeps_the_host_state_off_torchs_loader(cls, monkeypatch) -> None:
    """torch's ``Optimizer.load_state_dict`` casts every state tensor to its parameter's device and dtype (an 8B run's
    61 GiB of moments onto the device at once; a bf16 parameter's master through bf16): only the step counts go
    through it, and host tensors already in the right form are kept as they are (a DCP resume loads into them)."""
    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16 if cls is HostMasterAdamW else torch.float32))
              for p in _params(0, torch.device("cpu"))]  # fmt: skip
    opt = cls(_groups(params), lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    seen: list[set] = []
    real = torch.optim.Optimizer.load_state_dict

    def spy(self, sd):
        seen.append({n for s in sd["state"].values() for n in s})
        return real(self, sd)

    monkeypatch.setattr(torch.optim.Optimizer, "load_state_dict", spy)
    cont = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = cls(_groups(cont), lr=1e-2)
    resumed.load_state_dict(saved)
    assert seen == [{"step"}]
    for p, q in zip(params, cont):
        for name in cls.HOST:
            assert resumed.state[q][name] is opt.state[p][name] and resumed.state[q][name].dtype == torch.float32
        assert float(resumed.state[q]["step"]) == 1.0
