"""The 2:4-sparse GEMM as a Triton kernel that streams the compressed weight (any CUDA GPU, the
interpreter too; bf16 or e4m3 values).

Compressed format (engine/formats/sparse24.py): for W [N, K], `values` [N, K/2] holds the two kept
entries of each group of 4 along K, in ascending position order; `meta` [N, K/8] uint8 holds one
nibble per group (low nibble = even group), nibble = i0 | i1 << 2 with i0 < i1 the kept positions.
The bytes streamed are the kept values plus 4 bits per group: 56% of dense bf16 (31% with e4m3).

`mma_gemm(x, values, meta, scale, config, out)`: the weight tile is the A operand of the tensor
cores with K reordered (in W and x alike) so that the four K columns a thread holds per row in a
k16 MMA step are exactly one 2:4 group, and a thread's groups of consecutive steps are consecutive
in memory. Per row and step a thread then reads one 32-bit word (the two kept bf16 values) and one
nibble, and builds its two bf16x2 A registers with two `prmt` whose selectors are computed from the
nibble: ~14 instructions per group in SASS, no shuffles, no selects per element. Loads are 16-byte
cp.async into a 3-4 stage pipeline; K is split across programs when N leaves SMs idle, reduced in
the same launch (engine/kernels/split_k.py). A config is (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
num_warps, num_stages, CH, PTX_PACK); the candidates are listed with the format.
"""
from __future__ import annotations

import triton
import triton.language as tl

import torch

from engine.kernels.platform import interpreting
from engine.kernels.split_k import split_k_arrive, split_k_buffers, split_k_take


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
    MMA's A-operand layout (checked on the compiled kernel, `_mma_layout_ok`); elsewhere
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


def mma_gemm(x, values, meta, scale, config, out):
    """out [M, N] = x [M, K] @ W^T (times scale [N] if given); values bf16 or e4m3 [N, K/2]."""
    bm, bn, bk, split_k, warps, stages, ch, pack = config
    m, k = x.shape
    n = values.shape[0]
    fp8 = values.element_size() == 1
    words = values.view(torch.int16 if fp8 else torch.int32)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split_k)
    acc, count = split_k_buffers(x.device, m * n, grid[0] * grid[1]) if split_k > 1 else (out, out)
    args = (x, words, meta, scale if scale is not None else words, out, acc, count, m, n, k,
            x.stride(0), words.stride(0), meta.stride(0), out.stride(0))
    const = dict(HAS_SCALE=scale is not None, FP8_VALUES=fp8, SPLIT_K=split_k, EVEN_K=k % bk == 0,
                 INTERPRETER=interpreting(), PTX_PACK=pack, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CH=ch,
                 num_warps=warps, num_stages=stages)
    use_ptx = not interpreting() and _mma_layout_ok(args, grid, const, out.dtype)
    sparse24_mma_kernel[grid](*args, USE_PTX=use_ptx, **const)
    return out


# (config, K % BLOCK_K == 0, value dtype, scaled, out dtype) -> whether the compiled PTX decode
# has the MMA's A-operand layout.
_MMA_LAYOUT_OK: dict = {}


def _mma_layout_ok(args, grid, const, out_dtype) -> bool:
    """Whether Triton gave the PTX decode's result the MMA's A-operand layout (bf16 pairs, kWidth
    2), the register order _decode_ptx is written for. Triton picks layouts itself; where it
    decodes in another layout and converts afterwards, the PTX would pair the wrong elements, and
    the arithmetic decode runs instead. Checked once per configuration on the compiled kernel."""
    # Triton specializes integer arguments divisible by 16, which can change the layouts it picks.
    key = (tuple(sorted(const.items())), out_dtype, tuple(a % 16 == 0 for a in args if isinstance(a, int)))
    if key not in _MMA_LAYOUT_OK:
        ok = False
        try:
            compiled = sparse24_mma_kernel.warmup(*args, grid=grid, USE_PTX=True, **const)
            for line in compiled.asm["ttgir"].splitlines():
                if "elementwise_inline_asm" in line and "prmt.b32" in line:
                    result = line.rsplit("->", 1)[-1]
                    ok = "dot_op<{opIdx = 0" in result and "kWidth = 2" in result
        except Exception:  # a configuration the compiler rejects: the arithmetic path runs
            ok = False
        _MMA_LAYOUT_OK[key] = ok
    return _MMA_LAYOUT_OK[key]
