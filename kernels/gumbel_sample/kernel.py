"""Triton Gumbel-max sampling (see reference.py for the math) in two launches, split over the vocabulary.

1. ``_partials_kernel``, grid (S vocab chunks, row blocks): each program streams its chunk of its rows' logits
   once (one row per program for ``gumbel_sample``; for ``gumbel_sample_lm_head`` up to 64 rows whose logits it
   computes from the LM head's input, FROM_HIDDEN) and keeps per row, in fp32: the running max and sum of exp (online softmax), the best ``x + g`` with its index and
   its x, and the best x with its index (greedy). The noise is hashed in the kernel (uint32 arithmetic, the
   reference's int64 ``& MASK32`` products wrap the same way), so it costs no memory traffic.
2. ``_combine_kernel``, grid (B,): merges a row's S partials into the token and ``x[token] - logZ``.
Splitting the vocabulary gives every row S programs: one program per row (what a compiled torch sampler
reduces with) leaves most of the GPU idle at small batch sizes. Ties go to the lowest index, as torch.argmax.

``-log1p(-w)`` is computed as ``log(y) * z / (y - 1)`` with ``z = -w``, ``y = 1 + z`` (exact where y == 1:
z), accurate to a few ulps with ``tl.log`` alone (libdevice's log1p is not available under the interpreter).
So the noise can differ from the reference's in the last bits: a token can differ only where two candidates'
``x + g`` tie to within that.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from prime_spmd.kernels.gumbel_sample import reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _const(value: int):
    """A module constant for jit code: compiled kernels may read globals only as ``tl.constexpr`` (else a compile
    error on the GPU, which the interpreter does not raise), while the interpreter wants plain ints (``1 << c`` of
    a constexpr c fails there)."""
    return value if INTERPRET else tl.constexpr(value)


MASK32 = _const(reference.MASK32)
NOISE_BITS = _const(reference.NOISE_BITS)
SEED_SALT = _const(reference.SEED_SALT)
VOCAB_SALT = _const(reference.VOCAB_SALT)


@triton.jit
def _mix32(x):
    """reference.mix32 on uint32 (multiplication wraps mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 16)
    x = x * 0x297A2D39
    x = x ^ (x >> 15)
    return x


@triton.jit
def _row_key(seed, step):
    """reference.row_keys: int64 seed and step -> uint32 key."""
    key = _mix32((seed & MASK32).to(tl.uint32) ^ SEED_SALT)
    key = _mix32(key ^ ((seed >> 32) & MASK32).to(tl.uint32))
    return _mix32(key ^ (step & MASK32).to(tl.uint32))


@triton.jit
def _gumbel(key, offs):
    """Gumbel noise -log(e) of (key, vocab index), e = reference.exponential_from_bits of the hashed bits; key and
    offs broadcast. ``-log1p(-w)`` as ``log(y) z / (y - 1)`` (module docstring)."""
    bits = _mix32(key ^ _mix32(offs.to(tl.uint32) + VOCAB_SALT)) >> (32 - NOISE_BITS)
    scale = 1.0 / (1 << NOISE_BITS)
    u = (bits.to(tl.float32) + 0.5) * scale  # exact below 2^23
    z = -((((1 << NOISE_BITS) - 1 - bits).to(tl.float32) + 0.5) * scale)  # -w = u - 1, exact from 2^23 on
    y = 1.0 + z
    log1p_z = tl.where(y == 1.0, z, tl.log(y) * z / (y - 1.0))
    e = tl.where(bits < (1 << (NOISE_BITS - 1)), -tl.log(u), -log1p_z)
    return -tl.log(e)


@triton.jit
def _partials_kernel(
    src_ptr, w_ptr, temp_ptr, seeds_ptr, steps_ptr, part_f_ptr, part_i_ptr,
    B, V, D, CHUNK, S, s_src, swv, stt, sts, stp,
    BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, FROM_HIDDEN: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One vocab chunk (axis 0) of a block of BLOCK_B rows (axis 1): per row, the running max and sum of exp of
    x = logits / T (online softmax), the best ``x + g`` with its index and its x, and the index of the best x
    (greedy), stored as the chunk's partials. The logits are ``src`` [B, V] (fp32), or with FROM_HIDDEN computed
    tile by tile from the LM head's input ``src`` [B, D] and weight ``w`` [V, D] (fp32 accumulation), never
    written to memory, each chunk of ``w`` read once for all BLOCK_B rows. Ties keep the lowest index."""
    s = tl.program_id(0)
    pb = tl.program_id(1)
    rows = pb * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = rows < B
    t = tl.load(temp_ptr + rows * stt, mask=mask_b, other=1.0)
    t = tl.where(t <= 0, 1.0, t)
    seed = tl.load(seeds_ptr + rows * sts, mask=mask_b, other=0)
    step = tl.load(steps_ptr + rows * stp, mask=mask_b, other=0)
    key = _row_key(seed, step)
    lanes = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    m_run = tl.full([BLOCK_B], neg_inf, tl.float32)  # max of x: also the greedy candidate's value
    l_run = tl.zeros([BLOCK_B], tl.float32)
    top_i = tl.zeros([BLOCK_B], tl.int32)
    best = tl.full([BLOCK_B], neg_inf, tl.float32)
    best_x = tl.full([BLOCK_B], neg_inf, tl.float32)
    best_i = tl.zeros([BLOCK_B], tl.int32)
    start = s * CHUNK
    stop = tl.minimum(start + CHUNK, V)
    for v0 in range(start, stop, BLOCK_V):
        offs_v = v0 + lanes
        mask_v = offs_v < stop
        if FROM_HIDDEN:
            rd = tl.arange(0, BLOCK_D)
            acc = tl.zeros([BLOCK_B, BLOCK_V], tl.float32)
            for d0 in range(0, D, BLOCK_D):
                offs_d = d0 + rd
                mask_d = offs_d < D
                h = tl.load(
                    src_ptr + rows[:, None] * s_src + offs_d[None, :], mask=mask_b[:, None] & mask_d[None, :], other=0.0
                )
                w = tl.load(
                    w_ptr + offs_v[:, None] * swv + offs_d[None, :], mask=mask_v[:, None] & mask_d[None, :], other=0.0
                )
                if UPCAST:
                    h = h.to(tl.float32)
                    w = w.to(tl.float32)
                if IEEE:
                    acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
                else:
                    acc = tl.dot(h, tl.trans(w), acc)
        else:
            acc = tl.load(
                src_ptr + rows[:, None] * s_src + offs_v[None, :], mask=mask_b[:, None] & mask_v[None, :], other=0.0
            ).to(tl.float32)
        x = tl.where(mask_v[None, :], acc / t[:, None], neg_inf)
        tile_max = tl.max(x, 1)
        top_i = tl.where(tile_max > m_run, v0 + tl.argmax(x, 1), top_i)  # strict: an earlier tile keeps a tie
        m_new = tl.maximum(m_run, tile_max)
        l_run = l_run * tl.exp(m_run - m_new) + tl.sum(tl.where(mask_v[None, :], tl.exp(x - m_new[:, None]), 0.0), 1)
        m_run = m_new
        score = tl.where(mask_v[None, :], x + _gumbel(key[:, None], offs_v[None, :]), neg_inf)
        tile_best = tl.max(score, 1)
        arg = tl.argmax(score, 1)
        upd = tile_best > best
        x_at = tl.sum(tl.where(lanes[None, :] == arg[:, None], x, 0.0), 1)
        best_x = tl.where(upd, x_at, best_x)
        best_i = tl.where(upd, v0 + arg, best_i)
        best = tl.where(upd, tile_best, best)
    pf = part_f_ptr + (rows * S + s) * 4
    tl.store(pf + 0, m_run, mask=mask_b)
    tl.store(pf + 1, l_run, mask=mask_b)
    tl.store(pf + 2, best, mask=mask_b)
    tl.store(pf + 3, best_x, mask=mask_b)
    pi = part_i_ptr + (rows * S + s) * 2
    tl.store(pi + 0, best_i, mask=mask_b)
    tl.store(pi + 1, top_i, mask=mask_b)


@triton.jit
def _combine_kernel(
    temp_ptr, part_f_ptr, part_i_ptr, tokens_ptr, logprobs_ptr,
    S, stt,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < S
    neg_inf = float("-inf")
    pf = part_f_ptr + (b * S + offs) * 4
    m = tl.load(pf + 0, mask=mask, other=neg_inf)
    l_ = tl.load(pf + 1, mask=mask, other=0.0)
    best = tl.load(pf + 2, mask=mask, other=neg_inf)
    best_x = tl.load(pf + 3, mask=mask, other=neg_inf)
    pi = part_i_ptr + (b * S + offs) * 2
    best_i = tl.load(pi + 0, mask=mask, other=0)
    top_i = tl.load(pi + 1, mask=mask, other=0)
    m_all = tl.max(m, 0)
    log_z = m_all + tl.log(tl.sum(tl.where(mask, l_ * tl.exp(m - m_all), 0.0), 0))
    s_best = tl.argmax(best, 0)  # first chunk on a tie: the lowest index
    tok = tl.sum(tl.where(offs == s_best, best_i, 0), 0)
    x_tok = tl.max(tl.where(offs == s_best, best_x, neg_inf), 0)
    s_top = tl.argmax(m, 0)
    greedy = tl.load(temp_ptr + b * stt) <= 0
    tok = tl.where(greedy, tl.sum(tl.where(offs == s_top, top_i, 0), 0), tok)
    x_tok = tl.where(greedy, m_all, x_tok)
    tl.store(tokens_ptr + b, tok.to(tl.int64))
    tl.store(logprobs_ptr + b, x_tok - log_z)


def num_chunks(rows: int, vocab: int, block_v: int, device: torch.device, per_sm: int = 2) -> int:
    """Vocab chunks per row: enough programs to fill the GPU about ``per_sm`` times (rows x chunks), at least one
    tile each; the interpreter takes 3 chunks at most, so tests cover the merge cheaply."""
    tiles = triton.cdiv(vocab, block_v)
    if INTERPRET or device.type != "cuda":
        return min(3, tiles)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, triton.cdiv(per_sm * sms, rows), 1024))


def _sample(src, weight, temperature_B, seeds_B, steps_B, vocab, chunks, block_b, block_v, block_d, warps, stages):
    """Launch ``_partials_kernel`` over ``chunks`` vocab chunks x row blocks of ``block_b`` (``weight`` None: ``src``
    holds the logits), then ``_combine_kernel``; (tokens, logprobs)."""
    B, dev = src.shape[0], src.device
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), block_v) * block_v  # whole tiles per chunk
    s = triton.cdiv(vocab, chunk)
    part_f = torch.empty(B, s, 4, device=dev, dtype=torch.float32)
    part_i = torch.empty(B, s, 2, device=dev, dtype=torch.int32)
    tokens = torch.empty(B, device=dev, dtype=torch.int64)
    logprobs = torch.empty(B, device=dev, dtype=torch.float32)
    from_hidden = weight is not None
    _partials_kernel[(s, triton.cdiv(B, block_b))](
        src, weight if from_hidden else src, temperature_B, seeds_B, steps_B, part_f, part_i,
        B, vocab, src.shape[1] if from_hidden else 0, chunk, s, src.stride(0), weight.stride(0) if from_hidden else 0,
        temperature_B.stride(0), seeds_B.stride(0), steps_B.stride(0),
        BLOCK_B=block_b, BLOCK_V=block_v, BLOCK_D=block_d, FROM_HIDDEN=from_hidden, UPCAST=INTERPRET,
        IEEE=src.dtype == torch.float32 and not INTERPRET, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    _combine_kernel[(B,)](
        temperature_B, part_f, part_i, tokens, logprobs, s, temperature_B.stride(0), BLOCK_S=triton.next_power_of_2(s)
    )
    return tokens, logprobs


def gumbel_sample(
    logits_BV: torch.Tensor, temperature_B: torch.Tensor, seeds_B: torch.Tensor, steps_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], logprobs float32 [B]) as reference.gumbel_sample_reference; logits' last dim contiguous,
    the [B] inputs any stride (the engine passes columns of its sampling-parameter tables). One row per program."""
    B, V = logits_BV.shape
    block_v = 64 if INTERPRET else 1024
    chunks = num_chunks(B, V, block_v, logits_BV.device)
    return _sample(
        logits_BV, None, temperature_B, seeds_B, steps_B, V, chunks, 1, block_v, 16, 4, 1 if INTERPRET else 3
    )


LM_HEAD_MAX_ROWS = 64
"""Rows the fused LM-head sampler takes in one row block (so each chunk of the weight is read once)."""
LM_HEAD_PROGRAMS_PER_SM = 2
"""Programs per SM the fused LM-head sampler aims at. Its bf16 configs run one
program per SM (226-248 registers x 8 warps), so 2 is two waves; at Qwen3's 151,936-row head in 128-row tiles that
rounds to 238 programs of 5 tiles on 132 SMs (the second wave 80% full), 1 to 132 programs of 9 (one full wave)."""


def lm_head_config(block_b: int, elsize: int) -> tuple[int, int, int, int]:
    """(BLOCK_V, BLOCK_D, num_warps, num_stages) of ``_partials_kernel`` with FROM_HIDDEN for ``block_b`` rows of
    ``elsize``-byte inputs: the widest vocab tile that compiles for sm_90 without register spills (cuobjdump of the
    sm_90 build, tests/kernels/sm90_compile.py, 2026-12-04: 128 x 64 tiles at 8 warps use 226-248 registers for
    16-64 bf16 rows; 4 warps or 128-wide hidden tiles spilled up to 2.3 KB; fp32 at 64 rows needs 64-wide vocab
    tiles). Not timed on a GPU yet. Interpreter: small tiles, so tests cover ragged edges."""
    if INTERPRET:
        return 16, 32, 4, 1
    block_v = 64 if elsize == 4 and block_b > 16 else 128
    return block_v, 64, 8, 3 if elsize == 2 else 2


def gumbel_sample_lm_head(
    hidden_BD: torch.Tensor,
    weight_VD: torch.Tensor,
    temperature_B: torch.Tensor,
    seeds_B: torch.Tensor,
    steps_B: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gumbel_sample`` of the logits ``hidden_BD @ weight_VD.T`` (fp32 accumulation), computed tile by tile
    inside the sampling kernel instead of written out. ``hidden`` and ``weight`` in one float dtype with
    contiguous last dims; B <= ``LM_HEAD_MAX_ROWS`` (one row block)."""
    B = hidden_BD.shape[0]
    V = weight_VD.shape[0]
    assert B <= LM_HEAD_MAX_ROWS, B
    block_b = max(16, triton.next_power_of_2(B))
    block_v, block_d, warps, stages = lm_head_config(block_b, hidden_BD.element_size())
    chunks = num_chunks(1, V, block_v, hidden_BD.device, LM_HEAD_PROGRAMS_PER_SM)
    return _sample(hidden_BD, weight_VD, temperature_B, seeds_B, steps_B, V, chunks, block_b, block_v, block_d,
                   warps, stages)  # fmt: skip
