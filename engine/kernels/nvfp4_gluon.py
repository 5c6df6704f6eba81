"""NVFP4 decode GEMMs for Hopper (sm_90, M <= 16 tokens), in Gluon: y = x @ W^T.

`decode_matmul(x, w, out)` (mma.sync) and `wgmma_matmul(x, w, out)` (warpgroup MMA; the format's
list puts the first up to 4 tokens and the second up to 16, and its tuner chooses per weight): x
bf16 [M, K] (unit stride along K), w an NVFP4 weight as in engine/kernels/nvfp4_triton.py
(K % 64 == 0; K % 128 == 0 when tiled); with swiglu=True, W a fused
gate/up projection and out silu(gate) * up [M, N/2]. `decode_config` / `swiglu_config` /
`wgmma_config` hold their tuning constants. Both read each weight byte once, straight into
registers; they differ in where x comes from, whose traffic grows with M.

mma.sync kernel (Marlin-style: every operand in registers, explicit layouts checked at compile time):
- mma.sync m16n8k16 bf16 -> fp32; the weights are the A operand (16 rows), x^T the B operand (one
  n8 token tile for M <= 8, two for 9..16).
- Packed words load straight into the A fragment's registers: the K permutation of the Triton
  decode kernel (`_logical_k` there, applied to W and x alike) makes a thread's 8 K values per 32 K
  one word; thread q of a lane quad loads WPT consecutive words of rows g and g + 8. Every reshape
  from the loaded words to the operand is `convert_layout(..., assert_trivial=True)`: the compiler
  refuses the kernel if any would move data between threads.
- Decode in inline PTX (`_decode_asm`): 13 integer instructions per word put each code's sign on
  bf16 bit 15 and its magnitude on bits 8:6 (value x 2^-126), 4 bf16x2 multiplies apply the block
  scale, pre-converted to bf16 x 2^118 (`_scale_asm`); the epilogue multiplies by 2^8 x tensor scale.
- x: 16-byte loads, permuted in registers to the logical K order (reused from L1 by every program).
  Rows past M and N re-read the last one, so the K loop has no masks.
- Two K steps in flight per warp (`stream_steps`, shared with engine/kernels/sparse24_gluon.py, as
  is the epilogue `store_rows`, whose RMSNorm hand-off only the 2:4 kernel runs). WK warps split K
  step by step and meet once through shared memory; SPLIT_K programs split K, reduced in the same
  launch (engine/kernels/split_k.py's protocol).
- Storage: row-major or the 16-row x 128-K tiles (TILED), where a warp's K step is one contiguous
  1 KB read: contiguity is what moves this kernel (BENCHMARKS.md lists what was tried).

wgmma kernel (`nvfp4_wgmma_decode_kernel`): the same weight loads and decode, into the A operand of
wgmma m64nMPk16 (one warpgroup per 64 rows); x, the B operand, comes from shared memory, read by
the tensor cores once per warpgroup where the mma.sync kernel reads it from L1 once per warp (at
16 tokens 4 bytes of x per weight byte). x moves with the weights, two K steps ahead, through
registers (where it is permuted to the logical K order) into a ring of 4 steps.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from engine.kernels.platform import sm_count
from engine.kernels.split_k import split_k_buffers

# The CTA-wide barrier is gl.thread_barrier in Triton 3.6 (the GPU machine's) and gl.barrier in later
# releases (3.9 here): the split-K reduction compiles with either.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.constexpr_function
def _log2(v: int) -> int:
    assert v > 0 and v & (v - 1) == 0, v
    return v.bit_length() - 1


@gluon.constexpr_function
def _bases(block_n: int, wn: int, wk: int):
    """Where the MMA's A operand (and accumulator) puts rows, for [wk, block_n, ...] tensors: rows
    +1, +2, +4 on lanes, +8 in a register, +16.. on the wn row warps, further 16*wn-row blocks in
    registers; the wk warps along K (the leading dimension) after the row warps."""
    regs = [[0, 8, 0]] + [[0, 16 * wn << i, 0] for i in range(_log2(block_n // (16 * wn)))]
    lanes = [[0, 1, 0], [0, 2, 0], [0, 4, 0]]
    warps = [[0, 16 << i, 0] for i in range(_log2(wn))] + [[1 << i, 0, 0] for i in range(_log2(wk))]
    return regs, lanes, warps


@gluon.constexpr_function
def mma_layout(wn, wk):
    """mma.sync m16n8k16, a batch of wk independent K slices (one per warp group along K)."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[wk, wn, 1],
                                     instr_shape=[1, 16, 8])


@gluon.constexpr_function
def words_layout(block_n, wpt, wn, wk):
    """[wk, block_n, 4*wpt] int32 packed words of one K step: thread q of a row's lane quad holds
    words q*wpt .. q*wpt + wpt-1 (4*wpt contiguous bytes), rows as in the MMA's A operand."""
    regs, lanes, warps = _bases(block_n, wn, wk)
    word_regs = [[0, 0, 1 << i] for i in range(_log2(wpt))]
    return gl.DistributedLinearLayout(
        reg_bases=word_regs + regs, lane_bases=[[0, 0, wpt], [0, 0, 2 * wpt]] + lanes,
        warp_bases=warps, block_bases=[], shape=[wk, block_n, 4 * wpt])


@gluon.constexpr_function
def scales_layout(block_n, wn, wk):
    """[wk, block_n, 4] block scales of one K step, each element the wpt/2 scales (u8, u16 or u32)
    of one thread's words: thread q of a row's lane quad holds element q."""
    regs, lanes, warps = _bases(block_n, wn, wk)
    return gl.DistributedLinearLayout(
        reg_bases=regs, lane_bases=[[0, 0, 1], [0, 0, 2]] + lanes, warp_bases=warps,
        block_bases=[], shape=[wk, block_n, 4])


@gluon.constexpr_function
def x_layout(mp, step_k, wn, wk):
    """[wk, mp, step_k] bf16 activations of one K step in physical K order: thread (g, q) holds
    row g (and g + 8), physical K step_k/4 * q .. step_k/4 * (q + 1) - 1 (16-byte loads or wider);
    the row warps all load the same."""
    k_regs = [[0, 0, 1 << i] for i in range(_log2(step_k // 4))]
    m_regs = [[0, 8, 0]] if mp == 16 else []
    return gl.DistributedLinearLayout(
        reg_bases=k_regs + m_regs,
        lane_bases=[[0, 0, step_k // 4], [0, 0, step_k // 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[0, 0, 0]] * _log2(wn) + [[1 << i, 0, 0] for i in range(_log2(wk))],
        block_bases=[], shape=[wk, mp, step_k])


def _decode_asm() -> str:
    """One packed word (8 e2m1 codes) and its block scale (bf16x2, s x 2^118 twice) -> 4 bf16x2
    registers: register j = nibbles (j, j + 4), each as value x scale x 2^-8. Called with pack=8 on
    the word and scale repeated 8 times (`_dup8`): $4..$11 all hold the word, $12..$19 the scale.
    Per pair: mask the two nibbles (16 bits apart), multiply by 2^6 + 2^12 (nibbles at bit 0) or
    2^2 + 2^8 (at bit 4) to put the magnitude on bits 8:6 and the sign on bit 15 of each half,
    mask again, multiply by the scale."""
    lines = ["{", ".reg .b32 t0, t1;"]
    for out, src, mask, mul in (("$0", "$4", "0x000F000F", "0x1040"),
                                ("$1", "$4", "0x00F000F0", "0x104"),
                                ("$2", "t1", "0x000F000F", "0x1040"),
                                ("$3", "t1", "0x00F000F0", "0x104")):
        if out == "$2":
            lines.append("shr.u32 t1, $4, 8;")
        lines += [f"and.b32 t0, {src}, {mask};", f"mul.lo.u32 t0, t0, {mul};",
                  "and.b32 t0, t0, 0x81C081C0;", f"mul.rn.bf16x2 {out}, t0, $12;"]
    return "\n".join(lines + ["}"])


_DECODE_ASM = gl.constexpr(_decode_asm())
_DECODE_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 16))


def _scale_asm(count: int) -> str:
    """`count` (2 or 4) e4m3 block scales in one 16- or 32-bit register -> `count` bf16x2 words,
    s x 2^118 twice each: spread the bytes to bf16 halves, shift left by 4 (e4m3's exponent and
    mantissa land on bf16's exponent low bits and mantissa top: the value x 2^-120, subnormals
    included; block scales are >= 0), multiply by 2^119 twice (exact), copy each half to both."""
    lines = ["{", ".reg .b32 t, c, src;", "mov.b32 c, 0x7B007B00;",
             "cvt.u32.u16 src, $2;" if count == 2 else "mov.b32 src, $4;"]
    for pair in range(count // 2):
        lines += [f"prmt.b32 t, src, 0, {0x5140 + 0x202 * pair:#x};", "shl.b32 t, t, 4;",
                  "mul.rn.bf16x2 t, t, c;", "mul.rn.bf16x2 t, t, c;",
                  f"prmt.b32 ${2 * pair}, t, 0, 0x1010;",
                  f"prmt.b32 ${2 * pair + 1}, t, 0, 0x3232;"]
    return "\n".join(lines + ["}"])


_SCALE2_ASM = gl.constexpr(_scale_asm(2))
_SCALE4_ASM = gl.constexpr(_scale_asm(4))


@gluon.jit
def _dup8(v):
    """[..., W] -> [..., W, 2, 2, 2], each value repeated (3 register bits, no data movement)."""
    v = gl.join(v, v)
    v = gl.join(v, v)
    return gl.join(v, v)


@gluon.jit
def _load_step(words_ptrs, side_ptrs, j: gl.constexpr, WK: gl.constexpr, W_STEP: gl.constexpr,
               S_STEP: gl.constexpr):
    """Packed words and their side data (block scales or 2:4 metadata) of the j-th K step after
    the pointers' (the warps' K slices interleave step by step; W_STEP words and S_STEP side
    elements from a step to the next): a compile-time offset, folded into the load's address.
    Rows past N were clamped, so nothing is masked."""
    words = gl.load(words_ptrs + j * WK * W_STEP)
    side = gl.load(side_ptrs + j * WK * S_STEP)
    return words, side


@gluon.jit
def _word_scales(scales, words, WK: gl.constexpr, BLOCK_N: gl.constexpr, WPT: gl.constexpr):
    """Block scales [WK, BLOCK_N, 4] (element q: the WPT/2 scales of thread q's words) -> one
    bf16x2 scale (s x 2^118 twice) per packed word, in the words' layout; word j = WPT*q + c has
    scale WPT/2*q + c//2."""
    if WPT == 8:
        s0, s1, s2, s3 = gl.inline_asm_elementwise(
            _SCALE4_ASM, "=r,=r,=r,=r,r", [scales], dtype=(gl.int32,) * 4, is_pure=True, pack=1)
        s = gl.join(gl.join(s0, s1), gl.join(s2, s3)).permute(0, 1, 2, 4, 3)
    elif WPT == 4:
        s0, s1 = gl.inline_asm_elementwise(_SCALE2_ASM, "=r,=r,h", [scales], dtype=(gl.int32,) * 2,
                                           is_pure=True, pack=1)
        s = gl.join(s0, s1)
    else:
        s0, s1 = gl.inline_asm_elementwise(_SCALE2_ASM, "=r,=r,h", [scales.to(gl.uint16)],
                                           dtype=(gl.int32,) * 2, is_pure=True, pack=1)
        s = s0
    s = gl.join(s, s).reshape(WK, BLOCK_N, 4 * WPT)
    return gl.convert_layout(s, words.type.layout, assert_trivial=True)


@gluon.jit
def _decode_words(words, scales, WK: gl.constexpr, BLOCK_N: gl.constexpr, WPT: gl.constexpr):
    """One K step's packed words [WK, BLOCK_N, 4 * WPT] and block scales -> the bf16 weights
    [WK, BLOCK_N, 32 * WPT] (times 2^-8) in logical K order, each thread's values where it loaded
    their words: [.., rows, word j = (q, c), b, h, p] -> logical K = 32c + 16b + 8h + 2q + p."""
    s = _word_scales(scales, words, WK, BLOCK_N, WPT)
    w = gl.inline_asm_elementwise(_DECODE_ASM, _DECODE_CONSTRAINTS, [_dup8(words), _dup8(s)],
                                  dtype=gl.bfloat16, is_pure=True, pack=8)
    w = w.reshape(WK, BLOCK_N, 4, WPT, 2, 2, 2).permute(0, 1, 3, 4, 5, 2, 6)
    return w.reshape(WK, BLOCK_N, 32 * WPT)


@gluon.jit
def _logical_x(x, LEAD: gl.constexpr, MP: gl.constexpr, WPT: gl.constexpr):
    """x [LEAD, MP, 32 * WPT] of one K step in physical K order, 8*WPT*q + 8c + 4p + 2b + h, ->
    the logical order of `_decode_words`, 32c + 16b + 8h + 2q + p."""
    xt = x.reshape(LEAD, MP, 4, WPT, 2, 2, 2).permute(0, 1, 3, 5, 6, 2, 4)
    return xt.reshape(LEAD, MP, 32 * WPT)


@gluon.jit
def _mma_step(words, scales, x, acc, WK: gl.constexpr, BLOCK_N: gl.constexpr, WPT: gl.constexpr,
              MP: gl.constexpr):
    """acc += decode(words, scales) @ x^T for one K step, all in registers."""
    mma: gl.constexpr = acc.type.layout
    a = gl.convert_layout(_decode_words(words, scales, WK, BLOCK_N, WPT), gl.DotOperandLayout(0, mma, 2),
                          assert_trivial=True)
    xt = _logical_x(x, WK, MP, WPT)
    b = gl.convert_layout(xt.permute(0, 2, 1), gl.DotOperandLayout(1, mma, 2), assert_trivial=True)
    return mma_v2(a, b, acc)


@gluon.jit
def _stored_offsets(ks, rows, cols, k0, K: gl.constexpr, STEP_K: gl.constexpr, PER_K: gl.constexpr,
                    TILED: gl.constexpr):
    """[WK, R, C] offsets of the elements (PER_K of them per row and 128 K: 16 words, or block
    scales of 4, 2 or 1 bytes: 2, 4 or 8) of K steps `ks`, rows `rows`, columns `cols` within a
    step, from K position k0; row-major or in tiles of 16 rows x 128 K (engine/formats/nvfp4.py)."""
    if TILED:  # STEP_K and k0 multiples of 128
        c = (ks * (STEP_K // 128 * PER_K))[:, None, None] + cols[None, None, :] + k0 // 128 * PER_K
        row = (rows // 16) * (K // 128 * 16 * PER_K) + (rows % 16) * PER_K
        return row[None, :, None] + (c // PER_K) * (16 * PER_K) + c % PER_K
    else:
        return ((ks * (STEP_K * PER_K // 128))[:, None, None] + (rows * (K * PER_K // 128))[None, :, None]
                + cols[None, None, :] + k0 * PER_K // 128)


@gluon.jit
def _weight_rows(n0, rows, N, WN: gl.constexpr, SWIGLU: gl.constexpr):
    """The weight row each program row reads (clamped to the last). SWIGLU (a fused gate/up
    weight: rows [0, N/2) gate, [N/2, N) up): a program of BLOCK_N rows takes BLOCK_N/2 gate rows
    and the same up rows, n0/2 onwards; of a warp's 16-row blocks (registers, 16 * WN rows apart)
    the even ones are gate, the odd ones up, so each thread holds both of its outputs (`store_rows`)."""
    if SWIGLU:
        pair = rows // (32 * WN)
        out = pair * (16 * WN) + rows % (16 * WN)
        return gl.minimum(n0 // 2 + out, N // 2 - 1) + ((rows // (16 * WN)) % 2) * (N // 2)
    else:
        return gl.minimum(n0 + rows, N - 1)


@gluon.jit
def stream_pointers(words_ptr, scale_ptr, x_ptr, n0, k0, M, N, stride_xm, K: gl.constexpr,
                    BLOCK_N: gl.constexpr, WPT: gl.constexpr, MP: gl.constexpr, WN: gl.constexpr,
                    WK: gl.constexpr, STEP_K: gl.constexpr, TILED: gl.constexpr = False,
                    SWIGLU: gl.constexpr = False):
    """Pointers to a program's first K step: packed words [WK, BLOCK_N, 4 * WPT] (int32, 4 * WPT
    per row and step), block scales [WK, BLOCK_N, 4] (one element per thread: its WPT words'
    scales, read as u8 / u16 / u32) and x [WK, MP, STEP_K]; TILED: the weight stored in tiles
    (WPT 4 or 8); SWIGLU: rows as `_weight_rows` maps them. Warp slice w of the WK takes steps
    w, w + WK, ... (the CTA's warps read neighbouring chunks of the same rows together). Rows past
    N (tail tile) re-read row N-1 and are never stored, x rows past M re-read row M-1: no masks in
    the loop."""
    w_layout: gl.constexpr = words_layout(BLOCK_N, WPT, WN, WK)
    s_layout: gl.constexpr = scales_layout(BLOCK_N, WN, WK)
    xl: gl.constexpr = x_layout(MP, STEP_K, WN, WK)
    w_ks = gl.arange(0, WK, layout=gl.SliceLayout(1, gl.SliceLayout(2, w_layout)))
    w_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, w_layout)))
    w_cols = gl.arange(0, 4 * WPT, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_layout)))
    offs_w = _stored_offsets(w_ks, _weight_rows(n0, w_rows, N, WN, SWIGLU), w_cols, k0, K, STEP_K, 16,
                             TILED)
    s_ks = gl.arange(0, WK, layout=gl.SliceLayout(1, gl.SliceLayout(2, s_layout)))
    s_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, s_layout)))
    s_cols = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, s_layout)))
    offs_s = _stored_offsets(s_ks, _weight_rows(n0, s_rows, N, WN, SWIGLU), s_cols, k0, K, STEP_K,
                             512 // STEP_K, TILED)  # 4 elements per step: 8 bytes per 128 K
    x_ks = gl.arange(0, WK, layout=gl.SliceLayout(1, gl.SliceLayout(2, xl)))
    x_rows = gl.arange(0, MP, layout=gl.SliceLayout(0, gl.SliceLayout(2, xl)))
    x_cols = gl.arange(0, STEP_K, layout=gl.SliceLayout(0, gl.SliceLayout(1, xl)))
    offs_x = (x_ks[:, None, None] * STEP_K + gl.minimum(x_rows, M - 1)[None, :, None] * stride_xm
              + x_cols[None, None, :])
    words_ptrs = words_ptr + offs_w
    if WPT == 8:
        scale_ptrs = scale_ptr.to(gl.pointer_type(gl.uint32), bitcast=True) + offs_s
    elif WPT == 4:
        scale_ptrs = scale_ptr.to(gl.pointer_type(gl.uint16), bitcast=True) + offs_s
    else:
        scale_ptrs = scale_ptr + offs_s
    x_ptrs = x_ptr + k0 + offs_x
    return words_ptrs, scale_ptrs, x_ptrs


@gluon.jit
def stream_steps(MMA_STEP: gl.constexpr, words_ptrs, side_ptrs, x_ptrs, acc,
                 STEPS: gl.constexpr, STEP_K: gl.constexpr, WK: gl.constexpr, BLOCK_N: gl.constexpr,
                 WPT: gl.constexpr, MP: gl.constexpr, X_AHEAD: gl.constexpr = False,
                 S_STEP: gl.constexpr = 4, W_STEP: gl.constexpr = 0):
    """acc += every K step of the warp's slice, MMA_STEP(words, side, x, acc, ..) decoding
    one step. Two steps in flight: the loop body consumes steps i, i+1 and refills them with i+2,
    i+3; the pointers advance once per body, the steps are constant offsets from them. X_AHEAD:
    x is loaded with the weights, two steps ahead (the sparse-MMA 2:4 kernel, whose x share of the
    bytes is larger), else when its step runs (fewer registers). S_STEP: side elements from a step to the
    next (4, one per thread of a row's quad; the sparse-MMA kernel's metadata registers are stored
    per 16-row block and step). W_STEP: words from a step to the next (0: 4 * WPT, row-major;
    tiled storage: 16 x that)."""
    X_STEP: gl.constexpr = WK * STEP_K
    WS: gl.constexpr = W_STEP if W_STEP else 4 * WPT
    w_a, s_a = _load_step(words_ptrs, side_ptrs, 0, WK, WS, S_STEP)
    if X_AHEAD:
        x_a = gl.load(x_ptrs)
    if STEPS > 1:
        w_b, s_b = _load_step(words_ptrs, side_ptrs, 1, WK, WS, S_STEP)
        if X_AHEAD:
            x_b = gl.load(x_ptrs + X_STEP)
    else:  # one step per warp (small K): the loop below runs no iteration but is still compiled
        w_b, s_b = w_a, s_a
        if X_AHEAD:
            x_b = x_a
    for _ in range((STEPS - 2) // 2):
        if X_AHEAD:
            acc = MMA_STEP(w_a, s_a, x_a, acc, WK, BLOCK_N, WPT, MP)
            w_a, s_a = _load_step(words_ptrs, side_ptrs, 2, WK, WS, S_STEP)
            x_a = gl.load(x_ptrs + 2 * X_STEP)
            acc = MMA_STEP(w_b, s_b, x_b, acc, WK, BLOCK_N, WPT, MP)
            w_b, s_b = _load_step(words_ptrs, side_ptrs, 3, WK, WS, S_STEP)
            x_b = gl.load(x_ptrs + 3 * X_STEP)
        else:
            acc = MMA_STEP(w_a, s_a, gl.load(x_ptrs), acc, WK, BLOCK_N, WPT, MP)
            w_a, s_a = _load_step(words_ptrs, side_ptrs, 2, WK, WS, S_STEP)
            acc = MMA_STEP(w_b, s_b, gl.load(x_ptrs + X_STEP), acc, WK, BLOCK_N, WPT, MP)
            w_b, s_b = _load_step(words_ptrs, side_ptrs, 3, WK, WS, S_STEP)
        words_ptrs += 2 * WK * WS
        side_ptrs += 2 * WK * S_STEP
        x_ptrs += 2 * X_STEP
    LEFT: gl.constexpr = STEPS - 2 * ((STEPS - 2) // 2) if STEPS > 1 else 1  # 1, 2 or 3
    if not X_AHEAD:
        x_a = gl.load(x_ptrs)
    acc = MMA_STEP(w_a, s_a, x_a, acc, WK, BLOCK_N, WPT, MP)
    if LEFT == 3:
        w_a, s_a = _load_step(words_ptrs, side_ptrs, 2, WK, WS, S_STEP)
        x_a = gl.load(x_ptrs + 2 * X_STEP)
    if LEFT >= 2:
        if not X_AHEAD:
            x_b = gl.load(x_ptrs + X_STEP)
        acc = MMA_STEP(w_b, s_b, x_b, acc, WK, BLOCK_N, WPT, MP)
    if LEFT == 3:
        acc = MMA_STEP(w_a, s_a, x_a, acc, WK, BLOCK_N, WPT, MP)
    return acc


@gluon.jit
def _split_k_arrive(acc, acc_ptrs, mask, counter_ptr, SPLIT_K: gl.constexpr):
    """engine/kernels/split_k.py's split_k_arrive in Gluon: add the partial sums, count the
    arrival; true in the program that arrives last."""
    gl.atomic_add(acc_ptrs, acc, mask=mask, sem="relaxed")
    _cta_barrier()
    arrived = gl.atomic_add(counter_ptr, 1, sem="acq_rel")
    _cta_barrier()
    return arrived == SPLIT_K - 1


@gluon.jit
def _split_k_take(acc_ptrs, mask, counter_ptr):
    """split_k_take in Gluon: the summed accumulator; leaves it and the counter zero."""
    total = gl.load(acc_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    _cta_barrier()
    gl.store(acc_ptrs, gl.zeros_like(total), mask=mask)
    gl.store(counter_ptr, 0)
    return total


@gluon.jit
def store_rows(ROW_SCALE: gl.constexpr, acc, scale_ptr, n0, pid_n, M, N, out_ptr, stride_om, acc_ptr,
               count_ptr, BLOCK_N: gl.constexpr, MP: gl.constexpr, SPLIT_K: gl.constexpr,
               SWIGLU_WN: gl.constexpr = 0, NORM_IN: gl.constexpr = False, NORM_OUT: gl.constexpr = False,
               parts_in=None, eps=0.0, K: gl.constexpr = 1, parts_ptr=None, g_ptr=None, xg_ptr=None):
    """y[:M, n0 : n0 + BLOCK_N] = ROW_SCALE(total, scale_ptr, rows, N), total the sum of the warps'
    K slices (through shared memory when WK > 1). With SPLIT_K > 1 the programs of a row tile add
    into acc_ptr (fp32 [M, N], zero on entry) and the last one writes y and zeroes acc_ptr and its
    counter in count_ptr. SWIGLU_WN > 0: the rows are gate and up rows as `_weight_rows` maps them
    with WN = SWIGLU_WN, and y[:M, n0/2 : (n0 + BLOCK_N)/2] = silu(gate) * up, N/2 wide (the
    split-K scratch is then indexed by program row, programs x BLOCK_N wide).
    The RMSNorm hand-off (engine/kernels/stream_triton.py states the protocol): NORM_IN scales each
    token's y by rsqrt(sum of parts_in / K + eps) first (parts_in from `load_parts`); NORM_OUT (no
    SwiGLU) adds y into out, the residual, and writes xg = out * g_ptr and the tile's sums of
    squares to parts_ptr row pid_n."""
    mma: gl.constexpr = acc.type.layout
    if len(acc.shape) == 3:  # [WK, BLOCK_N, MP]: the warps' K slices
        total = gl.sum(acc, axis=0)
        out_layout: gl.constexpr = gl.SliceLayout(0, mma)
    else:  # [BLOCK_N, MP]: one warpgroup MMA accumulator
        total = acc
        out_layout: gl.constexpr = mma
    rows_o = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
    cols_o = gl.arange(0, MP, layout=gl.SliceLayout(0, out_layout))
    offs = cols_o[None, :] * stride_om + rows_o[:, None]
    out_ptrs = out_ptr + offs
    mask = (cols_o < M)[None, :] & (rows_o < N)[:, None]
    if SWIGLU_WN > 0:
        width = gl.num_programs(0) * BLOCK_N
        scratch_mask = (cols_o < M)[None, :] & (rows_o >= 0)[:, None]
    else:
        width = N
        scratch_mask = mask
    if SPLIT_K > 1:
        acc_ptrs = acc_ptr + cols_o[None, :] * width + rows_o[:, None]
        last = _split_k_arrive(total, acc_ptrs, scratch_mask, count_ptr + pid_n, SPLIT_K)
        if last:
            total = _split_k_take(acc_ptrs, scratch_mask, count_ptr + pid_n)
    else:
        last = True
    if last:
        y = ROW_SCALE(total, scale_ptr, rows_o, N)
        if NORM_IN:
            rstd = 1.0 / gl.sqrt(gl.sum(parts_in, axis=0) / K + eps)
            y = y * gl.convert_layout(rstd, gl.SliceLayout(0, out_layout))[None, :]
        if SWIGLU_WN > 0:
            _store_swiglu(y, rows_o - n0, cols_o, n0 // 2, M, N // 2, out_ptr, stride_om, BLOCK_N, MP,
                          16 * SWIGLU_WN)
        elif NORM_OUT:
            h = (y + gl.load(out_ptrs, mask=mask, other=0.0).to(gl.float32)).to(out_ptr.dtype.element_ty)
            gl.store(out_ptrs, h, mask=mask)
            h = gl.where(mask, h.to(gl.float32), 0.0)
            g = gl.load(g_ptr + gl.minimum(rows_o, N - 1)).to(gl.float32)
            gl.store(xg_ptr + offs, (h * g[:, None]).to(xg_ptr.dtype.element_ty), mask=mask)
            gl.store(parts_ptr + pid_n * 16 + cols_o, gl.sum(h * h, axis=0))
        else:
            gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def load_parts(parts_ptr, n_parts, M, PARTS: gl.constexpr, MP: gl.constexpr):
    """The hand-off's partial sums [n_parts, 16] as [PARTS, MP] (zeros past n_parts and M), for
    `store_rows`'s NORM_IN: loaded before the K loop (the producer wrote them), so that their
    latency hides under the weight stream; summed only in the epilogue."""
    pl: gl.constexpr = gl.BlockedLayout([1, MP], [32, 1], [gl.num_warps(), 1], [1, 0])
    groups = gl.arange(0, PARTS, layout=gl.SliceLayout(1, pl))
    cols = gl.arange(0, MP, layout=gl.SliceLayout(0, pl))
    return gl.load(parts_ptr + groups[:, None] * 16 + cols[None, :],
                   mask=(groups < n_parts)[:, None] & (cols < M)[None, :], other=0.0)


@gluon.jit
def _store_swiglu(y, rows, cols, o0, M, F, out_ptr, stride_om, BLOCK_N: gl.constexpr, MP: gl.constexpr,
                  SPAN: gl.constexpr):
    """y [BLOCK_N, MP]: program rows in (pair, gate | up, SPAN) order (`_weight_rows`); the gate /
    up bit is a register bit of the MMA layout, so the split moves no data. Writes
    silu(gate) * up to out[:M, o0 + pair * SPAN + r]."""
    PAIRS: gl.constexpr = BLOCK_N // (2 * SPAN)
    gate, up = gl.split(y.reshape(PAIRS, 2, SPAN, MP).permute(0, 2, 3, 1))
    r = gl.zeros_like(y.to(gl.int32)) + rows[:, None]
    c = gl.zeros_like(y.to(gl.int32)) + cols[None, :]
    r, _ = gl.split(r.reshape(PAIRS, 2, SPAN, MP).permute(0, 2, 3, 1))
    c, _ = gl.split(c.reshape(PAIRS, 2, SPAN, MP).permute(0, 2, 3, 1))
    out_row = o0 + (r // (2 * SPAN)) * SPAN + r % SPAN
    h = gate / (1.0 + gl.exp(-gate)) * up
    gl.store(out_ptr + c * stride_om + out_row, h.to(out_ptr.dtype.element_ty),
             mask=(c < M) & (out_row < F))


@gluon.jit
def _times_tensor_scale(total, tensor_scale_ptr, rows, N):
    """The decode leaves every product scaled by 2^-8: undo it with the tensor scale."""
    return total * (gl.load(tensor_scale_ptr) * 256.0)


@gluon.jit(do_not_specialize=["M"])  # one binary for every M of a tile width
def nvfp4_decode_kernel(
    x_ptr, words_ptr, scale_ptr, tensor_scale_ptr, out_ptr, acc_ptr, count_ptr,
    M, N, stride_xm, stride_om, K: gl.constexpr,
    BLOCK_N: gl.constexpr, WPT: gl.constexpr, MP: gl.constexpr, WK: gl.constexpr,
    SPLIT_K: gl.constexpr, TILED: gl.constexpr = False, SWIGLU: gl.constexpr = False,
):
    """y[M, N] = x @ W^T for M <= MP (8 or 16: one or two n8 token tiles). words_ptr is the packed
    weight as int32 [N, K/8], scale_ptr its e4m3 block scales [N, K/16] (read WPT/2 at a time);
    with SPLIT_K > 1 the programs of a row tile add into acc_ptr (fp32 [M, N], zero on entry) and
    the last one writes y and zeroes acc_ptr and its counter in count_ptr. TILED: the weight
    stored in tiles of 16 rows x 128 K (engine/formats/nvfp4.py; WPT 4 or 8), where a row's next
    K step lies 16 rows further on. SWIGLU: W is a fused gate/up projection (rows [0, N/2) gate,
    [N/2, N) up) and y [M, N/2] = silu(gate) * up, formed in registers before the one store (each
    warp needs an even number of 16-row blocks; with split-K, scratch programs x BLOCK_N wide)."""
    WN: gl.constexpr = gl.num_warps() // WK
    STEP_K: gl.constexpr = 32 * WPT
    ROWS_PER_STEP: gl.constexpr = 16 if TILED else 1
    K_CTA: gl.constexpr = K // SPLIT_K
    STEPS: gl.constexpr = K_CTA // (WK * STEP_K)  # per warp
    mma: gl.constexpr = mma_layout(WN, WK)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BLOCK_N
    k0 = pid_k * K_CTA
    words_ptrs, scale_ptrs, x_ptrs = stream_pointers(
        words_ptr, scale_ptr, x_ptr, n0, k0, M, N, stride_xm, K, BLOCK_N, WPT, MP, WN, WK, STEP_K,
        TILED, SWIGLU)
    if SWIGLU:
        gl.static_assert((BLOCK_N // (16 * WN)) % 2 == 0, "SwiGLU: an even number of row blocks per warp")
    acc = gl.zeros([WK, BLOCK_N, MP], gl.float32, layout=mma)
    acc = stream_steps(_mma_step, words_ptrs, scale_ptrs, x_ptrs, acc, STEPS, STEP_K, WK, BLOCK_N,
                       WPT, MP, S_STEP=4 * ROWS_PER_STEP, W_STEP=4 * WPT * ROWS_PER_STEP)

    store_rows(_times_tensor_scale, acc, tensor_scale_ptr, n0, pid_n, M, N, out_ptr, stride_om, acc_ptr,
               count_ptr, BLOCK_N, MP, SPLIT_K, WN if SWIGLU else 0)


@gluon.constexpr_function
def wgmma_layout(num_warps, mp):
    """The warpgroup MMA's accumulator [BLOCK_N, MP]: 16 rows a warp, the warpgroups stacked, row
    blocks past 16 * num_warps in registers (as `_bases` places rows with WN = num_warps)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, mp, 16])


@gluon.jit
def _wgmma_step(words, scales, x_step, acc, BLOCK_N: gl.constexpr, WPT: gl.constexpr):
    """acc += decode(words, scales) @ x_step^T for one K step: the decoded weights are the warpgroup
    MMA's A operand in registers, x_step [MP, STEP_K] (logical K order) its B from shared memory."""
    w = _decode_words(words, scales, 1, BLOCK_N, WPT).reshape(BLOCK_N, 32 * WPT)
    a = gl.convert_layout(w, gl.DotOperandLayout(0, acc.type.layout, 2), assert_trivial=True)
    return warpgroup_mma(a, x_step.permute((1, 0)), acc)


@gluon.jit
def _stage_x(x_smem, slot, x, MP: gl.constexpr, WPT: gl.constexpr):
    """One K step of x [MP, STEP_K], loaded in physical K order, into ring slot `slot` in the
    logical order of the decoded weights (`_logical_x`, as _mma_step permutes it in registers)."""
    x_smem.index(slot).store(_logical_x(x.reshape(1, MP, 32 * WPT), 1, MP, WPT).reshape(MP, 32 * WPT))


@gluon.jit(do_not_specialize=["M"])
def nvfp4_wgmma_decode_kernel(
    x_ptr, words_ptr, scale_ptr, tensor_scale_ptr, out_ptr, acc_ptr, count_ptr,
    M, N, stride_xm, stride_om, K: gl.constexpr,
    BLOCK_N: gl.constexpr, WPT: gl.constexpr, MP: gl.constexpr, SPLIT_K: gl.constexpr,
    TILED: gl.constexpr = False, SWIGLU: gl.constexpr = False,
):
    """nvfp4_decode_kernel's y = x @ W^T (same arguments, storage, split-K and SwiGLU epilogue)
    with the warpgroup MMA, for 5..16 tokens: each warp loads and decodes its 16-row blocks'
    weights into registers as there, but they are wgmma's A operand, and x, the B operand, is read
    from shared memory once per warpgroup instead of from L1 once per warp (at 16 tokens a warp's
    x is 4 times its weight bytes). x travels with the weights, two K steps ahead, through
    registers (to permute it to the decoded weights' K order) into a ring of 4 steps in shared
    memory; a CTA barrier per two steps publishes it (the compiler adds one before each slot's
    store: it cannot tell the slots apart)."""
    NW: gl.constexpr = gl.num_warps()
    STEP_K: gl.constexpr = 32 * WPT
    ROWS_PER_STEP: gl.constexpr = 16 if TILED else 1
    K_CTA: gl.constexpr = K // SPLIT_K
    STEPS: gl.constexpr = K_CTA // STEP_K
    acc_layout: gl.constexpr = wgmma_layout(NW, MP)
    # x's loads: 8 consecutive K (16 bytes) a thread, a step's [MP, STEP_K] across the CTA.
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // STEP_K, STEP_K // 8], [NW, 1], [1, 0])
    x_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * STEP_K),
                                                       element_bitwidth=16, rank=2)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BLOCK_N
    k0 = pid_k * K_CTA
    words_ptrs, scale_ptrs, _ = stream_pointers(
        words_ptr, scale_ptr, x_ptr, n0, k0, M, N, stride_xm, K, BLOCK_N, WPT, MP, NW, 1, STEP_K,
        TILED, SWIGLU)
    if SWIGLU:
        gl.static_assert((BLOCK_N // (16 * NW)) % 2 == 0, "SwiGLU: an even number of row blocks per warp")
    W_STEP: gl.constexpr = 4 * WPT * ROWS_PER_STEP
    S_STEP: gl.constexpr = 4 * ROWS_PER_STEP
    x_rows = gl.arange(0, MP, layout=gl.SliceLayout(1, xl))
    x_cols = gl.arange(0, STEP_K, layout=gl.SliceLayout(0, xl))
    x_ptrs = x_ptr + gl.minimum(x_rows, M - 1)[:, None] * stride_xm + (k0 + x_cols)[None, :]
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [4, MP, STEP_K], x_smem_layout)

    SECOND: gl.constexpr = 1 if STEPS > 1 else 0  # one step only: b repeats a, never used
    w_a, s_a = _load_step(words_ptrs, scale_ptrs, 0, 1, W_STEP, S_STEP)
    x_a = gl.load(x_ptrs)
    w_b, s_b = _load_step(words_ptrs, scale_ptrs, SECOND, 1, W_STEP, S_STEP)
    x_b = gl.load(x_ptrs + SECOND * STEP_K)
    acc = gl.zeros([BLOCK_N, MP], gl.float32, layout=acc_layout)
    # Body t consumes steps 2t, 2t + 1 from slots 2(t % 2), +1 and refills the registers with
    # 2t + 2, 2t + 3. A slot is rewritten two bodies after it was read, past a barrier that every
    # warp reaches only once its (synchronous) MMAs of the body between have finished.
    ITERS: gl.constexpr = (STEPS - 2) // 2 if STEPS > 1 else 0
    for t in range(ITERS):
        slot = (t % 2) * 2
        _stage_x(x_smem, slot, x_a, MP, WPT)
        _stage_x(x_smem, slot + 1, x_b, MP, WPT)
        fence_async_shared()
        _cta_barrier()
        acc = _wgmma_step(w_a, s_a, x_smem.index(slot), acc, BLOCK_N, WPT)
        w_a, s_a = _load_step(words_ptrs, scale_ptrs, 2, 1, W_STEP, S_STEP)
        x_a = gl.load(x_ptrs + 2 * STEP_K)
        acc = _wgmma_step(w_b, s_b, x_smem.index(slot + 1), acc, BLOCK_N, WPT)
        w_b, s_b = _load_step(words_ptrs, scale_ptrs, 3, 1, W_STEP, S_STEP)
        x_b = gl.load(x_ptrs + 3 * STEP_K)
        words_ptrs += 2 * W_STEP
        scale_ptrs += 2 * S_STEP
        x_ptrs += 2 * STEP_K
    LEFT: gl.constexpr = STEPS - 2 * ITERS  # 1, 2 or 3
    SLOT: gl.constexpr = (ITERS % 2) * 2
    _stage_x(x_smem, SLOT, x_a, MP, WPT)
    if LEFT >= 2:
        _stage_x(x_smem, SLOT + 1, x_b, MP, WPT)
    fence_async_shared()
    _cta_barrier()
    acc = _wgmma_step(w_a, s_a, x_smem.index(SLOT), acc, BLOCK_N, WPT)
    if LEFT == 3:
        w_a, s_a = _load_step(words_ptrs, scale_ptrs, 2, 1, W_STEP, S_STEP)
        x_a = gl.load(x_ptrs + 2 * STEP_K)
    if LEFT >= 2:
        acc = _wgmma_step(w_b, s_b, x_smem.index(SLOT + 1), acc, BLOCK_N, WPT)
    if LEFT == 3:
        _stage_x(x_smem, 2 - SLOT, x_a, MP, WPT)
        fence_async_shared()
        _cta_barrier()
        acc = _wgmma_step(w_a, s_a, x_smem.index(2 - SLOT), acc, BLOCK_N, WPT)

    store_rows(_times_tensor_scale, acc, tensor_scale_ptr, n0, pid_n, M, N, out_ptr, stride_om, acc_ptr,
               count_ptr, BLOCK_N, MP, SPLIT_K, NW if SWIGLU else 0)


def decode_config(m: int, n: int, k: int, sm_count: int, block_n: int | None = None,
                  warps_k: int | None = None, split_k: int | None = None,
                  num_warps: int | None = None, words_per_thread: int | None = None) -> dict:
    """Rows per program, warps along K, split-K, words per thread and row per K step, and warps of
    the decode kernel (keyword overrides for the benchmark's sweep). A warp's unit of work is
    16 * RB rows (RB = BLOCK_N / 16 / (num_warps / WK)) x (K / SPLIT_K / WK).

    Default: 4 warps, one 16-row block per warp, 4 words (16 bytes) per thread and row per K step
    of 128 (2 and 64 where K is not a multiple of 128). Starting from the 4 warps splitting 64
    rows, while there are fewer than 6 programs per SM the warps move from rows to K (64 rows x 1
    K slice -> 32 x 2 -> 16 x 4), then K is split across programs as long as each warp keeps 7
    K steps: the fastest configuration of bench_nvfp4.py --sweep at M = 1 on each Llama-3.1-8B
    shape."""
    wpt = words_per_thread or (4 if k % 128 == 0 else 2)
    step = 32 * wpt
    num_warps = num_warps or 4
    target = 6 * sm_count
    if block_n is None and warps_k is None:
        block_n, warps_k = 16 * num_warps, 1
        while (triton.cdiv(n, block_n) < target and warps_k < num_warps
               and k % (2 * warps_k * step) == 0):
            block_n, warps_k = block_n // 2, warps_k * 2
    block_n = block_n or 16 * num_warps // warps_k
    warps_k = warps_k or 1
    if split_k is None:
        split_k = 1
        while (triton.cdiv(n, block_n) * split_k < target
               and k % (2 * split_k * warps_k * step) == 0
               and k // (2 * split_k * warps_k) >= 7 * step):
            split_k *= 2
    if k % (split_k * warps_k * step):
        raise ValueError(f"K={k} is not a multiple of SPLIT_K={split_k} x WK={warps_k} x {step}")
    if num_warps % warps_k or block_n % (16 * num_warps // warps_k):
        raise ValueError(f"{num_warps} warps, WK={warps_k}: BLOCK_N={block_n} does not fit")
    return {"BLOCK_N": block_n, "WK": warps_k, "SPLIT_K": split_k, "WPT": wpt,
            "num_warps": num_warps}


def decode_matmul(x: torch.Tensor, w, out: torch.Tensor, config: dict | None = None,
                  swiglu: bool = False) -> torch.Tensor:
    """out[M, N] = x[M, K] @ W^T for M <= 16, bf16 x (unit stride along K), W an Nvfp4Tensor.
    swiglu: W a fused gate/up projection, out[M, N/2] = silu(gate) * up (swiglu_config's
    configurations; N/2 a multiple of 16)."""
    m, k = x.shape
    if config is None:
        config = (swiglu_config if swiglu else decode_config)(m, w.shape[0], k, sm_count(x.device))
    row_warps = config["num_warps"] // config["WK"]
    return _launch(nvfp4_decode_kernel, x, w, out, config, swiglu, config["BLOCK_N"] // (16 * row_warps))


def _launch(kernel, x: torch.Tensor, w, out: torch.Tensor, config: dict, swiglu: bool, row_blocks: int):
    """Either decode kernel over x [M, K] and the NVFP4 weight w into out (their arguments, grid and
    split-K scratch are the same); row_blocks: 16-row blocks per warp, which SwiGLU pairs."""
    m, k = x.shape
    n = w.shape[0]
    cfg = dict(config, TILED=w.tiled, SWIGLU=swiglu)
    if w.tiled and cfg["WPT"] < 4:
        raise ValueError("a tiled NVFP4 weight needs 4 or 8 words per thread and step")
    if swiglu and (n % 32 or row_blocks % 2):
        raise ValueError(f"SwiGLU epilogue: N/2 a multiple of 16 and an even number of row blocks "
                         f"per warp (N={n}, {row_blocks})")
    split = cfg["SPLIT_K"]
    tiles = triton.cdiv(n // 2, cfg["BLOCK_N"] // 2) if swiglu else triton.cdiv(n, cfg["BLOCK_N"])
    acc, count = (split_k_buffers(x.device, m * tiles * cfg["BLOCK_N"], tiles) if split > 1
                  else (out, out))
    kernel[(tiles, split)](
        x, w.packed.view(torch.int32), w.block_scale.view(torch.uint8), w.tensor_scale, out, acc,
        count, m, n, x.stride(0), out.stride(0), K=k, MP=8 if m <= 8 else 16, **cfg)
    return out


def swiglu_config(m: int, n: int, k: int, sm_count: int) -> dict:
    """decode_config's tiling for the SwiGLU epilogue, which needs an even number of 16-row blocks
    per warp (gate, up): where it has one, twice the warps along K over the same rows, else twice
    the rows (the faster of the two in bench_nvfp4.py's sweep)."""
    cfg = decode_config(m, n, k, sm_count)
    wk, step = cfg["WK"], 32 * cfg["WPT"]
    if (cfg["BLOCK_N"] // (16 * (cfg["num_warps"] // wk))) % 2:
        if cfg["num_warps"] % (2 * wk) == 0 and k % (cfg["SPLIT_K"] * 2 * wk * step) == 0:
            cfg["WK"] = 2 * wk
        else:
            cfg["BLOCK_N"] *= 2
    return cfg


def wgmma_config(m: int, n: int, k: int, sm_count: int, block_n: int | None = None,
                 split_k: int | None = None, num_warps: int | None = None,
                 words_per_thread: int | None = None, swiglu: bool = False) -> dict:
    """Rows per program, split-K, words per thread and warps of the wgmma decode kernel (keyword
    overrides for the benchmark's sweep). Default: one warpgroup, 64 rows a program (128 with the
    SwiGLU epilogue: a gate and an up block per warp), 16 bytes a thread and row per K step of
    128, K split 8 ways (or into the largest divisor of its steps up to 8 that leaves each
    program 2): at 16 tokens the fastest of splits 1 to 16 with 64 rows and 4 warps or 128 rows
    and 4 or 8 warps on every Llama-3.1-8B shape (BENCHMARKS.md), programs of 4 K steps (14 on
    the down projection) beating longer ones."""
    wpt = words_per_thread or (4 if k % 128 == 0 else 2)
    step = 32 * wpt
    num_warps = num_warps or 4
    block_n = block_n or 16 * num_warps * (2 if swiglu else 1)
    steps = k // step
    if split_k is None:
        split_k = max((s for s in range(1, 9) if steps % s == 0 and steps // s >= 2), default=1)
    if k % (split_k * step):
        raise ValueError(f"K={k} is not a multiple of SPLIT_K={split_k} x {step}")
    if block_n % (16 * num_warps) or num_warps % 4:
        raise ValueError(f"{num_warps} warps (whole warpgroups): BLOCK_N={block_n} does not fit")
    return {"BLOCK_N": block_n, "SPLIT_K": split_k, "WPT": wpt, "num_warps": num_warps}


def wgmma_matmul(x: torch.Tensor, w, out: torch.Tensor, config: dict | None = None,
                 swiglu: bool = False) -> torch.Tensor:
    """decode_matmul's out = x @ W^T (or its SwiGLU) through the wgmma decode kernel, M <= 16."""
    m, k = x.shape
    if config is None:
        config = wgmma_config(m, w.shape[0], k, sm_count(x.device), swiglu=swiglu)
    return _launch(nvfp4_wgmma_decode_kernel, x, w, out, config, swiglu,
                   config["BLOCK_N"] // (16 * config["num_warps"]))
