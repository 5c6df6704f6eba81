"""NVFP4 weights on GPUs without FP4 tensor cores: Triton kernels that decode e2m1 in registers.

Weight operand `w`: any object with `packed` (uint8 e2m1 pairs, low nibble = even K), `block_scale`
(e4m3, one per 16 along K), `tensor_scale` (fp32 scalar), `shape` (N, K) and `tiled` (storage in
16-row x 128-K tiles, engine/formats/nvfp4.py). Activations bf16 [M, K], unit stride along K.

`decode_gemm(x, w, out)` (M <= 128, K % 64 == 0): weight streaming. The weight tile is the WGMMA's
A operand (its rows on the M side, x^T the [K, 16..128] B operand from shared memory), so one token
still feeds the tensor cores and the CUDA cores only decode e2m1, 17 instructions per packed word of
8 values (`_decode_ptx`):
- K is permuted alike in W and x (`_logical_k`) so that the 8 K positions a thread holds per 32 K
  of a row in the A fragment are one packed word, never split across threads; the pairs a shift
  places cheaply, (k0, k4) .. (k3, k7), are the bf16x2 registers the MMA reads.
- e2m1 is decoded by position: the 3 magnitude bits land on bf16 bits 8:6 (value x 2^-126; 0.5 is a
  subnormal the bf16 multiply honours); the block scale is pre-multiplied by 2^118, so the product
  is value x scale x 2^-8, exact in bf16; the epilogue multiplies by 2^8 x tensor scale.
- The PTX assumes the A operand's register order, which holds only where Triton propagates the MMA
  layout back through the decode: checked per configuration on the compiled kernel
  (`_ptx_decode_layout_ok`); elsewhere the kernel decodes arithmetically.
- K is split across programs when N alone leaves SMs idle, reduced in the same launch
  (engine/kernels/split_k.py). Launch parameters: `small_m_config`.

`dequantize_bf16(w)` decodes the whole weight (`_decode_tile`, `prmt` table lookups);
`dequantize_fp8(w)` decodes it to FP8 rows instead (e4m3 codes, one fp32 scale per row; lossy by
e4m3's rounding, `FP8_SHIFT`), for the FP8 GEMM: `_E2M1_TO_E4M3_PTX` turns each packed byte into
its two e4m3 codes in K order, so the kernel stores what it loaded, twice as wide, with no shuffle.
At large M, where decoding once and a tensor-core GEMM beat decoding per tile, `dequantize_scratch`
/ `dequantize_fp8_scratch` decode into one reused buffer per device.

The interpreter (TRITON_INTERPRET=1) runs no inline PTX: there the kernels decode with Triton
arithmetic computing the same function (`_e2m1_to_bf16_arith`, `_decode_words_arith`); a CPU test
executes `_decode_ptx` instruction by instruction against that element order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.norms import quantize_e4m3
from engine.kernels.platform import interpreting, sm_count
from engine.kernels.split_k import split_k_arrive, split_k_buffers, split_k_take

# The start of the table-lookup decoder's inline PTX: $4 holds 4 packed bytes = 8 codes. `prmt`
# looks 4 bytes up in an 8-byte table indexed by 3-bit codes (the sign masked off): hi_a:hi_b hold
# the high bytes of the bf16 encodings of the 8 e2m1 magnitudes (0x0000 3F00 3F80 3FC0 4000 4040
# 4080 40C0), lo_a:lo_b the low bytes; h0/l0 serve codes 0..3 of the word, h1/l1 codes 4..7.
# `shifted` (the word shifted left by 4) puts the even-K codes' sign bits at the top of a byte.
E2M1_BF16_LUT_PTX = """mov.b32 hi_a, 0x3F3F3F00;
mov.b32 hi_b, 0x40404040;
mov.b32 lo_a, 0xC0800000;
mov.b32 lo_b, 0xC0804000;
and.b32 sel0, $4, 0x7777;
shr.b32 sel1, $4, 16;
and.b32 sel1, sel1, 0x7777;
prmt.b32 h0, hi_a, hi_b, sel0;
prmt.b32 l0, lo_a, lo_b, sel0;
prmt.b32 h1, hi_a, hi_b, sel1;
prmt.b32 l1, lo_a, lo_b, sel1;
shl.b32 shifted, $4, 4;
"""

# After the table lookups of E2M1_BF16_LUT_PTX, a second `prmt`
# interleaves low and high bytes into bf16x2 words. The sign comes from `prmt`'s
# sign-replicate mode (selector bit 3): it copies the top bit of a chosen byte over a whole byte;
# a nibble's sign bit is the top bit of a byte either of the packed word (odd K) or of the word
# shifted left by 4 (even K); `lop3` ORs that bit into the bf16 sign (a | (b & c) = 0xF8).
# $4 holds 4 packed bytes = 8 codes, K = 0..7; $0, $1 get K = (0, 2), (4, 6);
# $2, $3 get (1, 3), (5, 7).
_E2M1_TO_BF16_PTX = tl.constexpr("""
{
.reg .b32 hi_a, hi_b, lo_a, lo_b, sel0, sel1, h0, l0, h1, l1, shifted, sgn;
""" + E2M1_BF16_LUT_PTX + """prmt.b32 $0, l0, h0, 0x6240;
prmt.b32 sgn, shifted, $4, 0x9080;
lop3.b32 $0, $0, sgn, 0x80008000, 0xF8;
prmt.b32 $1, l1, h1, 0x6240;
prmt.b32 sgn, shifted, $4, 0xB0A0;
lop3.b32 $1, $1, sgn, 0x80008000, 0xF8;
prmt.b32 $2, l0, h0, 0x7351;
prmt.b32 sgn, shifted, $4, 0xD0C0;
lop3.b32 $2, $2, sgn, 0x80008000, 0xF8;
prmt.b32 $3, l1, h1, 0x7351;
prmt.b32 sgn, shifted, $4, 0xF0E0;
lop3.b32 $3, $3, sgn, 0x80008000, 0xF8;
}
""")


@triton.jit
def _code_to_bf16_arith(code):
    """4-bit e2m1 code (int32) -> bf16, via fp32 bits: a magnitude code c >= 2 is 2^(e-1)(1+m/2),
    whose fp32 exponent/mantissa bits are (c + 252) << 22; c = 1 is 0.5 = 252 << 22; c = 0 is 0."""
    magnitude = code & 7
    top = tl.where(magnitude >= 2, magnitude + 252, magnitude * 252)
    bits = (top << 22) | ((code & 8) << 28)
    return bits.to(tl.uint32).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _e2m1_to_bf16_arith(packed):
    """Packed bytes -> (even-K values, odd-K values), bf16, one element at a time."""
    p = packed.to(tl.int32)
    return _code_to_bf16_arith(p & 0xF), _code_to_bf16_arith(p >> 4)


@triton.jit
def _decode_tile(packed_ptrs, scale_ptrs, row_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 INTERPRETER: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] weight tile, block scales applied (tensor scale not), as two
    [BLOCK_N, BLOCK_K/2] halves: even K and odd K (kept apart: interleaving them would cost a
    register shuffle per element; the caller splits x the same way instead). bf16 on the GPU,
    fp32 in the interpreter; rows outside row_mask ([BLOCK_N, 1]) read as 0."""
    packed = tl.load(packed_ptrs, mask=row_mask, other=0)
    scale = tl.load(scale_ptrs, mask=row_mask, other=0.0).to(tl.float32)
    if INTERPRETER:
        even, odd = _e2m1_to_bf16_arith(packed)
        # The interpreter's bf16 arithmetic is broken (Triton 3.9: bf16 * bf16 and bf16 tl.dot
        # return garbage): scale in fp32 there (same values).
        even, odd = even.to(tl.float32), odd.to(tl.float32)
        scale = scale[:, :, None]
    else:
        even, odd = tl.inline_asm_elementwise(
            _E2M1_TO_BF16_PTX, "=r,=r,=r,=r,r", [packed],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        # e2m1 * e4m3 is exact in bf16 (<= 5 significant bits, exponents well inside range).
        scale = scale.to(tl.bfloat16)[:, :, None]
    # 16 K elements per scale = 8 of each half.
    even = (even.reshape(BLOCK_N, BLOCK_K // 16, 8) * scale).reshape(BLOCK_N, BLOCK_K // 2)
    odd = (odd.reshape(BLOCK_N, BLOCK_K // 16, 8) * scale).reshape(BLOCK_N, BLOCK_K // 2)
    return even, odd


@triton.jit
def _weight_offsets(rows, cols, k0, K: tl.constexpr, PER_K: tl.constexpr, TILED: tl.constexpr):
    """[R, C] element offsets into a weight array of PER_K elements per row and 128 K (packed
    bytes 64, words 16, block scales 8): rows `rows`, columns `cols` counted from K position k0,
    in row-major or tiled storage (engine/formats/nvfp4.py; k0 a multiple of 128 there)."""
    if TILED:
        row_offs = (rows // 16) * (K // 128 * 16 * PER_K) + (rows % 16) * PER_K
        c = cols + k0 // 128 * PER_K
        return row_offs[:, None] + ((c // PER_K) * (16 * PER_K) + c % PER_K)[None, :]
    else:
        return rows[:, None] * (K * PER_K // 128) + (k0 * PER_K // 128 + cols)[None, :]


# dequantize_fp8 divides e2m1 * block_scale by this power of two: block scales are e4m3 (<= 448)
# and |e2m1| <= 6, so every product (<= 2,688) lands within e4m3's 448 once divided by 8, and a
# power of two adds no rounding of its own: the only loss is e4m3's mantissa (the product has up to
# 5 significant bits, e4m3 keeps 4) and its subnormals (products under 1/8).
FP8_SHIFT = tl.constexpr(8.0)


def _e2m1_to_e4m3_ptx() -> str:
    """PTX for one `_dequantize_fp8_kernel` call (pack=4): four packed bytes (8 codes; $2) and each
    byte's block scale / FP8_SHIFT in f16 ($3: bytes 0-1, $4: bytes 2-3) -> 8 e4m3 codes in K order,
    a byte's two per 16 bits ($0: bytes 0-1, $1: bytes 2-3). `prmt` looks the magnitudes' f16 high
    bytes up (0 0.5 1 1.5 2 3 4 6: 00 38 3C 3E 40 42 44 46; every low byte is 0) and places a byte's
    two codes as an f16x2 (even K low); the signs come in as in _E2M1_TO_BF16_PTX; the f16 product
    is exact (<= 5 significant bits, >= 2^-13) and `cvt` rounds it to e4m3 as torch does, so the
    codes equal `to_fp8`'s."""
    lines = ["{", ".reg .b32 lo, hi, sel, mag0, mag1, shifted, sgn, h, s;", ".reg .b16 q0, q1, q2, q3;",
             "mov.b32 lo, 0x3E3C3800;", "mov.b32 hi, 0x46444240;", "and.b32 sel, $2, 0x77777777;",
             "prmt.b32 mag0, lo, hi, sel;", "shr.b32 sel, sel, 16;", "prmt.b32 mag1, lo, hi, sel;",
             "shl.b32 shifted, $2, 4;"]
    for byte in range(4):
        odd = byte % 2
        lines += [f"prmt.b32 h, mag{byte // 2}, 0, {0x1404 + 0x2020 * odd:#x};",   # f16 high bytes at 15:8, 31:24
                  f"prmt.b32 sgn, shifted, $2, {0xC080 + 0x1010 * byte:#x};",    # the codes' sign bits, replicated
                  "lop3.b32 h, h, sgn, 0x80008000, 0xF8;",                        # h | (sgn & 0x80008000)
                  f"prmt.b32 s, {('$3', '$4')[byte // 2]}, 0, {0x1010 + 0x2222 * odd:#x};",  # the byte's scale, twice
                  "mul.rn.f16x2 h, h, s;",
                  f"cvt.rn.satfinite.e4m3x2.f16x2 q{byte}, h;"]
    return "\n".join(lines + ["mov.b32 $0, {q0, q1};", "mov.b32 $1, {q2, q3};", "}"])


_E2M1_TO_E4M3_PTX = tl.constexpr(_e2m1_to_e4m3_ptx())


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, tensor_scale_ptr, out_ptr, N, K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr,
                       TILED: tl.constexpr):
    """out = e2m1 * block_scale * tensor_scale, row-major, in out's dtype (`dequantize_bf16`)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_kh = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 16)
    offs_k = tl.arange(0, BLOCK_K)
    packed_ptrs = packed_ptr + _weight_offsets(offs_n, offs_kh, k0, K, 64, TILED)
    scale_ptrs = scale_ptr + _weight_offsets(offs_n, offs_ks, k0, K, 8, TILED)
    even, odd = _decode_tile(packed_ptrs, scale_ptrs, (offs_n < N)[:, None], BLOCK_N, BLOCK_K,
                             INTERPRETER)
    w = tl.join(even, odd).reshape(BLOCK_N, BLOCK_K)
    w = (w.to(tl.float32) * tl.load(tensor_scale_ptr)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_n[:, None] * K + (k0 + offs_k)[None, :], w, mask=(offs_n < N)[:, None])


@triton.jit
def _dequantize_fp8_kernel(packed_ptr, scale_ptr, tensor_scale_ptr, pairs_ptr, row_scale_ptr, N,
                           K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           INTERPRETER: tl.constexpr, TILED: tl.constexpr):
    """The FP8 rows of `dequantize_fp8`: e4m3(e2m1 * block_scale / FP8_SHIFT) written as uint16
    pairs [N, K/2] (a packed byte's two codes, even K in the low byte: the row-major e4m3 [N, K]
    itself, with no interleaving of even and odd K in registers), and row_scale[n] = tensor_scale *
    FP8_SHIFT."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_kh = tl.arange(0, BLOCK_K // 2)
    rows = (offs_n < N)[:, None]
    packed_ptrs = packed_ptr + _weight_offsets(offs_n, offs_kh, k0, K, 64, TILED)
    scale_ptrs = scale_ptr + _weight_offsets(offs_n, tl.arange(0, BLOCK_K // 16), k0, K, 8, TILED)
    if INTERPRETER:
        even, odd = _decode_tile(packed_ptrs, scale_ptrs, rows, BLOCK_N, BLOCK_K, INTERPRETER)
        even = quantize_e4m3(even, FP8_SHIFT, ROUND_IN_FP32=True).to(tl.uint8, bitcast=True)
        odd = quantize_e4m3(odd, FP8_SHIFT, ROUND_IN_FP32=True).to(tl.uint8, bitcast=True)
        pairs = even.to(tl.uint16) | (odd.to(tl.uint16) << 8)
    else:
        packed = tl.load(packed_ptrs, mask=rows, other=0)
        scale = tl.load(scale_ptrs, mask=rows, other=0.0).to(tl.float32)
        scale = (scale * (1.0 / FP8_SHIFT)).to(tl.float16)    # exact: e4m3 / 8 >= 2^-12
        # each packed byte's own scale (8 bytes share one)
        scale = tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)).reshape(BLOCK_N, BLOCK_K // 2)
        pairs = tl.inline_asm_elementwise(_E2M1_TO_E4M3_PTX, "=r,=r,r,r,r", [packed, scale],
                                          dtype=tl.uint16, is_pure=True, pack=4)
    tl.store(pairs_ptr + offs_n[:, None] * (K // 2) + (k0 // 2 + offs_kh)[None, :], pairs, mask=rows)
    if tl.program_id(1) == 0:
        tl.store(row_scale_ptr + offs_n, tl.zeros([BLOCK_N], tl.float32) + tl.load(tensor_scale_ptr) * FP8_SHIFT,
                 mask=offs_n < N)


# ------------------------------------------------------------------------------ decode, M <= 64

def _decode_ptx() -> str:
    """PTX for one `_small_m_kernel` decode call: 16 elements of the MMA's A fragment (pack=16).

    Element e = p + 2*r8 + 4*h + 8*b of a thread's fragment: p the lane of a bf16x2 register, r8
    the row 8 below, h the upper k8 half of a k16 MMA step, b the next k16 step. $0-$7 are the
    outputs (bf16x2, register j = r8 + 2h + 4b), $8-$23 each element's packed word, $24-$39 each
    element's scale pair (bf16x2 bits, scale x 2^118 twice); a row reads its word and scale from
    element 0 (row r8 = 1: element 2). Register (h, b) of a row takes nibbles (h + 2b, h + 2b + 4)
    of its word: mask the two nibbles (16 bits apart), multiply by 2^6 + 2^12 (nibbles at bit 0)
    or 2^2 + 2^8 (at bit 4) to put the magnitude on bits 8:6 and the sign on bit 15 of each half,
    mask again, multiply by the scale.
    """
    lines = ["{", ".reg .b32 t<5>;"]
    for word, scale, outs in (("$8", "$24", ("$0", "$2", "$4", "$6")),
                              ("$10", "$26", ("$1", "$3", "$5", "$7"))):
        for (src, mask, mul), out in zip(
                ((word, "0x000F000F", "0x1040"), (word, "0x00F000F0", "0x104"),
                 ("t4", "0x000F000F", "0x1040"), ("t4", "0x00F000F0", "0x104")), outs):
            if src == "t4" and mask == "0x000F000F":
                lines.append(f"shr.u32 t4, {word}, 8;")
            lines += [f"and.b32 t0, {src}, {mask};", f"mul.lo.u32 t0, t0, {mul};",
                      "and.b32 t0, t0, 0x81C081C0;", f"mul.rn.bf16x2 {out}, t0, {scale};"]
    return "\n".join(lines + ["}"])


_DECODE_PTX = tl.constexpr(_decode_ptx())
_DECODE_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 32))
# Two e4m3 block scales -> two bf16x2 words (s x 2^118, twice): exact (e4m3 -> f16 -> f32 are
# exact, x 2^118 is a power of two and the 4 significant bits fit bf16's 8).
_SCALE_PTX = tl.constexpr("""
{
.reg .b32 h2, f0, f1;
.reg .b16 lo, hi;
cvt.rn.f16x2.e4m3x2 h2, $2;
mov.b32 {lo, hi}, h2;
cvt.f32.f16 f0, lo;
cvt.f32.f16 f1, hi;
mul.f32 f0, f0, 0f7A800000;
mul.f32 f1, f1, 0f7A800000;
cvt.rn.bf16x2.f32 $0, f0, f0;
cvt.rn.bf16x2.f32 $1, f1, f1;
}
""")


@triton.jit
def _logical_k(t, ROWS: tl.constexpr, CHUNKS: tl.constexpr, WPT: tl.constexpr):
    """[ROWS, BLOCK_K] in physical K order -> the logical order the kernel multiplies in.

    Physical K inside a chunk of 32 * WPT: (q, c, p, b, h) = 8*WPT*q + 8*c + 4*p + 2*b + h, i.e.
    word q*WPT + c of the chunk, nibble h + 2b + 4p; logical: (c, b, h, q, p) = 32c + 16b + 8h +
    2q + p, where q is the thread (lane % 4) that holds it in the MMA fragment."""
    t = t.reshape(ROWS, CHUNKS, 4, WPT, 2, 2, 2)
    return tl.permute(t, (0, 1, 3, 5, 6, 2, 4)).reshape(ROWS, CHUNKS * WPT * 32)


@triton.jit
def _words_per_element(words, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, WPT: tl.constexpr):
    """Packed words [BLOCK_N, BLOCK_K/8] -> [BLOCK_N, BLOCK_K]: each logical element's word."""
    w = tl.permute(words.reshape(BLOCK_N, CHUNKS, 4, WPT), (0, 1, 3, 2))
    w = tl.broadcast_to(w.reshape(BLOCK_N, CHUNKS, WPT, 1, 4, 1), (BLOCK_N, CHUNKS, WPT, 4, 4, 2))
    return w.reshape(BLOCK_N, CHUNKS * WPT * 32)


@triton.jit
def _scales_per_element(s, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, WPT: tl.constexpr):
    """Block scales [BLOCK_N, BLOCK_K/16] -> [BLOCK_N, BLOCK_K]: each logical element's scale
    (16 physical K per scale: word q*WPT + c of a chunk has scale (q*WPT + c) // 2)."""
    if WPT == 1:
        s = tl.broadcast_to(s.reshape(BLOCK_N, CHUNKS, 1, 1, 2, 1, 1),
                            (BLOCK_N, CHUNKS, 1, 4, 2, 2, 2))
    elif WPT == 2:
        s = tl.broadcast_to(s.reshape(BLOCK_N, CHUNKS, 1, 1, 4, 1),
                            (BLOCK_N, CHUNKS, 2, 4, 4, 2))
    else:
        s = tl.permute(s.reshape(BLOCK_N, CHUNKS, 4, WPT // 2), (0, 1, 3, 2))
        s = tl.broadcast_to(s.reshape(BLOCK_N, CHUNKS, WPT // 2, 1, 1, 4, 1),
                            (BLOCK_N, CHUNKS, WPT // 2, 2, 4, 4, 2))
    return s.reshape(BLOCK_N, CHUNKS * WPT * 32)


@triton.jit
def _decode_words_arith(words, scale, BLOCK_K: tl.constexpr):
    """The interpreter's version of _DECODE_PTX: element k' of a row is nibble h + 2b + 4p of its
    word (see _logical_k), times its block scale, in fp32 (no 2^-126 / 2^118 factors)."""
    kk = tl.arange(0, BLOCK_K)
    nibble = ((kk >> 3) & 1) + 2 * ((kk >> 4) & 1) + 4 * (kk & 1)
    code = (words >> (4 * nibble)[None, :]) & 0xF
    return _code_to_bf16_arith(code).to(tl.float32) * scale


@triton.jit(do_not_specialize=["M"])  # one binary for every decode batch size
def _small_m_kernel(
    x_ptr, words_ptr, scale_ptr, tensor_scale_ptr, out_ptr, acc_ptr, count_ptr,
    M, N, stride_xm, stride_om, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WPT: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_PTX: tl.constexpr, INTERPRETER: tl.constexpr, TILED: tl.constexpr,
):
    """y[M, N] = x @ W^T for M <= BLOCK_M: acc^T [BLOCK_N, BLOCK_M] = W_tile @ x_tile^T, both in
    the logical K order of _logical_k. With SPLIT_K > 1 the programs of a tile add into acc_ptr
    (fp32 [M, N], zero on entry) and the last one writes y and zeroes acc_ptr and its counter.
    USE_PTX is only correct where the decode's result has the MMA operand layout
    (_ptx_decode_layout_ok checks the compiled kernel); elsewhere the arithmetic decode runs."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    CHUNKS: tl.constexpr = BLOCK_K // (32 * WPT)
    K_SPLIT: tl.constexpr = K // SPLIT_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = (offs_n < N)[:, None]
    m_mask = (offs_m < M)[:, None]
    k0 = pid_k * K_SPLIT
    # K is a compile-time multiple of BLOCK_K: word rows (K/8 ints) and scale rows (K/16 bytes)
    # are then known 16-byte multiples, so every weight load is a 16-byte vector.
    words_ptrs = words_ptr + _weight_offsets(offs_n, tl.arange(0, BLOCK_K // 8), k0, K, 16, TILED)
    scale_ptrs = scale_ptr + _weight_offsets(offs_n, tl.arange(0, BLOCK_K // 16), k0, K, 8, TILED)
    # Tiled, the next BLOCK_K of a row lies past the other 15 rows of its tiles.
    ROWS_PER_STEP: tl.constexpr = 16 if TILED else 1
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k0 + tl.arange(0, BLOCK_K))[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        # Rows past N read as 0 and are never stored, so tail tiles need no padding.
        words = tl.load(words_ptrs, mask=n_mask, other=0)
        scale = tl.load(scale_ptrs, mask=n_mask, other=0)
        x = _logical_k(tl.load(x_ptrs, mask=m_mask, other=0.0), BLOCK_M, CHUNKS, WPT)
        if USE_PTX:
            scale = tl.inline_asm_elementwise(_SCALE_PTX, "=r,=r,h", [scale], dtype=tl.int32,
                                              is_pure=True, pack=2)
            w = tl.inline_asm_elementwise(
                _DECODE_PTX, _DECODE_CONSTRAINTS,
                [_words_per_element(words, BLOCK_N, CHUNKS, WPT),
                 _scales_per_element(scale, BLOCK_N, CHUNKS, WPT)],
                dtype=tl.bfloat16, is_pure=True, pack=16)
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            scale = scale.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            w = _decode_words_arith(_words_per_element(words, BLOCK_N, CHUNKS, WPT),
                                    _scales_per_element(scale, BLOCK_N, CHUNKS, WPT), BLOCK_K)
            if INTERPRETER:
                # fp32 dot: the interpreter's bf16 dot is wrong (Triton 3.9); same values.
                acc = tl.dot(w, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:  # e2m1 x e4m3 is exact in bf16
                acc = tl.dot(w.to(tl.bfloat16), tl.trans(x), acc)
        words_ptrs += ROWS_PER_STEP * (BLOCK_K // 8)
        scale_ptrs += ROWS_PER_STEP * (BLOCK_K // 16)
        x_ptrs += BLOCK_K

    # The PTX decode leaves every product scaled by 2^-8 (see _decode_ptx).
    scale_out = tl.load(tensor_scale_ptr) * (256.0 if USE_PTX else 1.0)
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = (offs_m[None, :] < M) & n_mask
    if SPLIT_K == 1:
        tl.store(out_ptrs, (acc * scale_out).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc_ptrs = acc_ptr + offs_m[None, :] * N + offs_n[:, None]
        if split_k_arrive(acc, acc_ptrs, mask, count_ptr + pid_n, SPLIT_K):
            total = split_k_take(acc_ptrs, mask, count_ptr + pid_n)
            tl.store(out_ptrs, (total * scale_out).to(out_ptr.dtype.element_ty), mask=mask)


MAX_M = 128  # the decode kernel's range


def small_m_config(m: int, n: int, k: int, sm_count: int, block_n: int | None = None,
                   block_k: int | None = None, words_per_thread: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None,
                   split_k: int | None = None, maxnreg: int | None = None) -> dict:
    """Tile shape, split-K and launch parameters of the decode kernel (keyword overrides for the
    benchmark's sweep; `maxnreg` caps registers per thread, a Triton compile option).

    Tokens: one tile of BLOCK_M = 16, 32, 64 or 128 (the smallest that holds M), the WGMMA's N.
    M <= 16: 128-row tiles, 256 K deep, 4 words (16 bytes) per thread and row, 3 stages; K is split
    until there are 1.5 programs per SM, as long as each program keeps at least 4 K steps; where
    that leaves too few steps (a short, shallow layer), 128 deep, 4 stages. More programs per SM do
    not pay here: the kernel holds ~240 registers, and capping them spills.
    16 < M <= 64: 128-row tiles, 128 K deep, 8 warps, 4 stages, split as at M <= 16.
    64 < M <= 128: one wave of programs, each at least 8 K steps deep: 256-row tiles (3 stages;
    each x tile then serves twice the rows) where those give 0.7 programs per SM or more, else
    128-row tiles (4 stages); K split while there are at most 1.25 programs per SM.
    These are the fastest configurations of bench_nvfp4.py --sweep on the Llama-3.1-8B shapes, or
    close to them (one rule for all four).
    """
    if m > MAX_M:
        raise ValueError(f"the decode kernel takes M <= {MAX_M}, got {m}")
    block_m = 16 if m <= 16 else triton.next_power_of_2(m)

    def split_for(bn, bk, one_wave=False):
        """K split of bn-row tiles, doubled while the programs are fewer than 1.5 per SM (one_wave:
        while doubled they stay at most 1.25 per SM) and each keeps 4 (one_wave: 8) steps of bk."""
        tiles, split = triton.cdiv(n, bn), 1
        while ((tiles * split * 2 <= 1.25 * sm_count if one_wave else tiles * split < 1.5 * sm_count)
               and k % (2 * split * bk) == 0 and k // (2 * split) >= (8 if one_wave else 4) * bk):
            split *= 2
        return split

    warps = 4
    if block_n is None and block_k is None and block_m > 64 and k % 128 == 0:
        for block_n in (256, 128):
            wave_split = split_for(block_n, 128, one_wave=True)
            if triton.cdiv(n, block_n) * wave_split >= 0.7 * sm_count:
                break
        block_k, stages, warps = 128, 3 if block_n == 256 else 4, 8
        split_k = wave_split if split_k is None else split_k
    elif block_n is None and block_k is None and block_m > 16:
        block_n, block_k, stages, warps = 128, 128, 4, 8
    elif block_n is None and block_k is None:
        block_n, block_k, stages = 128, 256, 3
        if k % 128:  # e.g. K = 576: 64 deep (64-row tiles there decode in the wrong layout)
            block_k, stages = 64, 4
        elif k % block_k or triton.cdiv(n, 128) * split_for(128, 256) < 1.5 * sm_count:
            block_k, stages = 128, 4
    else:
        block_n, block_k, stages = block_n or 64, block_k or 256, 4
    while k % block_k:
        block_k //= 2
    wpt = min(words_per_thread or 4, block_k // 32)
    if block_k < 32 * wpt:
        raise ValueError(f"K={k} needs a multiple of {32 * wpt}")
    if split_k is None:
        split_k = split_for(block_n, block_k)
    if k % (split_k * block_k):
        raise ValueError(f"SPLIT_K={split_k} x BLOCK_K={block_k} does not divide K={k}")
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "WPT": wpt,
           "SPLIT_K": split_k, "num_warps": num_warps or warps, "num_stages": num_stages or stages}
    if maxnreg:
        cfg["maxnreg"] = maxnreg
    return cfg


# (config, K, output dtype) -> whether the compiled PTX-decode kernel has the layout it needs.
_PTX_LAYOUT_OK: dict = {}


def _ptx_decode_layout_ok(args: tuple, grid: tuple, cfg: dict, k: int, out_dtype) -> bool:
    """Whether Triton gave the PTX decode's result the MMA's A-operand layout (bf16 pairs,
    kWidth 2), the register order _decode_ptx is written for. Triton chooses layouts itself: in
    most configurations it propagates the dot operand's layout back through the decode to the
    loads, but in some (seen with 64-row, 64-deep tiles at K = 576) it decodes in another layout
    and converts afterwards, where the PTX would pair the wrong elements. Checked once per
    configuration on the compiled kernel, before its first launch."""
    key = (tuple(sorted(cfg.items())), k, out_dtype)
    if key not in _PTX_LAYOUT_OK:
        compiled = _small_m_kernel.warmup(*args, grid=grid, K=k, USE_PTX=True, INTERPRETER=False, **cfg)
        ok = False
        for line in compiled.asm["ttgir"].splitlines():
            if "elementwise_inline_asm" in line and "mul.rn.bf16x2" in line:
                result = line.rsplit("->", 1)[-1]
                ok = "dot_op<{opIdx = 0" in result and "kWidth = 2" in result
        _PTX_LAYOUT_OK[key] = ok
    return _PTX_LAYOUT_OK[key]


def decode_gemm(x: torch.Tensor, w, out: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """out[M, N] = x[M, K] @ W^T for M <= 128 (the module docstring's decode kernel)."""
    m, k = x.shape
    n = w.shape[0]
    cfg = dict(config or small_m_config(m, n, k, sm_count(x.device)), TILED=w.tiled)
    _check_tiled_depth(w, cfg["BLOCK_K"])
    split = cfg["SPLIT_K"]
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    acc, count = split_k_buffers(x.device, m * n, tiles) if split > 1 else (out, out)
    args = (x, w.packed.view(torch.int32), w.block_scale.view(torch.uint8), w.tensor_scale, out,
            acc, count, m, n, x.stride(0), out.stride(0))
    grid = (tiles, split)
    use_ptx = not interpreting() and _ptx_decode_layout_ok(args, grid, cfg, k, out.dtype)
    _small_m_kernel[grid](*args, K=k, USE_PTX=use_ptx, INTERPRETER=interpreting(), **cfg)
    return out


def _check_tiled_depth(w, block_k: int) -> None:
    """A tiled weight is read 128 K (one tile) at a time or in multiples of it."""
    if w.tiled and block_k % 128:
        raise ValueError(f"a tiled NVFP4 weight needs BLOCK_K a multiple of 128, got {block_k}")


def dequantize_bf16(w, dtype: torch.dtype = torch.bfloat16,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense [N, K] weight, decoded on the device (into `out` if given)."""
    n, k = w.shape
    block_n, block_k = 64, _block_k(w)
    if out is None:
        out = torch.empty(n, k, device=w.packed.device, dtype=dtype)
    _dequantize_kernel[(triton.cdiv(n, block_n), k // block_k)](
        w.packed, w.block_scale, w.tensor_scale, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
        INTERPRETER=interpreting(), TILED=w.tiled, num_warps=4)
    return out


def dequantize_fp8(w, out: torch.Tensor | None = None,
                   row_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight as FP8 rows, decoded on the device: (q [N, K] float8_e4m3fn, scale [N] fp32),
    w ~= q * scale[:, None] (engine/formats/nvfp4.py `to_fp8`), into out / row_scale if given."""
    n, k = w.shape
    block_n, block_k = 32, _block_k(w)
    device = w.packed.device
    out = torch.empty(n, k, device=device, dtype=torch.float8_e4m3fn) if out is None else out
    row_scale = torch.empty(n, device=device, dtype=torch.float32) if row_scale is None else row_scale
    _dequantize_fp8_kernel[(triton.cdiv(n, block_n), k // block_k)](
        w.packed, w.block_scale, w.tensor_scale, out.view(torch.uint16), row_scale, n, k,
        BLOCK_N=block_n, BLOCK_K=block_k, INTERPRETER=interpreting(), TILED=w.tiled, num_warps=4)
    return out, row_scale


def _block_k(w) -> int:
    """K per program of the dequantise kernels: 256 where it divides K, else what the storage
    allows (tiles are 128 deep); K must be a multiple of 64."""
    k = w.shape[1]
    if k % 64:
        raise ValueError(f"K={k} must be a multiple of 64")
    return 256 if k % 256 == 0 else 128 if w.tiled else 64


_SCRATCH: dict = {}


def _scratch(device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """One buffer per (device, dtype), grown to the largest request and reused: a decoded weight
    lives only until its GEMM has read it (recompute instead of store), and a fresh [N, K]
    allocation per GEMM (235 MB of bf16 for an 8B model's gate/up) made the caching allocator free
    and re-reserve memory when the KV cache left little room. The engine runs its GEMMs on one
    stream, so the next decode into the buffer waits for the last reader."""
    buf = _SCRATCH.get((device, dtype))
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop((device, dtype), None)
        del buf  # the outgrown buffer goes back to the allocator before the larger one is taken
        buf = _SCRATCH[(device, dtype)] = torch.empty(numel, device=device, dtype=dtype)
    return buf[:numel]


def dequantize_scratch(w) -> torch.Tensor:
    """dequantize_bf16 into the device's reused bf16 buffer (`_scratch`)."""
    n, k = w.shape
    return dequantize_bf16(w, out=_scratch(w.packed.device, torch.bfloat16, n * k).view(n, k))


def dequantize_fp8_scratch(w) -> tuple[torch.Tensor, torch.Tensor]:
    """dequantize_fp8 into the device's reused FP8 and row-scale buffers (`_scratch`)."""
    n, k = w.shape
    device = w.packed.device
    return dequantize_fp8(w, _scratch(device, torch.float8_e4m3fn, n * k).view(n, k),
                          _scratch(device, torch.float32, n))
