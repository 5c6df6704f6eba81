"""2:4-sparse decode GEMM for Hopper (M <= 16 tokens), in Gluon: y = x @ W^T, W 2:4-compressed
(`values` bf16 [N, K/2], `meta` uint8 [N, K/8], see sparse24.py).

The structure of engine/kernels/nvfp4_decode_gluon.py, whose `stream_pointers` and `stream_steps`
run this kernel's K loop (mma.sync m16n8k16, every operand in registers, explicit layouts checked
with `convert_layout(..., assert_trivial=True)`, two K steps in flight, warps split rows and K,
split-K across programs in one launch), with the 2:4 format's
A fragment: the K reorder of sparse24_triton (`_x_logical`, CH = WPT) makes the 4 K columns a
thread holds per row and k16 step one 2:4 group, i.e. one 32-bit word of kept values, and its
WPT steps' groups consecutive in memory. Per row and K step of 16 * WPT a thread loads WPT words
(16 bytes at WPT = 4) and WPT nibbles of meta (a u16 at WPT = 4), and builds its two bf16x2 A
registers per word with two `prmt` (`_DECODE_ASM`, the selector arithmetic of sparse24_triton's
`_decode_ptx`); the zeros of the expanded fragment cost nothing. x: 16-byte loads in physical K
order permuted in registers to the logical order. Rows past N re-read row N-1, x rows past M
re-read row M-1: no masks in the K loop.

Measured (H200, CUDA-graph medians, 3 weight copies rotated, vs the best `sparse24_mma_kernel`
config of sparse24._DECODE_CONFIGS): gate_up 28672 x 4096 at M = 1 / 4 / 16: 36.3 / 36.8 / 44.0 us
(3.64 / 3.59 / 3.00 TB/s of compressed weight) against 44.5 / 44.2 / 44.2 us; down 4096 x 14336:
21.7 / 22.4 / 28.6 us against 23.5 / 23.7 / 24.0 us. Slower at M = 16 for the reason
nvfp4_decode_gluon gives: each warp loads its own x fragment. WPT = 8 was not faster (40.5 us
gate_up, 23.1 us down at M = 1). engine/kernels/sparse24_sp_gluon.py, which hands the stored values to
the sparse tensor cores instead of expanding them, is faster at M <= 8 and level at 16; both stay
timed candidates.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from engine.kernels.nvfp4_decode_gluon import (mma_layout, store_rows, stream_pointers, stream_steps,
                                               words_layout)
from engine.kernels.split_k import split_k_buffers


def _decode_asm() -> str:
    """One group (word of two kept bf16, $2..$5) and its meta nibble (in bits 3:0 of $6..$9; higher
    bits ignored) -> 2 bf16x2 registers: $0 positions 0, 1 and $1 positions 2, 3. prmt selector
    byte per position: 0x10 first kept value, 0x32 second, 0x54 zero (bytes of the zero operand):
    S = 0x54545454 - (0x44 << 8 i0) - (0x22 << 8 i1)."""
    return "\n".join([
        "{", ".reg .b32 s, t, u, z, c44, c22, c54;", "mov.b32 z, 0;", "mov.b32 c44, 0x44;",
        "mov.b32 c22, 0x22;", "mov.b32 c54, 0x54545454;",
        "shl.b32 t, $6, 3;", "and.b32 t, t, 24;", "shl.b32 t, c44, t;",
        "shl.b32 u, $6, 1;", "and.b32 u, u, 24;", "shl.b32 u, c22, u;",
        "add.u32 t, t, u;", "sub.u32 s, c54, t;",
        "prmt.b32 $0, $2, z, s;", "shr.b32 s, s, 16;", "prmt.b32 $1, $2, z, s;", "}"])


_DECODE_ASM = gl.constexpr(_decode_asm())
_DECODE_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 2 + ["r"] * 8))


@gluon.jit
def _dup4(v):
    v = gl.join(v, v)
    return gl.join(v, v)


@gluon.jit
def _mma_step(words, meta, shift, x, acc, WK: gl.constexpr, BLOCK_N: gl.constexpr,
              WPT: gl.constexpr, MP: gl.constexpr):
    """acc += decode(words, meta) @ x^T for one K step of 16 * WPT, all in registers."""
    STEP_K: gl.constexpr = 16 * WPT
    mma: gl.constexpr = acc.type.layout
    # meta [WK, BLOCK_N, 4] (thread q's WPT nibbles) -> per word j = WPT*q + c, nibble c at bit 0
    m = meta.to(gl.int32)
    if WPT == 8:
        m = gl.join(gl.join(m, m), gl.join(m, m))
        m = gl.join(m, m)
    elif WPT == 4:
        m = gl.join(gl.join(m, m), gl.join(m, m))
    elif WPT == 2:
        m = gl.join(m, m)
    m = gl.convert_layout(m.reshape(WK, BLOCK_N, 4 * WPT), words.type.layout, assert_trivial=True)
    m = m >> shift
    w = gl.inline_asm_elementwise(_DECODE_ASM, _DECODE_CONSTRAINTS, [_dup4(words), _dup4(m)],
                                  dtype=gl.bfloat16, is_pure=True, pack=4)
    # [.., rows, word j = (q, c), h, p] -> logical K = 16c + 8h + 2q + p
    w = w.reshape(WK, BLOCK_N, 4, WPT, 2, 2).permute(0, 1, 3, 4, 2, 5)
    a = gl.convert_layout(w.reshape(WK, BLOCK_N, STEP_K), gl.DotOperandLayout(0, mma, 2),
                          assert_trivial=True)
    # x: physical K = 4*WPT*q + 4c + 2h + p -> the same logical order
    xt = x.reshape(WK, MP, 4, WPT, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(WK, MP, STEP_K)
    b = gl.convert_layout(xt.permute(0, 2, 1), gl.DotOperandLayout(1, mma, 2), assert_trivial=True)
    return mma_v2(a, b, acc)


@gluon.jit
def _times_row_scale(total, scale_ptr, rows, N):
    """times the per-output-channel scale[N]."""
    return total * gl.load(scale_ptr + rows, mask=rows < N, other=0.0)[:, None]


@gluon.jit
def _unscaled(total, scale_ptr, rows, N):
    return total


@gluon.jit
def store_rows_scaled(acc, HAS_SCALE: gl.constexpr, scale_ptr, n0, pid_n, M, N, out_ptr, stride_om, acc_ptr,
                      count_ptr, BLOCK_N: gl.constexpr, MP: gl.constexpr, SPLIT_K: gl.constexpr):
    """store_rows of both 2:4 kernels: times scale[N] when HAS_SCALE (fp8-style per-row scales)."""
    if HAS_SCALE:
        store_rows(_times_row_scale, acc, scale_ptr, n0, pid_n, M, N, out_ptr, stride_om, acc_ptr,
                   count_ptr, BLOCK_N, MP, SPLIT_K)
    else:
        store_rows(_unscaled, acc, scale_ptr, n0, pid_n, M, N, out_ptr, stride_om, acc_ptr,
                   count_ptr, BLOCK_N, MP, SPLIT_K)


@gluon.jit(do_not_specialize=["M"])
def sparse24_decode_kernel(
    x_ptr, words_ptr, meta_ptr, scale_ptr, out_ptr, acc_ptr, count_ptr,
    M, N, stride_xm, stride_om, K: gl.constexpr,
    BLOCK_N: gl.constexpr, WPT: gl.constexpr, MP: gl.constexpr, WK: gl.constexpr,
    SPLIT_K: gl.constexpr, HAS_SCALE: gl.constexpr, X_AHEAD: gl.constexpr = False,
):
    """y[M, N] = x @ W^T (times scale[N]) for M <= MP (8 or 16). words_ptr: the kept values as
    int32 [N, K/4] (one word per group), meta_ptr: [N, K/8] bytes, read WPT/2 at a time (u8, u16,
    u32);
    K a multiple of SPLIT_K * WK * 16 * WPT. SPLIT_K > 1: as nvfp4_decode_kernel."""
    WN: gl.constexpr = gl.num_warps() // WK
    STEP_K: gl.constexpr = 16 * WPT
    K_CTA: gl.constexpr = K // SPLIT_K
    STEPS: gl.constexpr = K_CTA // (WK * STEP_K)  # per warp
    mma: gl.constexpr = mma_layout(WN, WK)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n0 = pid_n * BLOCK_N
    k0 = pid_k * K_CTA
    words_ptrs, meta_ptrs, x_ptrs = stream_pointers(
        words_ptr, meta_ptr, x_ptr, n0, k0, M, N, stride_xm, K, BLOCK_N, WPT, MP, WN, WK, STEP_K)
    # Word j = WPT*q + c of a thread takes nibble c of its meta element.
    w_layout: gl.constexpr = words_layout(BLOCK_N, WPT, WN, WK)
    w_cols = gl.arange(0, 4 * WPT, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_layout)))
    shift = ((w_cols % WPT) * 4)[None, None, :]
    acc = gl.zeros([WK, BLOCK_N, MP], gl.float32, layout=mma)
    acc = stream_steps(_mma_step, words_ptrs, meta_ptrs, x_ptrs, shift, acc, STEPS, STEP_K, WK, BLOCK_N,
                       WPT, MP, X_AHEAD)
    store_rows_scaled(acc, HAS_SCALE, scale_ptr, n0, pid_n, M, N, out_ptr, stride_om, acc_ptr, count_ptr,
                      BLOCK_N, MP, SPLIT_K)


def unsupported_common(x, values, meta, wpt, split_k, wk) -> str | None:
    """Why neither Gluon 2:4 kernel can run this call (GPU, dtypes, M, K, storage), or None."""
    m, k = x.shape
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        return "not sm_90"
    if values.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        return "bf16 values and activations only"
    if m > 16:
        return "M > 16"
    if k % (split_k * wk * 16 * wpt):
        return f"K={k} not a multiple of {split_k * wk * 16 * wpt}"
    if values.stride(0) != k // 2 or meta.stride(0) != k // 8 or values.stride(1) != 1 or meta.stride(1) != 1:
        return "strided values/meta"
    return None


def unsupported(x, values, meta, cfg) -> str | None:
    """Why the Gluon kernel cannot run this call with config ("gluon", BM, BLOCK_N, WPT, SPLIT_K,
    num_warps, WK), or None."""
    _, _, bn, wpt, split_k, warps, wk = cfg[:7]
    reason = unsupported_common(x, values, meta, wpt, split_k, wk)
    if reason:
        return reason
    if x.stride(1) != 1:
        return "x not contiguous along K (the kernel reads it in 16-byte vectors)"
    if warps % wk or bn % (16 * (warps // wk)):
        return "tile does not fit the warps"
    return None


def launch_setup(x, values, out, block_n, split_k):
    """Both 2:4 kernels' grid (row tiles, split_k), split-K buffers and the kept values as int32
    words (one per group)."""
    tiles = -(-values.shape[0] // block_n)
    acc, count = split_k_buffers(x.device, x.shape[0] * values.shape[0], tiles) if split_k > 1 else (out, out)
    return (tiles, split_k), acc, count, values.view(torch.int32)


def launch(x, values, meta, scale, cfg, out):
    """out[M, N] = x @ W^T (times scale) with config cfg, which `unsupported` accepted."""
    _, _, bn, wpt, split_k, warps, wk = cfg[:7]
    x_ahead = len(cfg) > 7 and bool(cfg[7])
    m, k = x.shape
    n = values.shape[0]
    grid, acc, count, words = launch_setup(x, values, out, bn, split_k)
    sparse24_decode_kernel[grid](
        x, words, meta, scale if scale is not None else words, out, acc, count, m, n,
        x.stride(0), out.stride(0), K=k, BLOCK_N=bn, WPT=wpt, MP=8 if m <= 8 else 16, WK=wk,
        SPLIT_K=split_k, HAS_SCALE=scale is not None, X_AHEAD=x_ahead, num_warps=warps)
    return out
