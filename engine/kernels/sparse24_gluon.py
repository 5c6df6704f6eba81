"""2:4-sparse decode GEMM on Hopper's sparse tensor cores (sm_90, mma.sp m16n8k32), in Gluon, for
M <= 16 tokens: y = x @ W^T, W 2:4-compressed (`values` [N, K/2], bf16 or e4m3 with e4m3 x (E4M3
below), `meta` uint8 [N, K/8], see engine/formats/sparse24.py, with the metadata rearranged once
per weight by `mma_order_meta`). `launch(x, values, meta_mma, scale, config, out, swiglu, ...,
x_scale)` runs it where `unsupported(x, values, config, swiglu)` returns None; a config is ("sp",
BM, BLOCK_N, WPT, SPLIT_K, num_warps, WK), its shape rules `config_unfit`.

The kept values go to the tensor core as they are stored: mma.sp takes the A operand compressed
(16 x 16 kept values standing for 16 x 32) plus 2-bit indices, so there is no expansion in registers
and one instruction does the work of two dense k16 MMAs.

Fragments (PTX ISA, sparse m16n8k32 .bf16; groupID g = lane / 4, q = lane % 4):
- A, 4 registers, each one group's two kept values (the stored 32-bit word): rows g, g + 8 of
  logical groups q and q + 4 of the k32 block.
- B (x^T), 4 registers of bf16 pairs: token g, logical K 2q + 8i (+0, +1), i = 0..3.
- metadata, 1 register read from threads q = 0 and 1 of each quad (sparsity selector 0): thread q
  holds logical groups 4q .. 4q + 3 of row g in bits 0..15 and of row g + 8 in bits 16..31, a
  nibble per group, i0 | i1 << 2 (the stored nibble). (One row per thread, all 8 groups, gives
  wrong products.)
- C / D: rows g, g + 8, tokens 2q, 2q + 1, as the dense m16n8k16.

K order. A K step is 4 * WPT groups of a row (16 * WPT K); thread q loads WPT consecutive stored
words (16 bytes at WPT = 4) of rows g and g + 8, so the WPT/2 k32 MMAs of the step must read their
logical groups q and q + 4 from those words: MMA c takes stored group WPT * (j % 4) + 2c + j // 4
as its logical group j. x is read in the same order (a permutation of K applied to both operands
leaves the product unchanged). A thread's B pairs are then half of each of 2 * WPT stored groups of
x, the other halves belonging to its neighbour lane: each lane loads one run of 2 * WPT whole pairs
as 16-byte vectors, and neighbouring lanes swap halves (shfl.bfly; 4-byte loads of the pairs are
about twice as slow at 16 tokens). x is loaded two steps ahead, like the weights.

Metadata. The kernel reads the registers the MMAs take, precomputed per weight (`mma_order_meta`,
one copy per WPT: the same bytes as meta, 1/8 of the values') and stored in load order, so thread
(g, q) loads its WPT/2 registers of a step as one 8- or 16-byte vector and hands them over as they
are: assembling them in the loop from the stored nibbles costs about 13 integer instructions per
MMA and 60-70 more registers. At 16 tokens x is the other cost (every warp loads it through L1), so
RB row blocks per warp share it in registers.

SwiGLU epilogue (SWIGLU, for the fused gate/up projection): a program's row blocks alternate gate
and up rows, so each thread holds both operands of its outputs and writes silu(gate) * up, saving
the SwiGLU kernel and its launch. It needs an even number of row blocks per warp and no split-K,
which past 4 tokens costs more than it saves; up to 4 the tuner times it against the unfused pair
(engine/formats/sparse24.py).

Work split as in the other Gluon decode kernels (engine/kernels/nvfp4_gluon.py, whose K loop
`stream_steps` and epilogue `store_rows` this kernel runs): num_warps / WK warps split the rows,
16 * RB each, WK warps split K step by step, SPLIT_K programs split K in one launch; two K steps in
flight per warp; rows past N and tokens past M re-read the last one, so the loop has no masks.

E4M3 (the `2:4+fp8` format: e4m3 kept values with a per-row scale, e4m3 x with a per-token scale,
as the fused RMSNorm / SwiGLU kernels write it). Hopper runs FP8 only through wgmma: ptxas expands
an e4m3 mma.sp (m16n8k64) into f16 MMAs plus a rewrite of the metadata in integer instructions per
MMA. So the kernel does the widening itself, where it is cheapest: each loaded word (two groups'
four kept values) becomes two f16 pairs (`cvt.rn.f16x2.e4m3x2`, exact), x's e4m3 quads likewise,
and the f16 mma.sp m16n8k32 runs on them exactly as the bf16 path at twice the words per thread (a
step of WPT e4m3 words is the bf16 step of 2 * WPT: the same K order, lane swap and metadata,
`mma_order_meta(meta, 2 * WPT)`). Products of e4m3 values are exact in fp32; the sum is scaled by
x's per-token scale before the split-K reduction and by the row scale after it. Neither the SwiGLU
epilogue nor the norm hand-off run with e4m3: the GEMM after either takes e4m3 x, which the norm /
SwiGLU kernel quantises.

RMSNorm hand-off (NORM_OUT / NORM_IN, not with the SwiGLU epilogue): the kernel is the GEMM before
or after a norm that runs in their epilogues instead of its own launch (the protocol:
engine/kernels/stream_triton.py). Its partial sums are loaded before the K loop and summed in the
epilogue.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from engine.kernels.nvfp4_gluon import load_parts, store_rows, stream_steps
from engine.kernels.split_k import split_k_buffers
from engine.kernels.stream_triton import check_parts

_MMA_SP = gl.constexpr(
    "mma.sp.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
    "{$0, $1, $2, $3}, {$8, $9, $10, $11}, {$12, $13, $14, $15}, {$4, $5, $6, $7}, $16, 0x0;")
_MMA_SP_F16 = gl.constexpr(
    "mma.sp.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 "
    "{$0, $1, $2, $3}, {$8, $9, $10, $11}, {$12, $13, $14, $15}, {$4, $5, $6, $7}, $16, 0x0;")
_MMA_SP_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 4 + ["f"] * 4 + ["r"] * 12))
# One 32-bit word of four e4m3 -> two f16 pairs, in order (exact: e4m3 is a subset of f16).
_E4M3_TO_F16 = gl.constexpr(
    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")


@gluon.constexpr_function
def _fragments(t: int, rb: int, wn: int, wk: int):
    """[WK, NB (16-row blocks: RB per warp), T, 8 (g), 4 (q), 4 (register)]: one MMA's operands per
    thread, register-last."""
    return gl.BlockedLayout(size_per_thread=[1, rb, t, 1, 1, 4], threads_per_warp=[1, 1, 1, 8, 4, 1],
                            warps_per_cta=[wk, wn, 1, 1, 1, 1], order=[5, 4, 3, 2, 1, 0])


@gluon.constexpr_function
def _rows_layout(width: int, rb: int, wn: int, wk: int):
    """[WK, NB, 8 (g), 4 (q), width]: a thread's `width` contiguous elements of its rows."""
    return gl.BlockedLayout(size_per_thread=[1, rb, 1, 1, width], threads_per_warp=[1, 1, 8, 4, 1],
                            warps_per_cta=[wk, wn, 1, 1, 1], order=[4, 3, 2, 1, 0])


@gluon.constexpr_function
def _x_layout(t: int, width: int, wn: int, wk: int):
    """[WK, 1, T, 8 (g), 4 (q), width]: a thread's x pairs for its token(s) and step (every warp
    loads them: the size-1 dimension broadcasts over its row blocks)."""
    return gl.BlockedLayout(size_per_thread=[1, 1, t, 1, 1, width], threads_per_warp=[1, 1, 1, 8, 4, 1],
                            warps_per_cta=[wk, wn, 1, 1, 1, 1], order=[5, 4, 3, 2, 1, 0])


@gluon.jit
def _dims5(n0: gl.constexpr, n1: gl.constexpr, n2: gl.constexpr, n3: gl.constexpr, n4: gl.constexpr,
           layout: gl.constexpr):
    """Index vectors of a 5-D layout, each broadcastable to the full shape."""
    i0 = gl.arange(0, n0, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, layout)))))
    i1 = gl.arange(0, n1, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, layout)))))
    i2 = gl.arange(0, n2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, layout)))))
    i3 = gl.arange(0, n3, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, layout)))))
    i4 = gl.arange(0, n4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout)))))
    return (i0[:, None, None, None, None], i1[None, :, None, None, None], i2[None, None, :, None, None],
            i3[None, None, None, :, None], i4[None, None, None, None, :])


@gluon.jit
def _dims6(n0: gl.constexpr, n1: gl.constexpr, n2: gl.constexpr, n3: gl.constexpr, n4: gl.constexpr,
           n5: gl.constexpr, layout: gl.constexpr):
    """Index vectors of a 6-D layout, each broadcastable to the full shape."""
    l5: gl.constexpr = gl.SliceLayout(5, layout)
    l4: gl.constexpr = gl.SliceLayout(4, layout)
    i0 = gl.arange(0, n0, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, l5)))))
    i1 = gl.arange(0, n1, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, l5)))))
    i2 = gl.arange(0, n2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, l5)))))
    i3 = gl.arange(0, n3, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, l5)))))
    i4 = gl.arange(0, n4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, l5)))))
    i5 = gl.arange(0, n5, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, l4)))))
    return (i0[:, None, None, None, None, None], i1[None, :, None, None, None, None],
            i2[None, None, :, None, None, None], i3[None, None, None, :, None, None],
            i4[None, None, None, None, :, None], i5[None, None, None, None, None, :])


@gluon.jit
def _with_tokens(v, T: gl.constexpr, layout: gl.constexpr):
    """[WK, NB, 8, 4, 4] -> [WK, NB, T, 8, 4, 4] in the fragment layout, repeated over the token
    tiles (registers only)."""
    if T == 2:
        v = gl.join(v, v).permute(0, 1, 5, 2, 3, 4)
    else:
        v = v.reshape(v.shape[0], v.shape[1], 1, 8, 4, 4)
    return gl.convert_layout(v, layout)


@gluon.jit
def _split_last(v, C: gl.constexpr):
    """[.., C] (C = 1, 2, 4 or 8) -> the C slices along the last dimension, in order."""
    if C == 1:
        return (v.reshape(v.shape[:-1]),)
    elif C == 2:
        v0, v1 = gl.split(v)
        return (v0, v1)
    elif C == 4:
        lo, hi = gl.split(v.reshape(v.shape[:-1] + [2, 2]))
        v0, v2 = gl.split(lo)
        v1, v3 = gl.split(hi)
        return (v0, v1, v2, v3)
    else:
        even, odd = gl.split(v.reshape(v.shape[:-1] + [4, 2]))
        e0, e1, e2, e3 = _split_last(even, 4)
        o0, o1, o2, o3 = _split_last(odd, 4)
        return (e0, o0, e1, o1, e2, o2, e3, o3)


@gluon.jit
def _mma_sp_step(words, meta, x, acc, WK: gl.constexpr, BLOCK_N: gl.constexpr,
                 WPT: gl.constexpr, MP: gl.constexpr):
    """One K step of bf16 values (`_mma_sp_regs`)."""
    return _mma_sp_regs(words, meta, x, acc, WK, BLOCK_N, WPT, MP, _MMA_SP)


@gluon.jit
def _mma_sp_step_e4m3(words, meta, x, acc, WK: gl.constexpr, BLOCK_N: gl.constexpr,
                      WPT: gl.constexpr, MP: gl.constexpr):
    """One K step of e4m3 values and x: both widened to f16 pairs, then the bf16 step's registers
    at 2 * WPT words (`_mma_sp_regs`)."""
    return _mma_sp_regs(_f16_pairs(words), meta, _f16_pairs(x), acc, WK, BLOCK_N, 2 * WPT, MP, _MMA_SP_F16)


@gluon.jit
def _f16_pairs(v):
    """[.., n] int32 words of four e4m3 -> [.., 2n] int32 f16 pairs, word j -> pairs 2j, 2j + 1."""
    lo, hi = gl.inline_asm_elementwise(_E4M3_TO_F16, "=r,=r,r", [v], dtype=(gl.int32, gl.int32),
                                       is_pure=True, pack=1)
    return gl.join(lo, hi).reshape(v.shape[:-1] + [2 * v.shape[-1]])


@gluon.jit
def _mma_sp_regs(words, meta, x, acc, WK: gl.constexpr, BLOCK_N: gl.constexpr,
                 WPT: gl.constexpr, MP: gl.constexpr, MMA: gl.constexpr):
    """acc += W_step @ x_step^T for one K step (WPT / 2 sparse MMAs per 16 rows and 8 tokens).
    words [WK, NB, 8, 4, 2 * WPT] (row g then g + 8 of each 16-row block, WPT words each), meta
    [WK, NB, 8, 4, WPT / 2] (MMA c's metadata register, as `mma_order_meta` stores it), x
    [WK, 1, T, 8, 4, 2 * WPT] int32 pairs (used for every row block of the warp); MMA the
    instruction (bf16 or f16 pairs)."""
    T: gl.constexpr = MP // 8
    NB: gl.constexpr = BLOCK_N // 16
    frag: gl.constexpr = acc.type.layout
    C: gl.constexpr = WPT // 2
    # x as loaded: lane (q1, i0) holds the pairs (c, i1, q0) of its run; swap q0 (a register bit)
    # and i0 (lane bit 0) between neighbouring lanes (shfl.bfly), then B register i of MMA c is
    # element 4c + i of the thread's
    x_layout: gl.constexpr = x.type.layout
    x = x.reshape(WK, 1, T, 8, 2, 2, C, 2, 2).permute(0, 1, 2, 3, 4, 8, 6, 7, 5)
    x = gl.convert_layout(x.reshape(WK, 1, T, 8, 4, 2 * WPT), x_layout)
    # words: (row8, c, wb) -> A register 2 * wb + row8 of MMA c
    a_regs = _split_last(words.reshape(WK, NB, 8, 4, 2, C, 2).permute(0, 1, 2, 3, 6, 4, 5)
                         .reshape(WK, NB, 8, 4, 4, C), C)
    b_regs = _split_last(x.reshape(WK, 1, T, 8, 4, C, 4).permute(0, 1, 2, 3, 4, 6, 5), C)
    e_regs = _split_last(meta, C)
    for c in gl.static_range(C):
        a = _with_tokens(a_regs[c], T, frag)
        e = gl.join(e_regs[c], e_regs[c])  # the register in each of the fragment's 4 slots
        e = _with_tokens(gl.join(e, e).reshape(WK, NB, 8, 4, 4), T, frag)
        b = gl.convert_layout(b_regs[c], frag)
        acc = gl.inline_asm_elementwise(MMA, _MMA_SP_CONSTRAINTS, [acc, a, b, e], dtype=gl.float32,
                                        is_pure=True, pack=4)
    return acc


@gluon.jit
def _times_token_scale(acc, x_scale_ptr, M):
    """acc [WK, NB, T, 8 (g), 4 (q), 4 (register)] times x's per-token scale: register r of
    thread q holds token 8 t + 2 q + r % 2 (the m16n8 accumulator)."""
    WK: gl.constexpr = acc.shape[0]
    NB: gl.constexpr = acc.shape[1]
    T: gl.constexpr = acc.shape[2]
    frag: gl.constexpr = acc.type.layout
    _, _, t, _, q, r = _dims6(WK, NB, T, 8, 4, 4, frag)
    return acc * gl.load(x_scale_ptr + gl.minimum(8 * t + 2 * q + r % 2, M - 1))


@gluon.jit
def _times_row_scale(total, scale_ptr, rows, N):
    """times the per-output-channel scale[N]."""
    return total * gl.load(scale_ptr + rows, mask=rows < N, other=0.0)[:, None]


@gluon.jit
def _unscaled(total, scale_ptr, rows, N):
    return total


@gluon.jit
def store_rows_scaled(acc, HAS_SCALE: gl.constexpr, scale_ptr, n0, pid_n, M, N, out_ptr, stride_om, acc_ptr,
                      count_ptr, BLOCK_N: gl.constexpr, MP: gl.constexpr, SPLIT_K: gl.constexpr,
                      NORM_IN: gl.constexpr = False, NORM_OUT: gl.constexpr = False, parts_in=None, eps=0.0,
                      K: gl.constexpr = 1, parts_ptr=None, g_ptr=None, xg_ptr=None):
    """store_rows (with its RMSNorm hand-off), times scale[N] when HAS_SCALE (per-output-channel
    scales)."""
    ROW_SCALE: gl.constexpr = _times_row_scale if HAS_SCALE else _unscaled
    store_rows(ROW_SCALE, acc, scale_ptr, n0, pid_n, M, N, out_ptr, stride_om, acc_ptr, count_ptr, BLOCK_N, MP,
               SPLIT_K, 0, NORM_IN, NORM_OUT, parts_in, eps, K, parts_ptr, g_ptr, xg_ptr)


@gluon.jit(do_not_specialize=["M"])
def sparse24_sp_kernel(
    x_ptr, words_ptr, meta_ptr, scale_ptr, x_scale_ptr, out_ptr, acc_ptr, count_ptr,
    parts_ptr, g_ptr, xg_ptr, n_parts, eps,
    M, N, stride_xm, stride_om, K: gl.constexpr,
    BLOCK_N: gl.constexpr, WPT: gl.constexpr, MP: gl.constexpr, WK: gl.constexpr,
    SPLIT_K: gl.constexpr, HAS_SCALE: gl.constexpr, SWIGLU: gl.constexpr = False,
    NORM_IN: gl.constexpr = False, NORM_OUT: gl.constexpr = False, PARTS: gl.constexpr = 1,
    E4M3: gl.constexpr = False,
):
    """y[M, N] = x @ W^T (times scale[N]) for M <= MP (8 or 16); BLOCK_N = 16 * RB * num_warps / WK
    (RB blocks of 16 rows per row warp, which reuse its x registers). words_ptr: the kept values
    as int32 [N, K/4] (bf16 pairs; E4M3: [N, K/8], e4m3 quads); meta_ptr: the metadata registers,
    `mma_order_meta(meta, WPT)` (E4M3: of 2 * WPT, the f16 pairs the words widen to); x_ptr: x as
    int32 (bf16 pairs, E4M3 e4m3 quads), stride_xm in those. K a multiple of SPLIT_K * WK * STEP_K
    (16 * WPT, E4M3 32 * WPT). E4M3: y is also scaled by x_scale_ptr [M] (fp32, per token).
    SWIGLU: W is a fused gate/up projection (rows [0, N/2) gate, [N/2, N) up, N/2 a multiple of
    16) and y [M, N/2] = silu(gate) * up. A program takes BLOCK_N / 2 gate rows and the same up
    rows, its row blocks alternating gate, up, so that each thread holds both of an output in
    registers (RB even, SPLIT_K = 1); the product is formed before the one store.
    NORM_IN / NORM_OUT (no SwiGLU): the RMSNorm hand-off's consumer or producer, as
    engine/kernels/nvfp4_gluon.py's `store_rows` runs them."""
    WN: gl.constexpr = gl.num_warps() // WK
    NB: gl.constexpr = BLOCK_N // 16
    RB: gl.constexpr = NB // WN
    T: gl.constexpr = MP // 8
    PER_WORD: gl.constexpr = 4 if E4M3 else 2  # elements of x (and kept values) per 32-bit word
    STEP_K: gl.constexpr = 8 * PER_WORD * WPT
    K_CTA: gl.constexpr = K // SPLIT_K
    STEPS: gl.constexpr = K_CTA // (WK * STEP_K)  # per warp
    frag: gl.constexpr = _fragments(T, RB, WN, WK)
    w_layout: gl.constexpr = _rows_layout(2 * WPT, RB, WN, WK)
    C: gl.constexpr = PER_WORD * WPT // 4  # MMAs per step (e4m3: the f16 pairs' 2 * WPT / 2)
    x_layout: gl.constexpr = _x_layout(T, 2 * WPT, WN, WK)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BLOCK_N
    k0 = pid_k * K_CTA
    # words: thread (g, q), row block b: rows 16b + g (+ 8), stored words WPT*q .. of each step
    # (SWIGLU: block b is gate block b // 2 of the program's, or its up block where b is odd)
    kw, rw, g, q, v = _dims5(WK, NB, 8, 4, 2 * WPT, w_layout)
    gl.static_assert(not E4M3 or not (SWIGLU or NORM_IN or NORM_OUT), "e4m3: the plain epilogue only")
    if SWIGLU:
        gl.static_assert(RB % 2 == 0 and SPLIT_K == 1 and not HAS_SCALE)
        F = N // 2
        rows = gl.minimum(n0 // 2 + 16 * (rw // 2) + g + 8 * (v // WPT), F - 1) + (rw % 2) * F
    else:
        rows = gl.minimum(n0 + 16 * rw + g + 8 * (v // WPT), N - 1)
    words_ptrs = (words_ptr + k0 // (2 * PER_WORD) + kw * (4 * WPT) + rows * (K // (2 * PER_WORD))
                  + WPT * q + v % WPT)
    # meta: int32 [N/16, steps, 8 (g), 2 (q % 2), C] (`mma_order_meta`): thread (g, q) loads the C
    # registers of its row block's step (threads q = 2, 3 load those of q = 0, 1; the MMA ignores them)
    ko, ro, go, qo, co = _dims5(WK, NB, 8, 4, C, _rows_layout(C, RB, WN, WK))
    if SWIGLU:
        blocks = gl.minimum(n0 // 32 + ro // 2, (N // 2 - 1) // 16) + (ro % 2) * (N // 32)
    else:
        blocks = gl.minimum(n0 // 16 + ro, (N - 1) // 16)
    S_STEP: gl.constexpr = 16 * C
    meta_ptrs = (meta_ptr + k0 // STEP_K * S_STEP + ko * S_STEP + blocks * (K // STEP_K * S_STEP)
                 + (go * 2 + qo % 2) * C + co)
    # x pairs of token 8t + g. B register i of MMA c needs stored pair q%2 + 2(i//2) + 4c
    # + 2WPT(q//2) + 4WPT(i%2) of the step: the step is 4 runs of 2 * WPT pairs, run (i%2, q//2);
    # lane q loads run 2 (q % 2) + q // 2 whole (16-byte vectors) and _mma_sp_step swaps halves
    # (E4M3: runs of 2 * WPT e4m3 quads, which widen to the 4 * WPT f16 pairs of the bf16 step
    # at 2 * WPT)
    xk, _, xt, xg, xq, xv = _dims6(WK, 1, T, 8, 4, 2 * WPT, x_layout)
    pair = xv + 2 * WPT * (2 * (xq % 2) + xq // 2)
    tokens = gl.minimum(8 * xt + xg, M - 1)
    x_ptrs = x_ptr + k0 // PER_WORD + xk * (8 * WPT) + tokens * stride_xm + pair + gl.zeros(
        [WK, 1, T, 8, 4, 2 * WPT], gl.int32, layout=x_layout)

    parts_in = load_parts(parts_ptr, n_parts, M, PARTS, MP) if NORM_IN else None
    acc = gl.zeros([WK, NB, T, 8, 4, 4], gl.float32, layout=frag)
    # x two steps ahead, with the weights (faster here, where x is a larger share of the bytes)
    if E4M3:
        acc = stream_steps(_mma_sp_step_e4m3, words_ptrs, meta_ptrs, x_ptrs, acc, STEPS, 8 * WPT, WK,
                           BLOCK_N, WPT, MP, X_AHEAD=True, S_STEP=S_STEP)
        acc = _times_token_scale(acc, x_scale_ptr, M)
    else:
        acc = stream_steps(_mma_sp_step, words_ptrs, meta_ptrs, x_ptrs, acc, STEPS, 8 * WPT, WK, BLOCK_N,
                           WPT, MP, X_AHEAD=True, S_STEP=S_STEP)
    if SWIGLU:  # row blocks (2j, 2j + 1) = (gate, up) of output block j, in one thread's registers
        gl.static_assert(not NORM_IN and not NORM_OUT, "the norm's hand-off: no SwiGLU epilogue")
        gate, up = gl.split(acc.reshape(WK, NB // 2, 2, T, 8, 4, 4).permute(0, 1, 3, 4, 5, 6, 2))
        gate = gl.sum(gate, axis=0)
        h = gl.expand_dims(gate / (1.0 + gl.exp(-gate)) * gl.sum(up, axis=0), 0)
        h = h.reshape(1, NB // 2, T, 8, 4, 2, 2).permute(0, 1, 5, 3, 2, 4, 6).reshape(1, BLOCK_N // 2, MP)
        store_rows_scaled(h, False, scale_ptr, n0 // 2, pid_n, M, N // 2, out_ptr, stride_om, acc_ptr,
                          count_ptr, BLOCK_N // 2, MP, 1)
    else:
        # registers (row8, token bit 0): acc -> [WK, rows, tokens]
        acc = acc.reshape(WK, NB, T, 8, 4, 2, 2).permute(0, 1, 5, 3, 2, 4, 6).reshape(WK, BLOCK_N, MP)
        store_rows_scaled(acc, HAS_SCALE, scale_ptr, n0, pid_n, M, N, out_ptr, stride_om, acc_ptr, count_ptr,
                          BLOCK_N, MP, SPLIT_K, NORM_IN, NORM_OUT, parts_in, eps, K, parts_ptr, g_ptr, xg_ptr)


def meta_wpt(wpt: int, e4m3: bool) -> int:
    """The WPT of the metadata order (and 1/16 of a warp's K step) at WPT = wpt: an e4m3 word widens
    to two bf16 words' K."""
    return 2 * wpt if e4m3 else wpt


def config_unfit(n: int, k: int, cfg, e4m3: bool = False, swiglu: bool = False) -> str | None:
    """Why config ("sp", BM, BLOCK_N, WPT, SPLIT_K, num_warps, WK) cannot run an [N, K] weight (e4m3
    values; the SwiGLU epilogue), or None: the shape rules, which the format's configuration lists
    (engine/formats/sparse24.py) apply before any call."""
    _, _, bn, wpt, split_k, warps, wk = cfg
    step = 16 * meta_wpt(wpt, e4m3)
    if k % (split_k * wk * step):
        return f"K={k} not a multiple of {split_k * wk * step}"
    rb = bn // (16 * (warps // wk)) if warps % wk == 0 else 0
    if warps % wk or bn != 16 * rb * (warps // wk) or rb & (rb - 1):
        return "BLOCK_N must be 16 * RB rows per row warp, RB a power of 2"
    if swiglu and (split_k != 1 or rb < 2):
        return "SwiGLU epilogue: SPLIT_K = 1 and at least 2 row blocks per warp"
    if swiglu and n % 32:
        return "SwiGLU epilogue: gate / up rows not a multiple of 16"
    return None


def unsupported(x, values, cfg, swiglu: bool = False) -> str | None:
    """Why the kernel cannot run this call with config cfg (swiglu: silu(gate) * up of a fused gate/up
    weight), or None. (The metadata copy `launch` takes is checked there: it is per WPT.)"""
    m, k = x.shape
    if (values.dtype, x.dtype) not in ((torch.bfloat16,) * 2, (torch.float8_e4m3fn,) * 2):
        return "bf16 values and activations, or e4m3 both"
    if m > 16:
        return "M > 16"
    if values.stride(0) != k // 2 or values.stride(1) != 1:
        return "strided values"
    if x.stride(1) != 1 or x.stride(0) * x.element_size() % 16 or x.data_ptr() % 16:
        return "x not read as 16-byte vectors (unit stride along K, rows 16-byte aligned)"
    return config_unfit(values.shape[0], k, cfg, values.dtype == torch.float8_e4m3fn, swiglu)


def mma_meta_shape(n: int, k: int, wpt: int) -> tuple[int, ...]:
    """The shape of `mma_order_meta` of an [N, K] weight at WPT = wpt."""
    return (-(-n // 16), k // (16 * wpt), 8, 2, wpt // 2)


def mma_order_meta(meta: torch.Tensor, wpt: int) -> torch.Tensor:
    """meta [N, K/8] uint8 (a nibble per group) -> the kernel's metadata registers at WPT = wpt,
    int32 [ceil(N/16), K/(16 wpt), 8 (g), 2 (q), wpt/2 (MMA c)]: the register thread (g, q) of a
    16-row block passes to MMA c of a K step (rows g and g + 8, logical groups 4q .. 4q + 3, a
    nibble each; logical group j of MMA c is stored group wpt (j % 4) + 2c + j // 4 of the step).
    Rows past N are zero. The same bytes as meta, in the order the kernel loads them. (The e4m3
    kernel at WPT takes those of 2 * WPT.)"""
    n, k = meta.shape[0], meta.shape[1] * 8
    steps, c = k // (16 * wpt), wpt // 2
    nib = torch.stack([meta & 15, meta >> 4], dim=-1).reshape(n, k // 4).long()
    nib = torch.cat([nib, nib.new_zeros(-n % 16, k // 4)]).view(-1, 2, 8, steps, 4 * wpt)
    j = torch.arange(8, device=meta.device)
    stored = wpt * (j % 4)[None, :] + 2 * torch.arange(c, device=meta.device)[:, None] + (j // 4)[None, :]
    groups = nib[..., stored].view(-1, 2, 8, steps, c, 2, 4)  # [.., row8, g, step, c, q, i]: j = 4q + i
    reg = (groups << (4 * torch.arange(4, device=meta.device))).sum(-1)
    reg = reg[:, 0] | (reg[:, 1] << 16)  # [blocks, g, step, c, q]
    reg = torch.where(reg >= 2**31, reg - 2**32, reg).to(torch.int32)
    return reg.permute(0, 2, 1, 4, 3).contiguous()


def launch(x, values, meta_mma, scale, cfg, out, swiglu=False, norm_out=None, row_scale=None, x_scale=None):
    """out[M, N] = x @ W^T (times scale) with config cfg, which `unsupported` accepted; meta_mma:
    `mma_order_meta(meta, WPT)` (e4m3: of 2 * WPT). swiglu: out [M, N/2] = silu(gate) * up.
    The RMSNorm hand-off (engine/kernels/stream_triton.py; `store_rows` in
    engine/kernels/nvfp4_gluon.py runs it): norm_out = (g [N], xg [M, N], parts from
    `norm_parts(N, device, BLOCK_N)`), out the residual, added into; row_scale = (parts [G, 16]
    fp32, eps). Neither with swiglu. e4m3 values and x: x_scale [M] fp32, out = (x * x_scale) @ W^T
    (times scale), the plain epilogue only."""
    _, _, bn, wpt, split_k, warps, wk = cfg
    m, k = x.shape
    n = values.shape[0]
    tiles = -(-n // bn)
    e4m3 = values.dtype == torch.float8_e4m3fn
    if e4m3 and (swiglu or norm_out is not None or row_scale is not None):
        raise ValueError("e4m3: neither the SwiGLU epilogue nor the norm hand-off")
    if e4m3 and (x_scale is None or x_scale.numel() != m or x_scale.dtype != torch.float32):
        raise ValueError(f"e4m3: x_scale must be fp32 with one scale per token ({m})")
    if swiglu and (norm_out is not None or row_scale is not None):
        raise ValueError("the norm hand-off runs in the plain epilogue, not the SwiGLU one")
    if norm_out is not None and row_scale is not None:
        raise ValueError("norm_out and row_scale: one side of the hand-off a launch (one parts buffer)")
    g, xg, parts = norm_out if norm_out is not None else (out, out, None)
    parts, eps = row_scale if row_scale is not None else (parts, 0.0)
    if norm_out is not None:
        if xg.shape != out.shape or not out.is_contiguous() or not xg.is_contiguous():
            raise ValueError(f"norm_out: residual and xg [{m}, {n}] contiguous")
        check_parts(parts, tiles)
    if row_scale is not None:
        check_parts(parts)
    n_parts = parts.shape[0] if parts is not None else 0
    want_wpt = meta_wpt(wpt, e4m3)
    want = mma_meta_shape(n, k, want_wpt)
    if meta_mma.dtype != torch.int32 or tuple(meta_mma.shape) != want or not meta_mma.is_contiguous():
        raise ValueError(f"meta_mma: mma_order_meta(meta, {want_wpt}) for WPT {wpt}, int32 {want}; "
                         f"got {meta_mma.dtype} {tuple(meta_mma.shape)}")
    acc, count = split_k_buffers(x.device, m * n, tiles) if split_k > 1 else (out, out)
    words = values.view(torch.int32)  # two kept values of one group (bf16) or of two (e4m3)
    xs = x_scale.reshape(m) if e4m3 else words
    sparse24_sp_kernel[(tiles, split_k)](
        x.view(torch.int32), words, meta_mma, scale if scale is not None else words, xs, out, acc, count,
        parts if parts is not None else out, g, xg, n_parts, float(eps), m, n,
        x.stride(0) * x.element_size() // 4, out.stride(0), K=k, BLOCK_N=bn, WPT=wpt, MP=8 if m <= 8 else 16,
        WK=wk, SPLIT_K=split_k, HAS_SCALE=scale is not None, SWIGLU=swiglu, NORM_IN=row_scale is not None,
        NORM_OUT=norm_out is not None, PARTS=triton.next_power_of_2(n_parts) if row_scale is not None else 1,
        E4M3=e4m3, num_warps=warps)
    return out
