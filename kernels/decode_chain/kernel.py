"""Triton decode chain (see reference.py for the math): all decoder layers of a one-row decode step in ONE launch.

Why: at batch 1 the fused decode step is ~5 short kernels a layer (Qwen3-0.6B: 140, each 3-6 us on an H200 while
its weights alone would stream in ~1-2 us; docs/inference.md, batch-1 profile): launch, ramp and the wait for
the kernel before it cost more than the bytes. Here each layer is five phases of work items in one grid:

    qkv   GEMV items (``BN_QKV`` columns each) of RMSNorm(x) @ qkv_w.T          kernels/decode_linear.gemv_preloaded
    attn  (kv head, length split) items of the fused attention                 kernels/decode_attention.split_program
    o     GEMV items of o @ o_w.T + x                                          -> xm
    gu    GEMV items of silu(gate) * up of RMSNorm(xm)                         -> h
    down  GEMV items of h @ down_w.T + xm                                      -> the next layer's x

Every program first takes a ticket (an atomic counter): tickets are handed out in (layer, phase, item) order,
whatever order the hardware starts programs in. An item loads what no program of this launch writes (its weight
slab; the attention's preloaded K/V tile) and then waits (kernels/counters.wait_count) until every item of the
phase before has counted itself done (``count_done``), then reads that phase's output. A program only ever waits
for items whose tickets are smaller than its own, which were taken by programs that are running already, so the
chain cannot deadlock, however few programs fit on the GPU at once; and under the Triton interpreter, which runs
programs one after another, every wait is already satisfied when it is reached. While the items of one phase
run, programs that hold the next phase's tickets are already streaming their weights: the loads overlap the
phase boundary instead of following it.

Buffers: a layer's activations each have their own region of one scratch buffer (written once a launch, so no
program can hold a stale L1 line of them), the attention's split partials and counters one region per layer; the
layers' weights and cache layers are found through a table of int64 addresses [L, 12] (``TABLE_COLUMNS``).
Counters (int32, zeroed before every launch): [0] the ticket, [1 + 5 l + phase] done counts, then the attention's
split-combination counters [L, Nkv].

Interpreter (CPU, TRITON_INTERPRET=1): bf16 rounding emulated as kernels/decode_linear does (``RNE_EMU``), K/V tiles
upcast before ``tl.dot``; each phase's code is the per-kernel path's own, so the chain's result equals it bit for bit.

Legend: see reference.py (L layers, D hidden, I intermediate (DI in the kernel), Nkv kv heads, G = N / Nkv, Dh head
dim).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from prime_spmd.kernels.counters import SPIN_LIMIT, count_done
from prime_spmd.kernels.decode_attention import kernel as attention
from prime_spmd.kernels.decode_attention.kernel import split_program
from prime_spmd.kernels.decode_linear.kernel import gemv_preloaded

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

TABLE_COLUMNS = ("ln1", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "o_b", "ln2", "gate_up_w", "down_w", "k", "v")
"""The address table's columns: reference.LAYER_WEIGHTS, then the layer's K and V cache (slot layout)."""
# the columns as the kernel names them (constexpr globals)
LN1, QKV_W, QKV_B, Q_NORM, K_NORM, O_W, O_B, LN2, GATE_UP_W, DOWN_W, K_CACHE, V_CACHE = (
    tl.constexpr(i) for i in range(len(TABLE_COLUMNS))
)
N_COLUMNS = tl.constexpr(len(TABLE_COLUMNS))
N_PHASES = 5
PHASES = tl.constexpr(N_PHASES)  # kernels read it: a constexpr global


@triton.jit
def _addr(tab_ptr, layer, col: tl.constexpr, like_ptr):
    """Column ``col`` of the address table at ``layer``, as a pointer of ``like_ptr``'s type, 16-byte aligned (checked
    on the host): without the hint every weight load is a 2-byte scalar (sm_90 PTX), with it 16-byte vectors."""
    return tl.multiple_of(tl.load(tab_ptr + layer * N_COLUMNS + col).to(like_ptr.dtype), 16)


@triton.jit
def _chain_kernel(
    tab_ptr, act_ptr, acc_ptr, ml_ptr, cnt_ptr, comb_ptr, err_ptr, cos_ptr, sin_ptr, pos_ptr, lens_ptr,
    eps, qk_scale, max_len, sk_nkv, sk_tc, acc_stride, ml_stride,
    D: tl.constexpr, DI: tl.constexpr, NKV: tl.constexpr, G: tl.constexpr, DH: tl.constexpr,
    BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr,
    KP_D: tl.constexpr, KP_Q: tl.constexpr, KP_I: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_DH: tl.constexpr,
    BLOCK_TC: tl.constexpr, QKV_BIAS: tl.constexpr, O_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
    PRELOAD_TILE: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, RNE_EMU: tl.constexpr,
):  # fmt: skip
    NQ: tl.constexpr = NKV * G * DH  # q columns (attention output width)
    P: tl.constexpr = NQ + 2 * NKV * DH  # qkv columns
    A: tl.constexpr = 2 * D + P + NQ + DI  # a layer's activations: x | qkv | o | xm | h
    N_QKV: tl.constexpr = (P + BN_QKV - 1) // BN_QKV
    N_ATT: tl.constexpr = NKV * NUM_SPLITS
    N_O: tl.constexpr = (D + BN_O - 1) // BN_O
    N_GU: tl.constexpr = (DI + BN_GU - 1) // BN_GU
    N_DOWN: tl.constexpr = (D + BN_DOWN - 1) // BN_DOWN
    S: tl.constexpr = N_QKV + N_ATT + N_O + N_GU + N_DOWN  # items a layer

    t = tl.atomic_add(cnt_ptr, 1, sem="relaxed")  # this program's ticket
    layer = t // S
    r = t % S
    x = act_ptr + layer * A
    qkv = x + D
    o = qkv + P
    xm = o + NQ
    h = xm + D
    done = cnt_ptr + 1 + layer * PHASES  # this layer's done counts, one per phase
    if r < N_QKV:  # x (the layer before's down phase wrote it; layer 0's was written before the launch)
        prev = cnt_ptr + tl.where(layer > 0, layer * PHASES, 0)  # the layer before's down count; layer 0: the ticket
        gemv_preloaded(x, _addr(tab_ptr, layer, QKV_W, x), _addr(tab_ptr, layer, QKV_B, x),
                       _addr(tab_ptr, layer, LN1, x), x, qkv, r, P, eps, D, prev, tl.where(layer > 0, N_DOWN, 0),
                       err_ptr, D, QKV_BIAS, True, False, False, BN_QKV, KP_D, RNE_EMU, False, True)  # fmt: skip
        count_done(done)
    elif r < N_QKV + N_ATT:
        j = r - N_QKV
        split_program(
            j % NUM_SPLITS, j // NUM_SPLITS, qkv, _addr(tab_ptr, layer, K_CACHE, x),
            _addr(tab_ptr, layer, V_CACHE, x), lens_ptr,
            o, acc_ptr + layer * acc_stride, ml_ptr + layer * ml_stride,
            P, DH, 0, sk_nkv, sk_tc, 0, sk_nkv, sk_tc, NQ, DH, max_len, qk_scale, None, 1,
            _addr(tab_ptr, layer, Q_NORM, x), _addr(tab_ptr, layer, K_NORM, x), cos_ptr, sin_ptr, pos_ptr, DH, eps,
            comb_ptr + layer * NKV, done, N_QKV, err_ptr,
            NKV, G, DH, NUM_SPLITS, SPLIT_LEN, BLOCK_G, BLOCK_DH, BLOCK_TC, UPCAST, IEEE, 0, True, QK_NORM,
            PRELOAD_TILE, True,
        )  # fmt: skip
        count_done(done + 1)
    elif r < N_QKV + N_ATT + N_O:
        gemv_preloaded(o, _addr(tab_ptr, layer, O_W, x), _addr(tab_ptr, layer, O_B, x), x, x, xm, r - N_QKV - N_ATT,
                       D, eps, NQ, done + 1, N_ATT, err_ptr, NQ, O_BIAS, False, True, False, BN_O, KP_Q, RNE_EMU,
                       False, True)  # fmt: skip
        count_done(done + 2)
    elif r < N_QKV + N_ATT + N_O + N_GU:
        gemv_preloaded(xm, _addr(tab_ptr, layer, GATE_UP_W, x), x, _addr(tab_ptr, layer, LN2, x), x, h,
                       r - N_QKV - N_ATT - N_O, DI, eps, D, done + 2, N_O, err_ptr, D, False, True, False, True,
                       BN_GU, KP_D, RNE_EMU, False, True)  # fmt: skip
        count_done(done + 3)
    else:
        gemv_preloaded(h, _addr(tab_ptr, layer, DOWN_W, x), x, x, xm, x + A, r - N_QKV - N_ATT - N_O - N_GU, D, eps,
                       DI, done + 3, N_GU, err_ptr, DI, False, False, True, False, BN_DOWN, KP_I, RNE_EMU, False,
                       True)  # fmt: skip
        count_done(done + 4)


def slab_columns(k: int, slabs: int, slab_bytes: int, elsize: int) -> int:
    """Output columns a GEMV item takes: the power of two whose w slab(s) (K padded to a power of two) come closest to
    ``slab_bytes`` from below, at least 1."""
    per_col = triton.next_power_of_2(k) * elsize * slabs
    return max(1, 1 << max(0, (slab_bytes // per_col).bit_length() - 1))


# GPU: bytes of weights a GEMV item loads before it waits (its columns: slab_columns), and warps a program. Not yet
# timed on a GPU; at 16 KB the Qwen3-0.6B shape has ~2,050 GEMV items a layer (qkv 8 columns an item, o 4, gate/up
# 4, down 2); 4 warps: 168 registers at sm_90 (the attention's), 3 programs an SM (8 warps: 112, 2 programs).
DEFAULT_SLAB_BYTES = 16 * 1024
DEFAULT_NUM_WARPS = 4
SLAB_BYTES, NUM_WARPS = DEFAULT_SLAB_BYTES, DEFAULT_NUM_WARPS
# Under the interpreter: items of up to 1 KB of weights (tests' tiny models: several items a phase, ragged edges)
INTERPRET_SLAB_BYTES = 1024


def set_config(slab_bytes: int = 0, num_warps: int = 0) -> None:
    """Process-wide settings of later ``DecodeChain``s (0: the built-in default): benchmarks/engine.py --chain-*."""
    global SLAB_BYTES, NUM_WARPS
    if slab_bytes < 0 or num_warps < 0 or (num_warps and num_warps & (num_warps - 1)):
        raise ValueError(f"decode_chain: slab bytes {slab_bytes} >= 0, warps {num_warps} a power of two (0: default)")
    SLAB_BYTES = slab_bytes or DEFAULT_SLAB_BYTES
    NUM_WARPS = num_warps or DEFAULT_NUM_WARPS


class DecodeChain:
    """One-row decode steps of a dense Llama-style model through ``_chain_kernel``.

    ``layers``: per layer the weights of reference.LAYER_WEIGHTS (the runner's ``layer_args``: fused qkv and gate/up,
    biases and q/k norms may be None); ``k_cache`` / ``v_cache`` [L, Bc, Nkv, Tc, Dh] (slot layout; row 0 is slot 0).
    The weights' storage must stay where it is (in-place updates, as ``NativeEngine.load_weights`` makes, are seen):
    their addresses are read once, here. ``slab_bytes`` sizes the GEMV items (``SLAB_BYTES``), ``num_warps`` the
    programs (0: the module's ``SLAB_BYTES`` / ``NUM_WARPS``). ValueError naming the bad tensor for shapes, dtypes,
    layouts or 16-byte alignments the kernel cannot take."""

    def __init__(
        self,
        layers: list[tuple],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
        scale: float,
        eps: float,
        slab_bytes: int = 0,
        num_warps: int = 0,
    ) -> None:
        L, _, nkv, tc, dh = k_cache.shape
        if len(layers) != L or v_cache.shape != k_cache.shape:
            raise ValueError(
                f"decode_chain: {len(layers)} layers vs caches k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}"
            )
        if num_heads % nkv:
            raise ValueError(f"decode_chain: {num_heads} heads is not a multiple of {nkv} kv heads")
        ln1, qkv_w = layers[0][0], layers[0][1]
        self.dtype, self.device = qkv_w.dtype, qkv_w.device
        d, nq = ln1.shape[0], num_heads * dh
        inter = layers[0][8].shape[0] // 2
        shapes = dict(ln1=(d,), qkv_w=(nq + 2 * nkv * dh, d), qkv_b=(nq + 2 * nkv * dh,), q_norm=(dh,), k_norm=(dh,),
                      o_w=(d, nq), o_b=(d,), ln2=(d,), gate_up_w=(2 * inter, d), down_w=(d, inter))  # fmt: skip
        qkv_bias, o_bias, qk_norm = layers[0][2] is not None, layers[0][6] is not None, layers[0][3] is not None
        rows = []
        for li, ws in enumerate(layers):
            row = []
            for name, w in zip(shapes, ws, strict=True):
                optional = name in ("qkv_b", "o_b", "q_norm", "k_norm")
                if w is None:
                    if (
                        not optional
                        or (name == "qkv_b" and qkv_bias)
                        or (name == "o_b" and o_bias)
                        or (name.endswith("norm") and qk_norm)
                    ):
                        raise ValueError(f"decode_chain: layer {li} has no {name} (layer 0 has one, or it is required)")
                    row.append(0)
                    continue
                if tuple(w.shape) != shapes[name] or w.dtype != self.dtype or not w.is_contiguous():
                    raise ValueError(
                        f"decode_chain: layer {li} {name} is {tuple(w.shape)} {w.dtype} (contiguous: "
                        f"{w.is_contiguous()}); want {shapes[name]} {self.dtype}, contiguous"
                    )
                row.append(w.data_ptr())
            row += [k_cache[li].data_ptr(), v_cache[li].data_ptr()]
            rows.append(row)
        if k_cache.dtype != self.dtype or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError(
                f"decode_chain: caches {k_cache.dtype} strides {k_cache.stride()} / {v_cache.stride()}: want the "
                f"weights' dtype {self.dtype}, one layout, a contiguous head dim"
            )
        cols = TABLE_COLUMNS
        misaligned = [f"layer {li} {cols[j]}" for li, row in enumerate(rows) for j, a in enumerate(row) if a % 16]
        elsize = qkv_w.element_size()
        rows_ok = all((n * elsize) % 16 == 0 for n in (d, nq, inter, dh))
        if misaligned or not rows_ok:  # the kernel's weight loads are 16-byte vectors (_addr's hint)
            raise ValueError(
                f"decode_chain: 16-byte alignment: addresses of {misaligned[:4]}; row bytes hidden {d * elsize}, "
                f"q {nq * elsize}, intermediate {inter * elsize}, head {dh * elsize} must be multiples of 16"
            )
        self.table = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.L, self.D, self.I, self.NKV, self.G, self.DH, self.TC = L, d, inter, nkv, num_heads // nkv, dh, tc
        self.biases, self.qk_norm, self.scale, self.eps = (qkv_bias, o_bias), qk_norm, scale, eps
        self.k_strides = (k_cache.stride(2), k_cache.stride(3))
        self.layer_stride = 2 * d + 2 * nq + 2 * nkv * dh + inter  # x | qkv | o | xm | h (the kernel's A)
        self.act = torch.zeros(L * self.layer_stride + d, dtype=self.dtype, device=self.device)
        self.block_tc = attention.default_block_tc(dh)
        self.max_splits = triton.cdiv(tc, self.block_tc)
        part = nkv * self.max_splits * self.G
        self.acc = torch.empty(L * part * dh, dtype=torch.float32, device=self.device)
        self.ml = torch.empty(L * part * 2, dtype=torch.float32, device=self.device)
        self.counters = torch.zeros(1 + N_PHASES * L + L * nkv, dtype=torch.int32, device=self.device)
        self.timeouts = torch.zeros(1, dtype=torch.int32, device=self.device)  # waits given up (never reset)
        slab = slab_bytes or (INTERPRET_SLAB_BYTES if INTERPRET else SLAB_BYTES)
        self.bn = (slab_columns(d, 1, slab, elsize), slab_columns(nq, 1, slab, elsize),
                   slab_columns(d, 2, slab, elsize), slab_columns(inter, 1, slab, elsize))  # fmt: skip
        self.num_warps = num_warps or NUM_WARPS

    def input(self) -> torch.Tensor:
        """[1, D]: where the caller writes layer 0's input (the embedding) before a step."""
        return self.act[: self.D].view(1, self.D)

    def output(self) -> torch.Tensor:
        """[1, D]: the last layer's output after a step (the final norm's input)."""
        off = self.L * self.layer_stride
        return self.act[off : off + self.D].view(1, self.D)

    def check(self) -> None:
        """RuntimeError if any wait of any step so far gave up (kernels/counters.SPIN_LIMIT): those steps' outputs are
        wrong. Reads one int from the device (a sync): call it where the caller syncs anyway."""
        n = int(self.timeouts.item())
        if n:
            raise RuntimeError(
                f"decode_chain: {n} wait(s) gave up after {int(SPIN_LIMIT)} polls (a phase never finished: a bug in "
                "the chain's order or memory ordering); the steps since are wrong. Run without "
                "--inference.decode_chain"
            )

    def items_per_layer(self, kv_len: int) -> int:
        """Work items (programs) a layer has when a step attends ``kv_len`` positions."""
        p = (self.NKV * self.G + 2 * self.NKV) * self.DH
        splits, _ = self._splits(kv_len)
        bq, bo, bg, bd = self.bn
        return (triton.cdiv(p, bq) + self.NKV * splits + triton.cdiv(self.D, bo) + triton.cdiv(self.I, bg)
                + triton.cdiv(self.D, bd))  # fmt: skip

    def _splits(self, kv_len: int) -> tuple[int, int]:
        """(length splits, positions a split) for attending ``kv_len`` positions, as the fused attention picks them."""
        n = attention.pick_num_splits(1, self.NKV, kv_len, self.device, self.block_tc)
        split_len = triton.cdiv(triton.cdiv(kv_len, n), self.block_tc) * self.block_tc
        return triton.cdiv(kv_len, split_len), split_len

    def __call__(self, cos_1Dh: torch.Tensor, sin_1Dh: torch.Tensor, pos_1: torch.Tensor, lens_1: torch.Tensor,
                 kv_len: int) -> torch.Tensor:  # fmt: skip
        """One step: layer 0's input in ``input()``; the new token at ``pos_1[0]`` with RoPE rows ``cos/sin_1Dh``
        [1, Dh]; attends [0, min(lens_1[0], kv_len)) (lens_1 = pos_1 + 1). Writes the caches; returns ``output()``.
        Graph-capturable: no host sync (the grid depends on ``kv_len`` only)."""
        if kv_len > self.TC or cos_1Dh.stride() != sin_1Dh.stride() or cos_1Dh.stride(-1) != 1:
            raise ValueError(
                f"decode_chain: kv_len {kv_len} > cache length {self.TC}, or cos/sin strides {cos_1Dh.stride()} / "
                f"{sin_1Dh.stride()} (one stride, contiguous rows)"
            )
        splits, split_len = self._splits(kv_len)
        self.counters.zero_()
        nq = self.NKV * self.G * self.DH
        d, inter = self.D, self.I
        bq, bo, bg, bd = self.bn
        preload = attention.PRELOAD_TILE and split_len == self.block_tc
        combine = self.counters[1 + N_PHASES * self.L :]  # the attention's split-combination counters
        _chain_kernel[(self.L * self.items_per_layer(kv_len),)](
            self.table, self.act, self.acc, self.ml, self.counters, combine, self.timeouts, cos_1Dh, sin_1Dh, pos_1,
            lens_1,
            self.eps, self.scale * attention.LOG2E, kv_len, self.k_strides[0], self.k_strides[1],
            self.NKV * self.max_splits * self.G * self.DH, self.NKV * self.max_splits * self.G * 2,
            D=d, DI=inter, NKV=self.NKV, G=self.G, DH=self.DH, BN_QKV=bq, BN_O=bo, BN_GU=bg, BN_DOWN=bd,
            KP_D=triton.next_power_of_2(d), KP_Q=triton.next_power_of_2(nq), KP_I=triton.next_power_of_2(inter),
            NUM_SPLITS=splits, SPLIT_LEN=split_len, BLOCK_G=max(16, triton.next_power_of_2(self.G)),
            BLOCK_DH=max(16, triton.next_power_of_2(self.DH)), BLOCK_TC=self.block_tc, QKV_BIAS=self.biases[0],
            O_BIAS=self.biases[1], QK_NORM=self.qk_norm, PRELOAD_TILE=preload, UPCAST=INTERPRET,
            IEEE=self.dtype == torch.float32 and not INTERPRET, RNE_EMU=INTERPRET and self.dtype == torch.bfloat16,
            num_warps=self.num_warps, num_stages=1,
        )  # fmt: skip
        return self.output()
