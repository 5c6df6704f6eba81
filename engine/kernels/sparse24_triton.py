"""Triton kernels for 2:4-sparse linears: decode GEMMs that stream the compressed weight, and a
one-pass per-token FP8 quantizer for the activations of the sparse-tensor-core prefill path.

Compressed format (see sparse24.py): for W [N, K], `values` [N, K/2] holds the two kept entries of
each group of 4 along K, in ascending position order; `meta` [N, K/8] uint8 holds one nibble per
group (low nibble = even group), nibble = i0 | i1 << 2 with i0 < i1 the kept positions.

The weight bytes streamed from HBM are the kept values plus 4 bits per group: 56% of dense bf16
(31% with e4m3 values). Three ways to multiply, all tuned against each other per shape:
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
