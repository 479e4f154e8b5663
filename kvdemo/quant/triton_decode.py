"""Fused decode attention over the packed KV cache in Triton: twin of `reference.past_attention` (same signature,
same storage layout; see the reference's docstring).

`past_attention(query, kv, scaling) -> (out, lse)`: every query over one layer's stored past (sinks + quantized
region + full-precision residual), flash-decoding style: the sequence is split into programs of equal tile
counts per (batch, kv head), quantized region and residual alike (the first residual program also takes the
sinks), and a second kernel merges the partial results by log-sum-exp (`_decode_split_kernel`, `_merge_kernel`).
One program serves every query head of its kv-head group (GQA: each K/V tile is read once).

K/V stay packed in memory: a tile of packed bytes is loaded as stored and unpacked in registers to fp16 codes
(exact: the fp16 with bits 0x6400 | c is 1024 + c), by inline PTX when compiled for NVIDIA (`kvdemo.quant.ptx`),
by the same arithmetic in Triton ops in the interpreter (`kvdemo.quant.triton_codes`). Per-channel keys are never
dequantized: ``q . k_t = sum_c (q_c s_c) code_tc + sum_c q_c z_c`` inside one key block, with ``q_c s_c`` and
``q . z`` computed once per block. Both dots run on fp16 tensor cores with fp32 accumulation. 8- and 4-bit
integer codes (`launch.plane_split`) take `_plane_split_tiles`: each nibble plane to its own dot, the query
times the key scales rounded to fp16 with no hi + lo split, the softmax reference moved only when a row's max
jumps past it (its docstring says the bounds). Elsewhere scores are about fp32-accurate: fp32 operands are
split into fp16 hi + lo halves (queries always; keys stored in fp32 or dequantized per token too). The weights
and the dequantized values of the second dot are fp16, as in FlashAttention (2^-11 relative each).

The methods beyond uniform codes (reference docstring) are read from their packed storage too, each behind a
constexpr flag of the kernel (off: the plain variants compile to the code they had before): nuq codebooks (fp16
levels picked in registers: compiled for NVIDIA by byte permutes, in the interpreter by a select tree over the
code's bits; the key fold above holds), bit-sliced int3 / nuq3 rows (three 1-bit planes), nvfp4 (E2M1 codes,
E4M3 scales times the block's fp32 tensor scale, keys per token), sparse outliers (a row's corrections expanded
into a dense fp16 tile: one more dot for keys, added to the values), a Hadamard rotation (on the query side: the
codes see q @ R, the quantized splits' partial outputs are turned back by R.T before the merge; the lse is
unchanged) and pre-RoPE keys (the tile is dequantized in fp32 and turned by RoPE from the fp32 cos/sin rows of
its positions, then dotted as per-token keys are). `supports_attention` (`kvdemo.quant.launch`) says what the
kernel reads; the rest goes to the reference, as does a call with a mask.

Tensors are CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (the tests). Launch settings (tile, warps,
splits; `kvdemo.quant.launch`) change only speed. The interpreter misses what only the GPU compiler sees
(register spills, shared memory, unsupported ops): `bench/compile_sm90.py` compiles every variant for sm_90 on a
CPU and reports them, with the decode loop's instructions per token; tests keep them compiling without spills
and within an instruction budget.
References: KIVI (arXiv 2402.02750), KVQuant (arXiv 2401.18079), FlashAttention-2 (arXiv 2307.08691) and
flash-decoding (split-K over the sequence with a log-sum-exp merge).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference_attention
from .launch import (
    DECODE_STEP_INTS,
    MERGE_STEP_INTS,
    MIN_TILES_PER_SPLIT,
    NUM_STAGES,
    _block_m,
    capability,
    decode_constants,
    direct_keys_allowed,
    direct_keys_config,
    fold_once,
    form_constants,
    launch_config,
    max_registers,
    method_kind,
    ptx_unpacking,
    row_widths,
    scratch,
    splits_for,
    stand_ins,
    supports_attention,
)
from .reference import QuantizedTensor, paired, values_paired
from .triton_codes import (
    _FP8_UNIT,
    _FP16_MAX,
    _dequantize_rows,
    _int_planes,
    _int_planes_traced,
    _nvfp4_scales,
    _outlier_tile,
    _pow2,
    _unpack,
    _unpack_values,
    cdiv,
)

MAX_BLOCK_N = 128  # most tokens per attention tile (tiles of per-channel keys stay inside one key group)
LOG2E = 1.4426950408889634


# --- fused decode attention -------------------------------------------------------------------------


@triton.jit
def _rope_rows(k, cos, sin, BLOCK_N: tl.constexpr, D: tl.constexpr, ROPE_DIM: tl.constexpr):
    """RoPE (rotate-half layout) on key rows k [BN, D] fp32 with their cos/sin [BN, D] fp32: k * cos +
    rotate_half(k) * sin, rotate_half within each run of ROPE_DIM channels (partial rotary: channels past
    ROPE_DIM come with cos 1, sin 0, so they pass through)."""
    HALF: tl.constexpr = ROPE_DIM // 2
    x = tl.permute(tl.reshape(k, (BLOCK_N, D // ROPE_DIM, 2, HALF)), (0, 1, 3, 2))  # [BN, D/RD, HALF, 2]
    first, second = tl.split(x)
    turned = tl.permute(tl.join(-second, first), (0, 1, 3, 2))  # [BN, D/RD, 2, HALF]: (-x2, x1)
    return k * cos + tl.reshape(turned, (BLOCK_N, D)) * sin


@triton.jit
def _hi_lo(a):
    """fp32 a -> (hi, lo) fp16 with hi + lo = a to about fp32 accuracy (within fp16's range)."""
    hi = a.to(tl.float16)
    return hi, (a - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _dot_hi_lo(a_hi, a_lo, b):
    """a [BM, K] fp32, given as its fp16 halves (`_hi_lo`), @ b [K, BN] fp16 on fp16 tensor cores, to about
    fp32 accuracy."""
    return tl.dot(a_hi, b) + tl.dot(a_lo, b)


@triton.jit
def _dot_f32(a_hi, a_lo, b):
    """a [BM, K] fp32 (its fp16 halves) @ b [K, BN] fp32 on fp16 tensor cores, to about fp32 accuracy: hi/lo
    halves of both, three dots (the lo x lo term is below fp32 rounding)."""
    b_hi, b_lo = _hi_lo(b)
    return _dot_hi_lo(a_hi, a_lo, b_hi) + tl.dot(a_hi, b_lo)


@triton.jit
def _online_update(acc, m_i, l_i, s, v):
    """One flash-attention step: s [BM, BN] fp32 log2-domain scores (-inf = masked), v [BN, D] fp16."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays empty
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])  # [BM, BN]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)  # [BM, D], fp32 accumulation
    return acc, m_new, l_i


@triton.jit
def _full_segment(
    acc,
    m_i,
    l_i,
    q_hi,
    q_lo,
    k_base,
    v_base,
    sk_t,
    sv_t,
    row_begin,
    row_end,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    ONE_WARP: tl.constexpr,
):
    """Full-precision keys/values rows [row_begin, row_end) of one (batch, kv head): sinks or residual.

    Keys go to the tensor cores as fp16: 16-bit keys as they are (bf16 is exact in fp16 from 2^-14 to
    65504), fp32 keys as hi + lo halves; values as fp16. ONE_WARP: not pipelined (a program of one warp
    keeps its shared memory to the quantized loop's, so 12 programs fit an SM; these rows are few).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for start in tl.range(row_begin, row_end, BLOCK_N, num_stages=1 if ONE_WARP else None):
        pos = start + offs_n  # [BN] int32: offsets within one head stay below 2^31 (checked by the caller)
        valid = pos < row_end
        k = tl.load(k_base + pos[:, None] * sk_t + offs_d[None, :], mask=valid[:, None], other=0.0)
        if k.dtype == tl.float32:
            s = _dot_f32(q_hi, q_lo, tl.trans(k))  # [BM, BN]
        else:
            s = _dot_hi_lo(q_hi, q_lo, tl.trans(k.to(tl.float16)))  # fp16 and bf16 values are exact in fp16
        s = tl.where(valid[None, :], s, float("-inf"))
        v = tl.load(v_base + pos[:, None] * sv_t + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v.to(tl.float16))
    return acc, m_i, l_i


# how far (log2) a row's max may pass the plane-split loop's reference before the reference moves: weights
# stay within 2^8, which fp16 holds with its full precision
RESCALE_LOG2 = tl.constexpr(8.0)


@triton.jit
def _value_planes(vc_base, vs_base, svc_t, svw_t, pos, valid, VDP: tl.constexpr, V_BITS, PTX):
    """A tile's values at positions pos [BN] (rows outside `valid` read as 0), one group per token: code planes
    v0, v1 [BN, VDP] fp16 (8 bits: one plane, twice) and scale, zero [BN] fp16. A token's scale and zero are
    stored side by side (`reference.paired`) and read as one 4-byte word (svw_t: the row stride in words), which
    the loop's pipeline copies asynchronously with the codes (2-byte loads cannot be: a thread waits on each)."""
    vbyte = tl.load(vc_base + pos[:, None] * svc_t + tl.arange(0, VDP)[None, :], mask=valid[:, None], other=0)
    v0, v1 = _int_planes(vbyte, V_BITS, False, PTX)
    word = tl.load(vs_base.to(tl.pointer_type(tl.int32)) + pos * svw_t, mask=valid, other=0)
    vs = (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)  # the low half: the scale
    vz = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return v0, v1, vs, vz


@triton.jit
def _query_planes(q_rows, row_ok, qk_scale, KDP: tl.constexpr, Q16: tl.constexpr, TWO: tl.constexpr):
    """The query rows q_rows [BM] (pointers) as the plane-split loop's dots take them: Q16, in the log2 domain
    rounded to fp16, TWO planes [BM, KDP] (4-bit keys: the high nibbles' plane times 1/16) or one; else one fp32
    plane as stored (8-bit keys: the scales take qk_scale)."""
    offs_k = tl.arange(0, KDP)
    q0 = tl.load(q_rows[:, None] + offs_k[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q1 = q0
    if Q16:
        q0 = (q0 * qk_scale).to(tl.float16)
        q1 = q0
    if TWO:
        q1 = tl.load(q_rows[:, None] + KDP + offs_k[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        q1 = (q1 * (qk_scale * 0.0625)).to(tl.float16)
    return q0, q1


@triton.jit
def _times_row(a, z, acc, BLOCK_N: tl.constexpr):
    """acc [BM, BLOCK_N] + (a @ z)[:, None] on the tensor cores: a [BM, K] fp16, z [K] fp16 (one column, repeated).
    Products of fp16 values are exact in fp32, summed in fp32."""
    return tl.dot(a, tl.broadcast_to(z[:, None], (z.shape[0], BLOCK_N)), acc)


@triton.jit
def _plane_split_tiles(
    q_rows,
    row_ok,
    qk_scale,
    kc_base,
    ks_base,
    kz_base,
    vc_base,
    vs_base,
    vz_base,
    skc_t,
    sks_t,
    skz_t,
    svc_t,
    svs_t,
    svz_t,
    t_begin,
    t_end,
    S,
    Q,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    K_GROUP: tl.constexpr,
    PTX: tl.constexpr,
    DIRECT: tl.constexpr,
    ONE_WARP: tl.constexpr,
):
    """Quantized tiles [t_begin, t_end) of 8- or 4-bit integer keys per channel and values per token (one group
    of D channels), plane by plane: byte j of a packed row holds channels j (low nibble) and KDP + j (high
    nibble), so each nibble plane [BN, D / 2] goes to its own dot as it comes out of the bytes, never
    interleaved back into rows [BN, D] (that took a quarter of the first loop in register shuffles).

    Keys: q . k_t = sum_planes sum_c (q_c s_c) b_tc + (q . z - 1024 sum_c (q_c s_c)), with the codes b as the
    PTX leaves them, 1024 + c (high nibbles 1024 + 16 c: their plane's query takes the 1/16), and the bracket
    computed once per key block from the same fp16 (q_c s_c) the dot multiplies, so the offset cancels. With
    4-bit keys (and on one warp) the query is rounded to fp16 once and q s in fp16 (both rounded, no hi + lo
    split); with 8-bit keys on more warps q s is rounded from fp32: |score error| <= 2^-11 (1 + 2^-10)
    sum_c |q_c| (|k_tc| + |s_c| (c_tc + 1)), what a 16-bit SDPA's own rounding of q and k gives (tests/test_triton.py states and checks the bound). The
    softmax weights are taken against a reference that moves only when a row's max passes it by more than
    2^RESCALE_LOG2 (weights up to 2^8, fp16 keeps them to 2^-11 relative). Values are
    dequantized per plane in fp16 (s_t c + z_t), as in the first loop. Returns (acc [BM, D] fp32, m_i, l_i),
    log2 domain.

    DIRECT (`launch.direct_keys_config`; the same values in another order): the key tile is loaded transposed
    and each plane unpacked by a block Triton traces through (`_int_planes_traced`), so the score dot reads the
    codes from the asynchronous copy's buffer straight into the tensor cores' layout (no store, barrier and
    reload between unpacking and the dot); the folded query is kept in registers across a key block; the value
    tile comes first and is dequantized at once, so its bytes are waited for with the keys' and it goes to
    shared memory before the softmax's exchange across warps (one barrier for both). Fewer barriers and
    shared-memory trips, more register moves (the score dot is laid out for 8-bit data): `bench/compile_sm90.py`
    counts both, the GPU benchmark times both. With the query rounded to fp16, q . z - 1024 sum_c qs_c is summed
    on the tensor cores (`_times_row`) into a tile that starts the score dot's accumulator.

    ONE_WARP (a program of one warp, `launch.direct_keys_config`): the softmax's row maximum and sums stay within
    the warp, so the sums are taken on every tile (no [rows, tile] accumulator); for registers, 8-bit keys' query
    is rounded to fp16 too and the query is read again (from cache) on entering each key block instead of kept."""
    K_PL: tl.constexpr = 8 // K_BITS  # planes of D / K_PL channels each (8 bits: 1, 4 bits: 2)
    V_PL: tl.constexpr = 8 // V_BITS
    KDP: tl.constexpr = D // K_PL
    VDP: tl.constexpr = D // V_PL
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, KDP)
    # 4-bit keys: the query in the log2 domain rounded to fp16 once, [BM, KDP] per plane (the high nibbles come
    # as 1024 + 16 c: their plane's query takes the 1/16), times the key scales in fp16 (rounded once more).
    # 8-bit keys (one plane of D channels, registers at the cap): the fp32 query times fp32 scales, rounded once
    # (on one warp, as 4-bit keys: the query in fp16)
    Q16: tl.constexpr = K_PL == 2 or ONE_WARP  # one warp: 8-bit keys' query rounded to fp16 too (registers)
    q0, q1 = _query_planes(q_rows, row_ok, qk_scale, KDP, Q16, K_PL == 2)
    if Q16:
        ks0 = tl.zeros([KDP], dtype=tl.float16)
    else:
        ks0 = tl.zeros([KDP], dtype=tl.float32)
    ks1 = ks0
    if DIRECT:
        qs0 = tl.zeros([BLOCK_M, KDP], dtype=tl.float16)  # the folded query, kept across a key block's tiles
        qs1 = qs0
        qz_t = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # fp16 query: q . z - 1024 sum_c qs_c per column
    acc0 = tl.zeros([BLOCK_M, VDP], dtype=tl.float32)  # output channels [0, VDP)
    acc1 = tl.zeros([BLOCK_M, VDP], dtype=tl.float32)  # [VDP, D) with 4-bit values
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)  # finite: exp2(-inf - m_i) is 0, never nan
    qz = tl.zeros([BLOCK_M], dtype=tl.float32)
    l_t = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # softmax weights summed per row and tile column
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for tile in range(t_begin, t_end):
        start = tile * BLOCK_N
        pos = start + offs_n  # [BN] absolute positions; rows [0, S) are dummies
        valid = (pos >= S) & (pos < Q)
        if (tile == t_begin) or (start % K_GROUP == 0):  # entering a key block: its scales and q . zero
            blk = start // K_GROUP
            if ONE_WARP:  # registers: the query is read again (from cache) instead of kept
                q0, q1 = _query_planes(q_rows, row_ok, qk_scale, KDP, Q16, K_PL == 2)
            ks0 = tl.load(ks_base + blk * sks_t + offs_k)  # [KDP] fp16, as stored
            if DIRECT and Q16:  # q . z - 1024 sum_c qs_c on the tensor cores (`_times_row`), every column the same
                bias = tl.full([KDP], -1024.0, tl.float16)
                qs0 = (q0 * ks0[None, :]).to(tl.float16)  # [BM, KDP]
                qz_t = _times_row(
                    q0, tl.load(kz_base + blk * skz_t + offs_k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), BLOCK_N
                )
                qz_t = _times_row(qs0, bias, qz_t, BLOCK_N)
                if K_PL == 2:  # q1 holds the 1/16: 16 q1 (exact, a power of two) . z1 - 1024 sum_c qs1_c
                    ks1 = tl.load(ks_base + blk * sks_t + KDP + offs_k)
                    qs1 = (q1 * ks1[None, :]).to(tl.float16)
                    kz1 = tl.load(kz_base + blk * skz_t + KDP + offs_k)
                    qz_t = _times_row((q1 * 16.0).to(tl.float16), kz1, qz_t, BLOCK_N)
                    qz_t = _times_row(qs1, bias, qz_t, BLOCK_N)
            else:
                kz = tl.load(kz_base + blk * skz_t + offs_k).to(tl.float32)
                if not Q16:
                    ks0 = ks0.to(tl.float32) * qk_scale  # log2 domain
                    kz = kz * qk_scale
                # the codes come biased (1024 + c): q . z - 1024 sum_c qs_c, from the fp16 qs the dot multiplies
                qz_c = q0.to(tl.float32) * kz[None, :] - 1024.0 * (q0 * ks0[None, :]).to(tl.float16).to(tl.float32)
                if K_PL == 2:  # q1 holds the 1/16: its q . z is 16 (q1 . z - 64 sum_c qs1_c)
                    ks1 = tl.load(ks_base + blk * sks_t + KDP + offs_k)
                    kz = tl.load(kz_base + blk * skz_t + KDP + offs_k).to(tl.float32)
                    qz_c += 16.0 * (q1.to(tl.float32) * kz[None, :] - 64.0 * (q1 * ks1[None, :]).to(tl.float32))
                qz = tl.sum(qz_c, 1)  # [BM]
                if DIRECT:
                    qs0 = (q0 * ks0[None, :]).to(tl.float16)  # [BM, KDP]
        if DIRECT:  # the values first, dequantized now (fp16 s c + z): stored before the softmax's exchange
            v0, v1, vs, vz = _value_planes(vc_base, vs_base, svc_t, svs_t, pos, valid, VDP, V_BITS, PTX)
            v0, v1 = v0 * vs[:, None] + vz[:, None], v1 * vs[:, None] + vz[:, None]
            kbyte = tl.load(kc_base + pos[None, :] * skc_t + offs_k[:, None], mask=valid[None, :], other=0)
            k0, k1 = _int_planes_traced(kbyte, K_BITS, PTX)  # [KDP, BN] fp16 each, 1024 + c (+ 16 c)
            s = tl.dot(qs0, k0, qz_t)  # [BM, BN]; fp16 query: q . z in from the start (qz stays 0)
            if K_PL == 2:
                s = tl.dot(qs1, k1, s)
        else:
            qs0 = (q0 * ks0[None, :]).to(tl.float16)  # [BM, KDP]
            qs1 = (q1 * ks1[None, :]).to(tl.float16)
            kbyte = tl.load(kc_base + pos[:, None] * skc_t + offs_k[None, :], mask=valid[:, None], other=0)
            k0, k1 = _int_planes(kbyte, K_BITS, True, PTX)  # [BN, KDP] fp16 each, 1024 + c (+ 16 c)
            s = tl.dot(qs0, tl.trans(k0))  # [BM, BN]
            if K_PL == 2:
                s = tl.dot(qs1, tl.trans(k1), s)
        # s + qz is the score; qz is the same across a row, so it goes on the row's max instead of on s
        if (start < S) or (start + BLOCK_N > Q):  # only a program's first or last tile holds rows to mask
            s = tl.where(valid[None, :], s, float("-inf"))
        if not DIRECT:
            v0, v1, vs, vz = _value_planes(vc_base, vs_base, svc_t, svs_t, pos, valid, VDP, V_BITS, PTX)
        m_tile = tl.max(s, 1) + qz  # [BM]; -inf for a row masked throughout
        # the weights are taken against m_i, which moves (rescaling acc and l_t) only when a row's max passes
        # it by more than RESCALE_LOG2, so p <= 2^RESCALE_LOG2; a program's first tile always moves it
        if tl.max(m_tile - m_i, 0) > RESCALE_LOG2:
            m_new = tl.maximum(m_i, m_tile)  # a row with nothing seen yet keeps -1e30: its weights are 0
            alpha = tl.exp2(m_i - m_new)
            acc0 *= alpha[:, None]
            acc1 *= alpha[:, None]
            l_t *= alpha[:, None]
            l_i *= alpha
            m_i = m_new
        p = tl.exp2(s - (m_i - qz)[:, None])  # [BM, BN]
        if ONE_WARP:  # summed within the warp: no [rows, tile] accumulator to keep in registers
            l_i += tl.sum(p, 1)
        else:
            l_t += p  # row sums after the loop: no reduction across warps per tile
        p16 = p.to(tl.float16)
        if not DIRECT:
            v0, v1 = v0 * vs[:, None] + vz[:, None], v1 * vs[:, None] + vz[:, None]  # values: fp16 s c + z
        acc0 = tl.dot(p16, v0, acc0)
        if V_PL == 2:
            acc1 = tl.dot(p16, v1, acc1)
    if not ONE_WARP:
        l_i = tl.sum(l_t, 1)
    if V_PL == 2:
        acc = tl.reshape(tl.permute(tl.join(acc0, acc1), (0, 2, 1)), (BLOCK_M, D))
    else:
        acc = tl.reshape(acc0, (BLOCK_M, D))
    return acc, m_i, l_i


@triton.jit(do_not_specialize=DECODE_STEP_INTS)
def _decode_split_kernel(
    q_ptr,
    sq_b,
    sq_h,
    sq_t,
    sk_ptr,
    ssk_b,
    ssk_h,
    ssk_t,
    sv_ptr,
    ssv_b,
    ssv_h,
    ssv_t,
    rk_ptr,
    srk_b,
    srk_h,
    srk_t,
    rv_ptr,
    srv_b,
    srv_h,
    srv_t,
    kc_ptr,
    skc_b,
    skc_h,
    skc_t,
    ks_ptr,
    sks_b,
    sks_h,
    sks_t,
    kz_ptr,
    skz_b,
    skz_h,
    skz_t,
    vc_ptr,
    svc_b,
    svc_h,
    svc_t,
    vs_ptr,
    svs_b,
    svs_h,
    svs_t,
    vz_ptr,
    svz_b,
    svz_h,
    svz_t,
    qr_ptr,
    klv_ptr,
    vlv_ptr,
    kts_ptr,
    skts_b,
    skts_h,
    vts_ptr,
    svts_b,
    svts_h,
    row0,
    kts_block,
    vts_block,
    kod_ptr,
    skod_b,
    skod_h,
    skod_t,
    koi_ptr,
    skoi_b,
    skoi_h,
    skoi_t,
    vod_ptr,
    svod_b,
    svod_h,
    svod_t,
    voi_ptr,
    svoi_b,
    svoi_h,
    svoi_t,
    cos_ptr,
    sin_ptr,
    scs_t,
    o_part_ptr,
    lse_part_ptr,
    HKV,
    N_Q,
    M,
    lens_ptr,
    splits,
    min_tiles,
    qk_scale,
    parts,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_BITS: tl.constexpr,
    K_FP8: tl.constexpr,
    K_CHANNEL: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_BITS: tl.constexpr,
    V_FP8: tl.constexpr,
    V_GROUP: tl.constexpr,
    PTX: tl.constexpr,
    FOLD_ONCE: tl.constexpr,
    K_CODE: tl.constexpr = 0,
    V_CODE: tl.constexpr = 0,
    K_OUTLIERS: tl.constexpr = 0,
    V_OUTLIERS: tl.constexpr = 0,
    K_ROTATED: tl.constexpr = False,
    K_ROPE: tl.constexpr = 0,
    PLANE_SPLIT: tl.constexpr = False,
    DIRECT_KEYS: tl.constexpr = False,
    ONE_WARP: tl.constexpr = False,
):
    """Program (split, batch * kv head): partial attention of the group's M query rows.

    The regions' lengths are read from the device (lens_ptr: int32 [S, Q, R]: sinks [0, S), codes [S, Q),
    residual R rows), and the grid is fixed at `parts` = splits + 1 programs per (batch, kv head) whatever the
    lengths, so a decode step launches with the same arguments as the step before (a CUDA graph can replay it).
    Each program works out its share: tiles_per_split = max(min_tiles, ceil(tiles / splits)); split <
    num_splits (= ceil(quantized tiles / tiles_per_split)): quantized tiles [split * tiles_per_split, ...) of
    positions [S, Q); split = num_splits + f: residual rows [f * tiles_per_split * BLOCK_N, ...), and for f = 0
    also the sinks [0, S); programs past both exit with an empty slot (lse -inf, merged with weight 0).
    Writes o (normalized) and lse of its slot; `parts` slots per (batch, kv head).

    The methods beyond uniform codes (defaults: off, the plain variants compile as without them):
    K_CODE / V_CODE 0: integer or fp8 codes (K_BITS 3: bit-sliced int3), 1: nuq codebook levels
    (klv_ptr / vlv_ptr, fp16 [2^bits]), 2: nvfp4 (E2M1 codes, uint8 E4M3 scales, fp32 tensor scales
    kts_ptr / vts_ptr [B, H, blocks] of kts_block / vts_block positions from row0);
    K_OUTLIERS / V_OUTLIERS: sparse corrections per row (fp16 delta kod/vod, uint8 channel koi/voi
    [B, H, rows, cap]); K_ROTATED: the codes see the query qr_ptr (fp32 q @ R, the layout of q; values'
    rotation is undone on the partial outputs by the caller); K_ROPE: rotary dim of pre-RoPE keys, turned
    by cos/sin fp32 [rows, K_ROPE] (row stride scs_t) after dequantizing the tile.
    DIRECT_KEYS: the plane-split loop's direct-keys form (`_plane_split_tiles`; the same values). ONE_WARP: the
    program is one warp (`launch.direct_keys_config`): its shared memory kept small (the full-precision rows
    unpipelined), registers too (`_plane_split_tiles`).
    """
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    h = (pid_bh % HKV).to(tl.int64)
    grp = M // N_Q
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < M
    head = h * grp + offs_m // N_Q  # query head of row m (rows = head in group, query index)
    q_row = b * sq_b + head * sq_h + (offs_m % N_Q) * sq_t  # [BM]
    q_offs = q_row[:, None] + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale  # [BM, D], log2 domain
    q_hi, q_lo = _hi_lo(q)  # the dots' fp16 halves, for full-precision and per-token keys

    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    S = tl.load(lens_ptr)
    Q = tl.load(lens_ptr + 1)
    R = tl.load(lens_ptr + 2)
    n_tiles = tl.cdiv(Q, BLOCK_N)  # quantized tiles (positions [0, Q), aligned)
    tiles_per_split = tl.maximum(min_tiles, tl.cdiv(n_tiles + tl.cdiv(R, BLOCK_N), splits))
    num_splits = tl.cdiv(n_tiles, tiles_per_split)
    if pid_s >= num_splits:
        f = pid_s - num_splits
        if f == 0:
            acc, m_i, l_i = _full_segment(
                acc,
                m_i,
                l_i,
                q_hi,
                q_lo,
                sk_ptr + b * ssk_b + h * ssk_h,
                sv_ptr + b * ssv_b + h * ssv_h,
                ssk_t,
                ssv_t,
                0,
                S,
                BLOCK_N,
                D,
                ONE_WARP,
            )
        r_begin = f * tiles_per_split * BLOCK_N
        r_end = tl.minimum(r_begin + tiles_per_split * BLOCK_N, R)
        acc, m_i, l_i = _full_segment(
            acc,
            m_i,
            l_i,
            q_hi,
            q_lo,
            rk_ptr + b * srk_b + h * srk_h,
            rv_ptr + b * srv_b + h * srv_h,
            srk_t,
            srv_t,
            r_begin,
            r_end,
            BLOCK_N,
            D,
            ONE_WARP,
        )
    elif PLANE_SPLIT and FOLD_ONCE:  # 8- and 4-bit integer codes (`launch.plane_split`)
        acc, m_i, l_i = _plane_split_tiles(
            q_ptr + q_row,
            row_ok,
            qk_scale,
            kc_ptr + b * skc_b + h * skc_h,
            ks_ptr + b * sks_b + h * sks_h,
            kz_ptr + b * skz_b + h * skz_h,
            vc_ptr + b * svc_b + h * svc_h,
            vs_ptr + b * svs_b + h * svs_h,
            vz_ptr + b * svz_b + h * svz_h,
            skc_t,
            sks_t,
            skz_t,
            svc_t,
            svs_t,
            svz_t,
            pid_s * tiles_per_split,
            tl.minimum(pid_s * tiles_per_split + tiles_per_split, n_tiles),
            S,
            Q,
            D,
            BLOCK_M,
            BLOCK_N,
            K_BITS,
            V_BITS,
            K_GROUP,
            PTX,
            DIRECT_KEYS,
            ONE_WARP,
        )
    else:
        KDP: tl.constexpr = D * K_BITS // 8
        VDP: tl.constexpr = D * V_BITS // 8
        KNG: tl.constexpr = 1 if K_CHANNEL else D // K_GROUP
        VNG: tl.constexpr = D // V_GROUP
        K_PACKED: tl.constexpr = K_CODE == 0 and K_BITS != 3  # the codes `_unpack` reads (uniform int, fp8)
        V_PACKED: tl.constexpr = V_CODE == 0 and V_BITS != 3
        K_ZERO: tl.constexpr = K_FP8 == 0 and (K_CODE == 0 or (K_CODE == 1 and K_CHANNEL))  # zero points stored
        V_ZERO: tl.constexpr = V_FP8 == 0 and V_CODE == 0
        kc_base = kc_ptr + b * skc_b + h * skc_h
        ks_base = ks_ptr + b * sks_b + h * sks_h
        kz_base = kz_ptr + b * skz_b + h * skz_h
        vc_base = vc_ptr + b * svc_b + h * svc_h
        vs_base = vs_ptr + b * svs_b + h * svs_h
        vz_base = vz_ptr + b * svz_b + h * svz_h
        if K_ROTATED:  # Hadamard: q . k = (q R) . (k R), the codes' space; sinks and residual keep q
            q = tl.load(qr_ptr + q_offs, mask=row_ok[:, None], other=0.0) * qk_scale
            q_hi, q_lo = _hi_lo(q)
        t_begin = pid_s * tiles_per_split
        t_end = tl.minimum(t_begin + tiles_per_split, n_tiles)
        # per-channel keys: q with the current key block's scales folded in (fp16 hi + lo halves) and q . zero;
        # a tile lies in one block (block_n <= K_GROUP), so they change once per block, not per tile
        # (FOLD_ONCE; where keeping them across tiles spills registers, the fold runs on every tile)
        qs_hi = tl.zeros([BLOCK_M, D], dtype=tl.float16)
        qs_lo = tl.zeros([BLOCK_M, D], dtype=tl.float16)
        qz = tl.zeros([BLOCK_M], dtype=tl.float32)
        for tile in range(t_begin, t_end):
            start = tile * BLOCK_N
            pos = start + offs_n  # [BN] absolute positions (int32, see _full_segment); rows [0, S) are dummies
            valid = (pos >= S) & (pos < Q)
            if K_PACKED:
                kbyte = tl.load(
                    kc_base + pos[:, None] * skc_t + tl.arange(0, KDP)[None, :], mask=valid[:, None], other=0
                )
                kcode = _unpack(kbyte, K_BITS, K_FP8, BLOCK_N, D, PTX)  # [BN, D] fp16
            else:
                kcode = _unpack_values(kc_base + pos[:, None] * skc_t, valid, K_BITS, K_CODE, klv_ptr, BLOCK_N, D, PTX)
            if K_CHANNEL and K_ROPE == 0:
                if (not FOLD_ONCE) or (tile == t_begin) or (start % K_GROUP == 0):  # entering a key block
                    blk = start // K_GROUP
                    ks = tl.load(ks_base + blk * sks_t + offs_d).to(tl.float32)  # [D]
                    if K_FP8 != 0:
                        ks = ks * _FP8_UNIT
                    qs_hi, qs_lo = _hi_lo(q * ks[None, :])
                    if K_ZERO:
                        kz = tl.load(kz_base + blk * skz_t + offs_d).to(tl.float32)
                        qz = tl.sum(q * kz[None, :], 1)
                s = _dot_hi_lo(qs_hi, qs_lo, tl.trans(kcode)) + qz[:, None]  # [BM, BN]
                if K_OUTLIERS > 0:  # + sum_j q[idx_tj] delta_tj, the fp16 deltas exact in a dense tile
                    kcorr = _outlier_tile(
                        kod_ptr + b * skod_b + h * skod_h,
                        koi_ptr + b * skoi_b + h * skoi_h,
                        skod_t,
                        skoi_t,
                        pos,
                        valid,
                        K_OUTLIERS,
                        BLOCK_N,
                        D,
                    )
                    s += _dot_hi_lo(q_hi, q_lo, tl.trans(kcorr))
            else:  # dequantize the tile in registers (fp32): per-token keys, or pre-RoPE keys to turn
                if K_CHANNEL:
                    blk = start // K_GROUP
                    ks = tl.load(ks_base + blk * sks_t + offs_d).to(tl.float32)  # [D]
                    k = kcode.to(tl.float32) * ks[None, :]
                    if K_ZERO:
                        k += tl.load(kz_base + blk * skz_t + offs_d).to(tl.float32)[None, :]
                else:
                    kg = tl.arange(0, KNG)[None, :]
                    if K_CODE == 2:
                        ks = _nvfp4_scales(
                            ks_base, kts_ptr + b * skts_b + h * skts_h, sks_t, pos, valid, row0, kts_block, KNG
                        )
                    else:
                        ks = tl.load(ks_base + pos[:, None] * sks_t + kg, mask=valid[:, None], other=0.0).to(tl.float32)
                    kz = ks
                    if K_ZERO:
                        kz = tl.load(kz_base + pos[:, None] * skz_t + kg, mask=valid[:, None], other=0.0).to(tl.float32)
                    elif K_FP8 != 0:
                        ks = ks * _FP8_UNIT
                    k = _dequantize_rows(kcode, ks, kz, K_GROUP, K_ZERO, BLOCK_N, D)  # [BN, D] fp32
                if K_OUTLIERS > 0:
                    k += _outlier_tile(
                        kod_ptr + b * skod_b + h * skod_h,
                        koi_ptr + b * skoi_b + h * skoi_h,
                        skod_t,
                        skoi_t,
                        pos,
                        valid,
                        K_OUTLIERS,
                        BLOCK_N,
                        D,
                    ).to(tl.float32)
                if K_ROPE > 0:  # the keys' RoPE at their positions, clamped to fp16's range as reference.dequantize
                    cs = pos[:, None] * scs_t + offs_d[None, :]
                    turned = valid[:, None] & (offs_d[None, :] < K_ROPE)
                    cos = tl.load(cos_ptr + cs, mask=turned, other=1.0)
                    sin = tl.load(sin_ptr + cs, mask=turned, other=0.0)
                    k = _rope_rows(k, cos, sin, BLOCK_N, D, K_ROPE)
                    k = tl.minimum(tl.maximum(k, -_FP16_MAX), _FP16_MAX)
                s = _dot_f32(q_hi, q_lo, tl.trans(k))
            s = tl.where(valid[None, :], s, float("-inf"))
            if V_PACKED:
                vbyte = tl.load(
                    vc_base + pos[:, None] * svc_t + tl.arange(0, VDP)[None, :], mask=valid[:, None], other=0
                )
            vg = tl.arange(0, VNG)[None, :]
            if V_CODE == 2:  # nvfp4: fp32 scales, the values rounded to fp16 once
                vs = _nvfp4_scales(vs_base, vts_ptr + b * svts_b + h * svts_h, svs_t, pos, valid, row0, vts_block, VNG)
            else:
                vs = tl.load(vs_base + pos[:, None] * svs_t + vg, mask=valid[:, None], other=0.0)  # [BN, VNG]
            vz = vs
            if V_ZERO:
                vz = tl.load(vz_base + pos[:, None] * svz_t + vg, mask=valid[:, None], other=0.0)
            elif V_FP8 != 0:
                vs = vs * _FP8_UNIT  # fp16: scales are at most 65504 / 448, times 256 stays finite
            if V_PACKED:
                vcode = _unpack(vbyte, V_BITS, V_FP8, BLOCK_N, D, PTX)
            else:  # looked-up values: scaled in fp32, rounded to fp16 once
                vcode = _unpack_values(vc_base + pos[:, None] * svc_t, valid, V_BITS, V_CODE, vlv_ptr, BLOCK_N, D, PTX)
                vs = vs.to(tl.float32)
            v = _dequantize_rows(vcode, vs, vz, V_GROUP, V_ZERO, BLOCK_N, D).to(tl.float16)
            if V_OUTLIERS > 0:  # + p_t delta_tj at channel idx_tj: the deltas join the fp16 values
                vcorr = _outlier_tile(
                    vod_ptr + b * svod_b + h * svod_h,
                    voi_ptr + b * svoi_b + h * svoi_h,
                    svod_t,
                    svoi_t,
                    pos,
                    valid,
                    V_OUTLIERS,
                    BLOCK_N,
                    D,
                )
                v += vcorr
            acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v)

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    slot = pid_bh.to(tl.int64) * parts + pid_s
    tl.store(o_part_ptr + (slot * BLOCK_M + offs_m[:, None]) * D + offs_d[None, :], o)
    tl.store(lse_part_ptr + slot * BLOCK_M + offs_m, lse)


@triton.jit(do_not_specialize=MERGE_STEP_INTS)
def _merge_kernel(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, n_parts, M, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """Program (batch * kv head): log-sum-exp merge of the n_parts partial results of its M rows."""
    pid = tl.program_id(0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    base = pid * n_parts
    mx = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for i in range(0, n_parts):
        mx = tl.maximum(mx, tl.load(lse_part_ptr + (base + i) * BLOCK_M + offs_m))
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for i in range(0, n_parts):
        w = tl.exp(tl.load(lse_part_ptr + (base + i) * BLOCK_M + offs_m) - mx)  # [BM]
        o = tl.load(o_part_ptr + ((base + i) * BLOCK_M + offs_m[:, None]) * D + offs_d[None, :])
        acc += w[:, None] * o
        total += w
    ok = total > 0.0
    out = acc / tl.where(ok, total, 1.0)[:, None]
    lse = tl.where(ok, mx + tl.log(tl.where(ok, total, 1.0)), float("-inf"))
    row_ok = offs_m < M
    tl.store(out_ptr + (pid * M + offs_m[:, None]) * D + offs_d[None, :], out, mask=row_ok[:, None])
    tl.store(lse_ptr + pid * M + offs_m, lse, mask=row_ok)


# --- launch: past_attention and the kernel's arguments ----------------------------------------------


def _levels(q: QuantizedTensor) -> torch.Tensor:
    """The codebook the kernel reads: fp16, as stored (QuantizedTensor's contract; the quantizer picks codes
    with the fp16 levels), so looked-up codes are exact fp16 dot operands."""
    return q.levels.half()


def _arg(t: torch.Tensor | None, dummy: torch.Tensor, row: int = 0) -> tuple:
    """(tensor, stride_b, stride_h, stride_t) for the kernel; empty or missing tensors become a dummy with the
    row stride `row` the real tensor would have (`launch.row_widths`: the same variant before and after)."""
    if t is None or t.numel() == 0:
        return dummy, 0, 0, row
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.shape[2] * t.stride(2) >= 2**31:  # the kernel's offsets within one (batch, head) are int32
        raise ValueError(f"a cache tensor of shape {tuple(t.shape)} is too long for one head's int32 offsets")
    return t, t.stride(0), t.stride(1), t.stride(2)


def past_attention(
    query: torch.Tensor,
    kv,
    scaling: float,
    mask: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    direct_keys: bool = False,
):
    """Fused decode attention of `query` over one layer's packed past (twin of `reference.past_attention`).

    query: [B, Hq, n, D] (any float dtype, any strides); kv: `kvdemo.cache.PackedKV`, kv.length > 0.
    num_splits: programs per (batch, kv head) the sequence is split over, before rounding to whole tiles:
    the quantized region and the full-precision residual get tiles of the same count each (default:
    about PROGRAMS_PER_SM programs per SM). The partial results are merged by log-sum-exp.
    block_n (tokens per tile, a power of two, capped by the key group), num_warps (defaults: `launch_config`)
    and num_stages are launch settings: only speed depends on them (the GPU benchmark sweeps them). The
    default tile is halved, once per shape, on a GPU whose shared memory per block cannot hold it.
    direct_keys: the plane-split loop's direct-keys form where `launch.direct_keys_config` gives it, with that
    function's tile, warps and stages unless given (a launch setting too: the same values; elsewhere the call
    runs as without it).
    Returns (out fp32 [B, Hq, n, D], lse fp32 [B, Hq, n]). A `mask`, or a shape outside
    `supports_attention`, is handed to the reference (the decode path never passes a mask).
    """
    if mask is not None or not supports_attention(query, kv):
        return reference_attention.past_attention(query, kv, scaling, mask)
    if kv.length <= 0:
        raise ValueError("past_attention needs a non-empty past (kv.length > 0)")
    _, hq, n, d = query.shape
    block_m = _block_m((hq // kv.kv_heads) * n)
    cc = capability(query.device)
    default_n, default_warps = launch_config(d, block_m, cc, method_kind(kv))
    spec = kv.spec
    default_stages = NUM_STAGES
    direct_config = direct_keys_config(spec, d, block_m, cc) if direct_keys else None
    if direct_config:
        default_n, default_warps, default_stages = direct_config
    num_stages = num_stages or default_stages
    explicit_block_n = block_n is not None
    # a GPU with less shared memory per block than sm_90 (a T4 has 64 KiB) cannot run the default tile:
    # halve it until it launches, once per shape, and remember what fits (a block_n given is not changed)
    methods = (spec.outliers, spec.pre_rope, spec.hadamard)
    fits_key = (query.device, d, block_m, spec.key_format, spec.value_format, spec.key_axis, methods, query.dtype)
    fits_key += (num_stages, direct_keys)
    block_n = block_n or _FITTING_BLOCK_N.get(fits_key, default_n)
    while True:
        try:
            warps = num_warps or default_warps
            direct = direct_keys and direct_keys_allowed(spec, d, warps)
            out, lse = _launch_decode(
                query, kv, scaling, block_n, block_m, num_splits, warps, num_stages, fold_once(d, cc), direct
            )
            break
        except triton.runtime.errors.OutOfResources:
            if explicit_block_n or block_n <= 16:
                raise
            block_n //= 2
    if not explicit_block_n:
        _FITTING_BLOCK_N[fits_key] = block_n
    return out, lse


_FITTING_BLOCK_N: dict[tuple, int] = {}  # default tiles halved to fit a GPU's shared memory, per shape


def _launch_decode(query, kv, scaling, block_n, block_m, num_splits, num_warps, num_stages, keep_fold, direct=False):
    """The two launches of `past_attention` for one tile size: the split kernel, then the merge."""
    b, hq, n, d = query.shape
    hkv, r = kv.kv_heads, kv.regions
    m = (hq // hkv) * n
    s_len, q_len, r_len = r.sinks, r.quantized, r.residual
    quant = r.has_codes
    keys, values = kv.keys.quantized, kv.values.quantized  # QuantizedTensor, or None without codes
    block_n = min(block_n, MAX_BLOCK_N)
    if kv.spec.is_quantized and kv.spec.key_axis == "channel":  # tiles stay inside one key block
        block_n = min(block_n, kv.spec.key_group(d))
    if not (_pow2(block_n) and block_n >= 16):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    # a fixed grid: `splits` programs share the tiles, one more takes the rest (a bound: ceil(q / t) + ceil(r / t)
    # <= splits + 1 for t >= (q + r) / splits); the kernel reads the lengths and works out its share
    splits = (
        max(1, int(num_splits)) if num_splits is not None else splits_for(b * hkv, query.device, num_warps=num_warps)
    )
    min_tiles = 1 if num_splits is not None else MIN_TILES_PER_SPLIT
    parts = splits + 1
    lens = kv.lengths  # int32 [S, Q, R] on the device, kept by the layer for its whole past
    if lens is None:  # a view of part of a layer's past: its own lengths, copied to the device
        lens = torch.tensor([s_len, q_len if quant else 0, r_len], dtype=torch.int32).to(query.device)
    partials = scratch(query.device, b * hkv * parts * block_m * (d + 1))  # merged within this call
    o_part = partials[: b * hkv * parts * block_m * d].view(b * hkv, parts, block_m, d)
    lse_part = partials[b * hkv * parts * block_m * d :].view(b * hkv, parts, block_m)
    out = torch.empty((b, hq, n, d), dtype=torch.float32, device=query.device)
    lse = torch.empty((b, hq, n), dtype=torch.float32, device=query.device)
    # stand-ins for absent tensors, of the dtypes the kernel reads there (it is compiled for both branches:
    # a float pointer where codes belong would give the PTX unpacking blocks fp32 inputs)
    dummy = query
    absent = stand_ins(query.device)
    no_codes, no_meta, no_fp32 = absent["u8"], absent["fp16"], absent["fp32"]
    q_arg = query if query.stride(-1) == 1 else query.contiguous()
    k_rot = quant and keys.rotation is not None
    v_rot = quant and values.rotation is not None
    if k_rot:  # the codes see q @ R: both contiguous, so one set of strides serves q and q @ R
        q_arg = q_arg.contiguous()
        q_rot = (q_arg.float() @ keys.rotation.to(device=query.device, dtype=torch.float32)).contiguous()
    k_rope = quant and keys.rope is not None
    if k_rope:
        cos, sin = keys.rope.tables(keys.start, keys.start + keys.codes.shape[-2], query.device)  # [rows, rd]
    consts = decode_constants(kv.spec, d, block_n, cos.shape[-1] if k_rope else 0)
    rows = row_widths(kv.spec, d)
    plane_split_loop = consts.get("PLANE_SPLIT", False) and keep_fold  # the kernel's `PLANE_SPLIT and FOLD_ONCE`
    if plane_split_loop and quant and not values.paired:  # not from the cache: pair them as the cache does
        values = paired(values)
    vs_args = _arg(values.scale if quant else None, no_meta, rows["vs"])
    if plane_split_loop:  # it steps over (scale, zero) words: their row stride in words, 1 (a JIT constant)
        vs_args = (*vs_args[:3], vs_args[3] // 2)
    # paired values' zeros sit a row of scales (rows["vs"] / 2 elements) past them: aligned to 16 bytes or not
    no_vz = absent["fp16_unaligned"] if values_paired(kv.spec) and (rows["vs"] // 2) % 8 else no_meta
    k_cap = keys.outlier_index.shape[-1] if quant and keys.outlier_index is not None else 0
    v_cap = values.outlier_index.shape[-1] if quant and values.outlier_index is not None else 0
    _decode_split_kernel[(parts, b * hkv)](
        q_arg,
        *q_arg.stride()[:3],
        *_arg(kv.keys.sinks, dummy),
        *_arg(kv.values.sinks, dummy),
        *_arg(kv.keys.residual, dummy),
        *_arg(kv.values.residual, dummy),
        *_arg(keys.codes if quant else None, no_codes, rows["kc"]),
        *_arg(keys.scale if quant else None, no_meta, rows["ks"]),
        *_arg(keys.zero if quant else None, no_meta, rows["kz"]),
        *_arg(values.codes if quant else None, no_codes, rows["vc"]),
        *vs_args,
        *_arg(values.zero if quant else None, no_vz, rows["vz"]),
        q_rot if k_rot else q_arg,
        _levels(keys) if quant and keys.levels is not None else no_meta,
        _levels(values) if quant and values.levels is not None else no_meta,
        *_arg(keys.tensor_scale if quant else None, no_fp32)[:3],
        *_arg(values.tensor_scale if quant else None, no_fp32)[:3],
        keys.start if quant else 0,
        max(1, keys.block) if quant else 1,
        max(1, values.block) if quant else 1,
        *_arg(keys.outlier_delta if k_cap else None, no_meta, rows["ko"]),
        *_arg(keys.outlier_index if k_cap else None, no_codes, rows["ko"]),
        *_arg(values.outlier_delta if v_cap else None, no_meta, rows["vo"]),
        *_arg(values.outlier_index if v_cap else None, no_codes, rows["vo"]),
        cos if k_rope else no_fp32,
        sin if k_rope else no_fp32,
        cos.stride(0) if k_rope else 0,
        o_part,
        lse_part,
        hkv,
        n,
        m,
        lens,
        splits,
        min_tiles,
        float(scaling) * LOG2E,
        parts,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PTX=ptx_unpacking(),
        FOLD_ONCE=keep_fold,
        **consts,
        **form_constants(direct, num_warps),
        num_warps=num_warps,
        num_stages=num_stages,
        **({"maxnreg": cap} if (cap := max_registers(kv.spec, d, num_warps)) else {}),
    )
    if v_rot:  # the quantized splits' outputs are in the values' rotated space: turn them back (out @ R.T)
        n_tiles, r_tiles = cdiv(q_len, block_n), cdiv(r_len, block_n)  # as the kernel shares them out
        q_splits = cdiv(n_tiles, max(min_tiles, cdiv(n_tiles + r_tiles, splits)))
        rot = values.rotation.to(device=query.device, dtype=torch.float32)
        o_part[:, :q_splits] = o_part[:, :q_splits] @ rot.T
    _merge_kernel[(b * hkv,)](o_part, lse_part, out, lse, parts, m, BLOCK_M=block_m, D=d, num_warps=4)
    return out, lse


def kv_bytes_read(kv) -> int:
    """Bytes of K/V the decode kernel reads for one call (codes, metadata, sparse outliers, codebooks, sinks,
    residual; not pre-RoPE keys' cos/sin tables): for benchmarks."""
    total = 0
    for part in (kv.keys, kv.values):
        tensors = [part.sinks, part.residual]
        if kv.regions.has_codes:
            q = part.quantized
            tensors += [q.codes, q.scale, q.zero, q.tensor_scale, q.outlier_delta, q.outlier_index, q.levels]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total
