"""Triton kernels for 2:4-sparse linears: decode GEMMs that stream the compressed weight, and a
one-pass per-token FP8 quantizer for the activations of the sparse-tensor-core prefill path.

Compressed format (see sparse24.py): for W [N, K], `values` [N, K/2] holds the two kept entries of
each group of 4 along K, in ascending position order; `meta` [N, K/8] uint8 holds one nibble per
group (low nibble = even group), nibble = i0 | i1 << 2 with i0 < i1 the kept positions.

The weight bytes streamed from HBM are the kept values plus 4 bits per group: 56% of dense bf16
(31% with e4m3 values). Four ways to multiply, all tuned against each other per shape:
- `sparse24_mma_kernel` (M <= 32; the fastest measured at M = 1..16): the weight tile is the A
  operand of the tensor cores with K reordered (in W and x alike) so that the four K columns a
  thread holds per row in a k16 MMA step are exactly one 2:4 group, and a thread's groups of
  consecutive steps are consecutive in memory. Per row and step a thread then reads one 32-bit
  word (the two kept bf16 values) and one nibble, and builds its two bf16x2 A registers with two
  `prmt` whose selectors are computed from the nibble: ~14 instructions per group in SASS, no
  shuffles, no selects per element. Loads are 16-byte cp.async into a 3-4 stage pipeline; K is
  split across programs when N leaves SMs idle, reduced in the same launch. On an H200 it
  streams 2.7-3.0 TB/s of compressed weight at the Llama-3.1-8B FFN shapes, M = 1 and 16.
- `sparse24_fma_kernel` (M <= 4): no tensor cores. Each kept value picks its activation with two
  selects (i0 in {0,1,2}, i1 in {1,2,3}) and does one FMA; partial sums stay per group in registers
  and are reduced once at the end. No shared memory, so many programs per SM keep loads in flight.
- `sparse24_wtile_kernel`: rebuilds the dense [BN, BK] weight tile in registers (tl.join of the four
  per-position operands) and runs y^T = W_tile @ x^T on the tensor cores, the tile as the A operand.
- `sparse24_xsplit_kernel`: keeps the weight in four per-position [BN, BK/4] operands and
  de-interleaves the activation tile instead: y = sum_j x_j @ d_j^T, four K/4-wide tl.dots.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.split_k import split_k_arrive, split_k_take


@triton.jit
def _load_groups(v_ptr, meta_ptr, offs_n, mask_n, k0, K, stride_vn, stride_metan,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The compressed tile at columns [k0, k0 + BLOCK_K): kept values v0, v1 and positions i0, i1,
    each [BLOCK_N, BLOCK_K / 4] (one entry per group)."""
    GROUPS: tl.constexpr = BLOCK_K // 4
    kv = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    v = tl.load(v_ptr + offs_n[:, None] * stride_vn + kv[None, :],
                mask=mask_n[:, None] & (kv[None, :] < K // 2), other=0.0)
    kb = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mb = tl.load(meta_ptr + offs_n[:, None] * stride_metan + kb[None, :],
                 mask=mask_n[:, None] & (kb[None, :] < K // 8), other=0)
    # One nibble per group, even group in the low nibble: [BN, G/2] bytes -> [BN, G] nibbles.
    nib = tl.reshape(tl.join(mb & 15, mb >> 4), (BLOCK_N, GROUPS))
    v0, v1 = tl.split(tl.reshape(v, (BLOCK_N, GROUPS, 2)))
    return v0, v1, nib & 3, nib >> 2


@triton.jit
def _per_position(v0, v1, i0, i1):
    """d_j[n, g] = the weight at position j of group g (zero where not kept); i0 < i1."""
    zero = tl.zeros_like(v0)
    d0 = tl.where(i0 == 0, v0, zero)  # position 0 can only be the first kept one
    d1 = tl.where(i0 == 1, v0, tl.where(i1 == 1, v1, zero))
    d2 = tl.where(i0 == 2, v0, tl.where(i1 == 2, v1, zero))
    d3 = tl.where(i1 == 3, v1, zero)  # position 3 can only be the second kept one
    return d0, d1, d2, d3


@triton.jit
def _store(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, scale_ptr, stride_ym,
           HAS_SCALE: tl.constexpr, SPLIT_K: tl.constexpr):
    """acc [BM, BN] (fp32) -> y, times the per-channel scale; split-K partials add atomically."""
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=["M"])  # one binary for every M: decode batches vary per step
def sparse24_fma_kernel(
    x_ptr, v_ptr, meta_ptr, scale_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_vn, stride_metan, stride_ym,
    HAS_SCALE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[M, N] = x @ W^T on the CUDA cores, for a handful of rows (BLOCK_M <= 4)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    GROUPS: tl.constexpr = BLOCK_K // 4
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, GROUPS)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N, GROUPS), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = kt * BLOCK_K
        v0, v1, i0, i1 = _load_groups(v_ptr, meta_ptr, offs_n, mask_n, k0, K, stride_vn, stride_metan,
                                      BLOCK_N, BLOCK_K)
        g = k0 // 4 + offs_g
        xp = x_ptr + offs_m[:, None] * stride_xm + 4 * g[None, :]
        xmask = mask_m[:, None] & (g[None, :] < K // 4)
        x0 = tl.load(xp, mask=xmask, other=0.0).to(tl.float32)[:, None, :]
        x1 = tl.load(xp + 1, mask=xmask, other=0.0).to(tl.float32)[:, None, :]
        x2 = tl.load(xp + 2, mask=xmask, other=0.0).to(tl.float32)[:, None, :]
        x3 = tl.load(xp + 3, mask=xmask, other=0.0).to(tl.float32)[:, None, :]
        i0 = i0[None, :, :]
        i1 = i1[None, :, :]
        xs0 = tl.where(i0 == 0, x0, tl.where(i0 == 1, x1, x2))  # i0 in {0, 1, 2}
        xs1 = tl.where(i1 == 3, x3, tl.where(i1 == 2, x2, x1))  # i1 in {1, 2, 3}
        acc += v0.to(tl.float32)[None, :, :] * xs0 + v1.to(tl.float32)[None, :, :] * xs1
    _store(y_ptr, tl.sum(acc, axis=2), offs_m, offs_n, mask_m, mask_n, scale_ptr, stride_ym,
           HAS_SCALE, SPLIT_K)


@triton.jit(do_not_specialize=["M"])
def sparse24_wtile_kernel(
    x_ptr, v_ptr, meta_ptr, scale_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_vn, stride_metan, stride_ym,
    HAS_SCALE: tl.constexpr, SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y^T tile [BN, BM] = dense W tile [BN, BK] (rebuilt in registers) @ x^T tile [BK, BM]."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_x = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = kt * BLOCK_K
        kx = k0 + offs_x
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kx[:, None],
                     mask=mask_m[None, :] & (kx[:, None] < K), other=0.0)
        v0, v1, i0, i1 = _load_groups(v_ptr, meta_ptr, offs_n, mask_n, k0, K, stride_vn, stride_metan,
                                      BLOCK_N, BLOCK_K)
        d0, d1, d2, d3 = _per_position(v0.to(xt.dtype), v1.to(xt.dtype), i0, i1)
        # [BN, G, p, q] with position 2p + q, flattened: the dense tile in natural k order.
        w = tl.reshape(tl.join(tl.join(d0, d2), tl.join(d1, d3)), (BLOCK_N, BLOCK_K))
        if DOT_FP32:
            w = w.to(tl.float32)
            xt = xt.to(tl.float32)
        acc = tl.dot(w, xt, acc)
    _store(y_ptr, tl.trans(acc), offs_m, offs_n, mask_m, mask_n, scale_ptr, stride_ym, HAS_SCALE, SPLIT_K)


@triton.jit(do_not_specialize=["M"])
def sparse24_xsplit_kernel(
    x_ptr, v_ptr, meta_ptr, scale_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_vn, stride_metan, stride_ym,
    HAS_SCALE: tl.constexpr, SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y = sum_j x_j @ d_j^T with x_j[m, g] = x[m, 4g + j]. DOT_FP32 widens the operands first: the
    CPU interpreter (triton 3.9) multiplies bf16 dot operands wrongly; fp32 products of bf16 values
    are exact, so the function is the same."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    GROUPS: tl.constexpr = BLOCK_K // 4
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_x = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = kt * BLOCK_K
        kx = k0 + offs_x
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :],
                    mask=mask_m[:, None] & (kx[None, :] < K), other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
        v0, v1, i0, i1 = _load_groups(v_ptr, meta_ptr, offs_n, mask_n, k0, K, stride_vn, stride_metan,
                                      BLOCK_N, BLOCK_K)
        d0, d1, d2, d3 = _per_position(v0.to(x.dtype), v1.to(x.dtype), i0, i1)
        # x[m, 4g + 2p + q] -> x_{2p+q}[m, g]
        xa, xb = tl.split(tl.reshape(x, (BLOCK_M, GROUPS, 2, 2)))
        x0, x2 = tl.split(xa)
        x1, x3 = tl.split(xb)
        acc = tl.dot(x0, tl.trans(d0), acc)
        acc = tl.dot(x1, tl.trans(d1), acc)
        acc = tl.dot(x2, tl.trans(d2), acc)
        acc = tl.dot(x3, tl.trans(d3), acc)
    _store(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, scale_ptr, stride_ym, HAS_SCALE, SPLIT_K)


# ----------------------------------------------------------------------------- word-per-thread MMA decode
#
# `sparse24_mma_kernel`: y^T [BN, BM] = W_tile [BN, BK] @ x^T, the weight tile as the MMA's A
# operand. The A fragment of a k16 MMA step gives each thread, per row, the K columns
# {2q, 2q+1, 2q+8, 2q+9} (q = lane % 4). K is reordered, the same way in W and x (the dot product
# does not change), so that those four logical columns are one 2:4 group, and so that a thread's
# groups of consecutive k16 steps are consecutive in memory: in a chunk of 16*CH physical K,
# group CH*q + c (c < CH) is thread q's group of step c. Per row and step a thread then holds one
# 32-bit word (the two kept bf16 values) and one nibble, loaded as CH-word vectors, and builds its
# two bf16x2 A registers with two `prmt` (_DECODE_PTX) whose selectors come from the nibble.

# Selector of one A register, one byte per bf16 position p (two per register): 0x10 takes the
# first kept value (word bytes 1:0), 0x32 the second (bytes 3:2), 0x44 zero (bytes of b = 0).
# With a code c_p = 0 / 1 / 2 per position, the selector byte is 0x10 + 0x22 c_p; every position
# starts at 2 (zero), the first kept one drops by 2 and the second by 1:
# S = 0x54545454 - (0x44 << 8 i0) - (0x22 << 8 i1); S[15:0] selects positions 0, 1 and S[31:16]
# positions 2, 3. 12 instructions per group (per 2 kept values), for every row of x at once.
# Operands (pack = 8: elements p + 2 r8 + 4 h of the fragment, p the lane of a bf16x2 register,
# r8 the row 8 below, h the upper half of the k16 step): $0-$3 out (r8 + 2h), $4-$11 each
# element's word, $12-$19 its nibble; row r8 reads element 2 r8.
def _decode_ptx(pack: int = 8) -> str:
    """PTX for `pack` elements of the A fragment. Element e = p + 2 r8 + 4 h + 8 b: p the lane of
    a bf16x2 register, r8 the row 8 below, h the upper half of the k16 step, b the next k16 step
    (pack = 16). Outputs: register r8 + 2h + 4b. Inputs: each element's word, then its meta:
    with pack = 8 the group's nibble; with pack = 16 the group's meta byte, whose low nibble is
    step b = 0's (an even group) and high nibble step b = 1's. Row r8 of step b reads element
    2 r8 + 8 b."""
    lines = ["{", ".reg .b32 s, t, u, z, c44, c22, c54;", "mov.b32 z, 0;", "mov.b32 c44, 0x44;",
             "mov.b32 c22, 0x22;", "mov.b32 c54, 0x54545454;"]
    n_out = pack // 2
    for b in range(pack // 8):
        for r8 in (0, 1):
            e = 2 * r8 + 8 * b
            word, meta = f"${n_out + e}", f"${n_out + pack + e}"
            # t = 8 i0, u = 8 i1 from the nibble at bit 4b of `meta`
            if b == 0:
                lines += [f"shl.b32 t, {meta}, 3;", f"shl.b32 u, {meta}, 1;"]
            else:
                lines += [f"shr.b32 t, {meta}, 1;", f"shr.b32 u, {meta}, 3;"]
            lines += ["and.b32 t, t, 24;", "shl.b32 t, c44, t;", "and.b32 u, u, 24;", "shl.b32 u, c22, u;",
                      "add.u32 t, t, u;", "sub.u32 s, c54, t;",
                      f"prmt.b32 ${r8 + 4 * b}, {word}, z, s;", "shr.b32 s, s, 16;",
                      f"prmt.b32 ${r8 + 2 + 4 * b}, {word}, z, s;"]
    return "\n".join(lines + ["}"])


_DECODE_PTX8 = tl.constexpr(_decode_ptx(8))
_DECODE_CONSTRAINTS8 = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 16))
_DECODE_PTX16 = tl.constexpr(_decode_ptx(16))
_DECODE_CONSTRAINTS16 = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 32))


@triton.jit
def _x_logical(t, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, CH: tl.constexpr):
    """[ROWS, BLOCK_K] in physical K order -> the logical order of the MMA. Physical k of a chunk
    of 16*CH: (q, c, h, p) = 4 (CH q + c) + 2h + p (group CH q + c, position 2h + p); logical:
    (c, h, q, p) = 16c + 8h + 2q + p."""
    t = t.reshape(ROWS, BLOCK_K // (16 * CH), 4, CH, 2, 2)
    return tl.permute(t, (0, 1, 3, 4, 2, 5)).reshape(ROWS, BLOCK_K)


@triton.jit
def _per_element(t, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, CH: tl.constexpr):
    """Per-group [ROWS, BLOCK_K/4] (physical group order) -> [ROWS, BLOCK_K] in logical K order:
    each element's group value (a broadcast: in the MMA layout, registers of one thread)."""
    t = tl.permute(t.reshape(ROWS, BLOCK_K // (16 * CH), 4, CH), (0, 1, 3, 2))
    t = tl.broadcast_to(t.reshape(ROWS, BLOCK_K // (16 * CH), CH, 1, 4, 1),
                        (ROWS, BLOCK_K // (16 * CH), CH, 2, 4, 2))
    return t.reshape(ROWS, BLOCK_K)


@triton.jit(do_not_specialize=["M"])
def sparse24_mma_kernel(
    x_ptr, w_ptr, meta_ptr, scale_ptr, y_ptr, acc_ptr, count_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_metan, stride_ym,
    HAS_SCALE: tl.constexpr, FP8_VALUES: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PTX: tl.constexpr, PTX_PACK: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CH: tl.constexpr,
):
    """y[M, N] = x @ W^T (times scale[N]), for M <= BLOCK_M per program row. w_ptr: one word per
    group, int32 (two bf16) or int16 (two e4m3, FP8_VALUES). With SPLIT_K > 1 the programs of a
    tile add into acc_ptr (fp32, zero on entry) and the last one writes y and re-zeroes acc_ptr
    and its counter (engine/kernels/split_k.py). USE_PTX only where the decode's result has the
    MMA's A-operand layout (checked on the compiled kernel, sparse24._mma_layout_ok); elsewhere
    the same function in Triton arithmetic."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    G: tl.constexpr = BLOCK_K // 4
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, G)
    offs_b = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    pos = ((offs_k >> 3) & 1) * 2 + (offs_k & 1)  # position 2h + p of each logical element
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    meta_rows = meta_ptr + offs_n[:, None] * stride_metan
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = kt * BLOCK_K
        g = k0 // 4 + offs_g
        kb = k0 // 8 + offs_b
        kx = k0 + offs_k
        if EVEN_K:
            words = tl.load(w_rows + g[None, :], mask=mask_n[:, None], other=0)
            mb = tl.load(meta_rows + kb[None, :], mask=mask_n[:, None], other=0)
            x = tl.load(x_rows + kx[None, :], mask=mask_m[:, None], other=0.0)
        else:
            words = tl.load(w_rows + g[None, :], mask=mask_n[:, None] & (g[None, :] < K // 4), other=0)
            mb = tl.load(meta_rows + kb[None, :], mask=mask_n[:, None] & (kb[None, :] < K // 8), other=0)
            x = tl.load(x_rows + kx[None, :], mask=mask_m[:, None] & (kx[None, :] < K), other=0.0)
        # Per group its meta byte (PTX_PACK = 16: the PTX picks the nibble) or its nibble, even
        # group low. Joins, not a broadcast: with a broadcast Triton decoded in another layout.
        mb = mb.to(tl.int32)
        if PTX_PACK == 16:
            meta = tl.join(mb, mb).reshape(BLOCK_N, G)
        else:
            meta = tl.join(mb & 15, mb >> 4).reshape(BLOCK_N, G)
        if FP8_VALUES:  # e4m3 pair -> bf16 pair, exact
            wi = words.to(tl.int32)
            v0 = (wi & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            v1 = ((wi >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            words = (v0.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (
                v1.to(tl.int16, bitcast=True).to(tl.int32) << 16)
        x = _x_logical(x, BLOCK_M, BLOCK_K, CH)
        if USE_PTX:
            if PTX_PACK == 16:
                w = tl.inline_asm_elementwise(
                    _DECODE_PTX16, _DECODE_CONSTRAINTS16,
                    [_per_element(words, BLOCK_N, BLOCK_K, CH), _per_element(meta, BLOCK_N, BLOCK_K, CH)],
                    dtype=tl.bfloat16, is_pure=True, pack=16)
            else:
                w = tl.inline_asm_elementwise(
                    _DECODE_PTX8, _DECODE_CONSTRAINTS8,
                    [_per_element(words, BLOCK_N, BLOCK_K, CH), _per_element(meta, BLOCK_N, BLOCK_K, CH)],
                    dtype=tl.bfloat16, is_pure=True, pack=8)
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            nib = meta
            if PTX_PACK == 16:
                nib = (meta >> (offs_g[None, :] & 1) * 4) & 15
            lo = _per_element(words & 0xFFFF, BLOCK_N, BLOCK_K, CH)
            hi = _per_element((words >> 16) & 0xFFFF, BLOCK_N, BLOCK_K, CH)
            i0 = _per_element(nib & 3, BLOCK_N, BLOCK_K, CH)
            i1 = _per_element(nib >> 2, BLOCK_N, BLOCK_K, CH)
            bits = tl.where(pos[None, :] == i0, lo, tl.where(pos[None, :] == i1, hi, 0))
            w = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
            if INTERPRETER:  # the interpreter's bf16 dot is wrong (Triton 3.9); fp32, same values
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)

    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = mask_m[None, :] & mask_n[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        acc_ptrs = acc_ptr + offs_m[None, :] * N + offs_n[:, None]
        counter_ptr = count_ptr + pid_m * tl.num_programs(0) + pid_n
        if split_k_arrive(acc, acc_ptrs, mask, counter_ptr, SPLIT_K):
            total = split_k_take(acc_ptrs, mask, counter_ptr)
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
