"""NVFP4 weights on Hopper (no FP4 tensor cores): Triton kernels that decode e2m1 in registers.

`nvfp4_matmul(x, w)`: y = x @ W^T for bf16 activations and an NVFP4 weight. Each program streams a
[BLOCK_N, BLOCK_K] weight tile as packed bytes plus its e4m3 block scales, decodes it in registers
to bf16 (exactly: e2m1 * e4m3 has at most 5 significant bits), and feeds it to the tensor cores
(mma.sync at BLOCK_M = 16, WGMMA from 64 rows) against a [BLOCK_M, BLOCK_K] activation tile; the
fp32 tensor scale is applied once, in the epilogue. For decode (M <= 16) the weight bytes are the
whole cost, so the grid is split along K until every SM has work (fp32 atomics into a zeroed
buffer, then one cast). Even and odd K stay in separate halves (two dots, x split the same way):
interleaving them back cost a register shuffle per element.

The decode is the inner loop's critical path (one weight byte feeds only 2*M FLOPs), so on the GPU
it is a few PTX instructions per 8 elements (`prmt` table lookups, see _E2M1_TO_BF16_PTX) instead
of per-element integer arithmetic. It is still what limits decode: about 6.5 SASS instructions
per weight element in the loop (the lookups, sign merge, bf16x2 scale multiply, table constants)
and 2 CTAs per SM at ~190 registers; measured on an H200 at M = 1 the kernel moves 0.9-1.5 TB/s,
22-35% of the 4.2 TB/s copy bandwidth, where bf16 cuBLAS streams 2.9-4.1 TB/s: NVFP4 stores the
weights in 3.5x less memory but runs decode only 0.9-1.3x as fast as bf16 (BENCHMARKS.md).

The interpreter (TRITON_INTERPRET=1) cannot run inline PTX; it uses the arithmetic decode
`_e2m1_to_bf16_arith`, which the tests check against the reference, and the GPU tests check the
PTX decode against the same reference.

`dequantize_bf16(w)`: the whole weight decoded to a bf16 matrix (for large M, where dequantise +
cuBLAS beats the fused kernel, and for quality reports).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.kernels.nvfp4 import Nvfp4Tensor, nvfp4_linear_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# One `prmt` looks 4 bytes up in an 8-byte table indexed by 3-bit codes (the sign masked off):
# one table holds the high bytes of the bf16 encodings of e2m1's 8 magnitudes
# (0, .5, 1, 1.5, 2, 3, 4, 6 = 0x0000 3F00 3F80 3FC0 4000 4040 4080 40C0), one the low bytes.
# A second `prmt` interleaves low and high bytes into bf16x2 words. The sign comes from `prmt`'s
# sign-replicate mode (selector bit 3): it copies the top bit of a chosen byte over a whole byte;
# a nibble's sign bit is the top bit of a byte either of the packed word (odd K) or of the word
# shifted left by 4 (even K); `lop3` ORs that bit into the bf16 sign (a | (b & c) = 0xF8).
# $4 holds 4 packed bytes = 8 codes, K = 0..7; $0, $1 get K = (0, 2), (4, 6);
# $2, $3 get (1, 3), (5, 7).
_E2M1_TO_BF16_PTX = tl.constexpr("""
{
.reg .b32 hi_a, hi_b, lo_a, lo_b, sel0, sel1, h0, l0, h1, l1, shifted, sgn;
mov.b32 hi_a, 0x3F3F3F00;
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
prmt.b32 $0, l0, h0, 0x6240;
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
def _nvfp4_matmul_kernel(
    x_ptr, packed_ptr, scale_ptr, tensor_scale_ptr, out_ptr,
    M, N, stride_xm, stride_om, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, INTERPRETER: tl.constexpr,
):
    # K is a compile-time constant (a model has two or three): row strides K/2 and K/16 are then
    # known multiples of 16 bytes, so weight and scale loads are 16-byte vectors.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kh = tl.arange(0, BLOCK_K // 2)          # packed bytes
    offs_ks = tl.arange(0, BLOCK_K // 16)         # block scales
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N

    k_per_split = K // SPLIT_K
    k_start = pid_k * k_per_split
    packed_ptrs = packed_ptr + offs_n[:, None] * (K // 2) + (k_start // 2 + offs_kh)[None, :]
    scale_ptrs = scale_ptr + offs_n[:, None] * (K // 16) + (k_start // 16 + offs_ks)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        # Weight rows past N read as 0 and are never stored, so tail tiles need no padding.
        w_even, w_odd = _decode_tile(packed_ptrs, scale_ptrs, n_mask[:, None], BLOCK_N, BLOCK_K,
                                     INTERPRETER)
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        x_even, x_odd = tl.split(x.reshape(BLOCK_M, BLOCK_K // 2, 2))
        if INTERPRETER:
            acc = tl.dot(x_even.to(tl.float32), tl.trans(w_even), acc, input_precision="ieee")
            acc = tl.dot(x_odd.to(tl.float32), tl.trans(w_odd), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_even, tl.trans(w_even), acc)
            acc = tl.dot(x_odd, tl.trans(w_odd), acc)
        packed_ptrs += BLOCK_K // 2
        scale_ptrs += BLOCK_K // 16
        x_ptrs += BLOCK_K

    acc = acc * tl.load(tensor_scale_ptr)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, tensor_scale_ptr, out_ptr, N, K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETER: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_kh = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 16)
    offs_k = tl.arange(0, BLOCK_K)
    packed_ptrs = packed_ptr + offs_n[:, None] * (K // 2) + (k0 // 2 + offs_kh)[None, :]
    scale_ptrs = scale_ptr + offs_n[:, None] * (K // 16) + (k0 // 16 + offs_ks)[None, :]
    even, odd = _decode_tile(packed_ptrs, scale_ptrs, (offs_n < N)[:, None], BLOCK_N, BLOCK_K,
                             INTERPRETER)
    w = tl.join(even, odd).reshape(BLOCK_N, BLOCK_K)
    w = (w.to(tl.float32) * tl.load(tensor_scale_ptr)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_n[:, None] * K + (k0 + offs_k)[None, :], w, mask=(offs_n < N)[:, None])


def _sm_count(device) -> int:
    if INTERPRET or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def matmul_config(m: int, n: int, k: int, sm_count: int, block_n: int | None = None,
                  block_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, split_k: int | None = None) -> dict:
    """Tile shape, split-K and launch parameters (keyword overrides for benchmark sweeps).

    BLOCK_M is the smallest MMA-friendly size that holds M (16 up to 128). A program decodes a
    [BLOCK_N, BLOCK_K] weight tile per step: 64 x 128 (4 KiB packed), 128-row tiles once M is
    large enough to fill the GPU with them. K is split (fp32 atomics) until the grid has 4 (M <=
    16) or 2 programs per SM, at most 8 ways: an 8B model's 4096 x 14336 down projection has only
    64 weight tiles of 64 rows for 132 SMs. These defaults were the fastest or within 6% of the
    fastest of the configurations swept on an H200 (BENCHMARKS.md, bench_nvfp4.py --sweep).
    """
    block_m = 16 if m <= 16 else min(128, triton.next_power_of_2(m))
    if block_n is None:
        block_n = 128 if m > 256 else 64
    if block_k is None:
        block_k = 128
    while k % block_k:
        block_k //= 2
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    steps = k // block_k
    if split_k is None:
        target = (4 if m <= 16 else 2) * sm_count
        split_k = 1
        while (tiles * split_k < target and split_k < 8 and steps % (2 * split_k) == 0
               and steps >= 4 * split_k):
            split_k *= 2
    if steps % split_k:
        raise ValueError(f"SPLIT_K={split_k} does not divide {steps} K steps")
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                num_warps=num_warps or (8 if block_m == 128 else 4),
                num_stages=num_stages or (4 if m <= 16 else 3))


def supported(x: torch.Tensor, w: Nvfp4Tensor) -> bool:
    """The kernels need K a multiple of 64 (32-byte packed rows) and a unit-stride x row."""
    return w.shape[1] % 64 == 0 and x.dim() == 2 and x.stride(1) == 1 and x.dtype in (
        torch.bfloat16, torch.float16)


def nvfp4_matmul(x: torch.Tensor, w: Nvfp4Tensor, out_dtype: torch.dtype = torch.bfloat16,
                 config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[M, N] = x[M, K] @ W^T, W in NVFP4, fp32 accumulation; written into `out` if given."""
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    if not supported(x, w):
        return out.copy_(nvfp4_linear_reference(x, w, out.dtype))
    if x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    cfg = dict(config or matmul_config(m, n, k, _sm_count(x.device)))
    split = cfg.pop("SPLIT_K")
    # Split-K partial sums meet in an fp32 buffer (atomics), cast once at the end.
    target = out if split == 1 else torch.zeros(m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    _nvfp4_matmul_kernel[grid](
        x, w.packed, w.block_scale, w.tensor_scale, target, m, n, x.stride(0), target.stride(0),
        K=k, SPLIT_K=split, INTERPRETER=INTERPRET, **cfg)
    return out if split == 1 else out.copy_(target)


def dequantize_bf16(w: Nvfp4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The dense [N, K] weight, decoded on the device."""
    n, k = w.shape
    if k % 64:
        raise ValueError(f"K={k} must be a multiple of 64")
    out = torch.empty(n, k, device=w.packed.device, dtype=dtype)
    block_n, block_k = 64, 64 if k % 256 else 256
    _dequantize_kernel[(triton.cdiv(n, block_n), k // block_k)](
        w.packed, w.block_scale, w.tensor_scale, out, n, k,
        BLOCK_N=block_n, BLOCK_K=block_k, INTERPRETER=INTERPRET, num_warps=4)
    return out

