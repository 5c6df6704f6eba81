"""FP8 (e4m3) Triton kernels: per-row activation quantisation and the small-M weight-streaming GEMM.

Format (engine/formats/fp8.py): e4m3 weights with one fp32 scale per output channel, e4m3
activations with one fp32 scale per token; y[m, n] = sum_k qx[m, k] qw[n, k] * x_scale[m] *
w_scale[n] (+ residual[m, n]), fp32 accumulation, bf16 out.

`fp8_gemm_small_m` (M <= 16, N % 16 == 0, K % 64 == 0): decode is bound by reading the weight once,
so the weight tile is the A operand of an e4m3 x e4m3 WGMMA read straight from shared memory (no
conversion instruction per weight byte), 64-row tiles; K is split only when N gives fewer than half a
tile per SM, and the split's partial sums are reduced in the same launch (engine/kernels/split_k.py).
Launch parameters: `small_m_config`, the one table of this kernel's tuning constants.

`quantize_rows_triton(x)`: one pass per row, amax then scale and convert (the second read hits L1/L2).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from engine.kernels.platform import activation_empty, interpreting, sm_count_or_default

SMALL_M = 16


@functools.cache
def _triton_kernels():
    """Compiled lazily so that importing this module needs neither Triton nor a GPU."""
    import triton
    import triton.language as tl

    # Module globals, not locals: Triton (its interpreter too) looks a kernel's callees up there.
    global e4m3_scale, split_k_arrive, split_k_take
    from engine.kernels.norms import e4m3_scale
    from engine.kernels.split_k import split_k_arrive, split_k_take

    @triton.jit
    def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, BLOCK_K: tl.constexpr):
        # One program per row: pass 1 finds amax, pass 2 (an L1/L2 hit) scales and converts.
        row = tl.program_id(0).to(tl.int64)
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = e4m3_scale(tl.max(amax, axis=0))
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0)  # IEEE division, as the reference
            tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=offs < K)

    # M is not specialised: one binary for every decode batch size.
    @triton.jit(do_not_specialize=["M"])
    def stream_kernel(qx_ptr, xs_ptr, qw_ptr, ws_ptr, res_ptr, out_ptr, acc_ptr, count_ptr, M, N,
                      K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLIT_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      FP8_DOT: tl.constexpr):
        # acc[BLOCK_N, BLOCK_M] = W_tile @ X_tile^T: the weight rows sit on the MMA's M side, so
        # the weight tile is the A operand even for one token. FP8_DOT: e4m3 x e4m3 WGMMA straight
        # from shared memory (no conversion instructions at all), each BLOCK_K-deep product added
        # into an fp32 sum (Hopper's fp8 MMA accumulates at reduced precision within one); else
        # both operands widened to fp16 (exact) for an fp16 MMA.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        K_SPLIT: tl.constexpr = K // SPLIT_K
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
        w_ptrs = qw_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        x_ptrs = qx_ptr + offs_m[:, None] * K + offs_k[None, :]
        m_mask = offs_m[:, None] < M
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for _ in range(0, K_SPLIT, BLOCK_K):
            w = tl.load(w_ptrs)
            xt = tl.trans(tl.load(x_ptrs, mask=m_mask, other=0.0))
            if FP8_DOT:
                acc += tl.dot(w, xt)
            else:
                acc = tl.dot(w.to(tl.float16), xt.to(tl.float16), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out_offs = offs_m[None, :] * N + offs_n[:, None]
        mask = offs_m[None, :] < M
        if SPLIT_K > 1:
            if split_k_arrive(acc, acc_ptr + out_offs, mask, count_ptr + pid_n, SPLIT_K):
                acc = split_k_take(acc_ptr + out_offs, mask, count_ptr + pid_n)
                y = acc * tl.load(ws_ptr + offs_n)[:, None] * tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)[None, :]
                if HAS_RESIDUAL:
                    y += tl.load(res_ptr + out_offs, mask=mask).to(tl.float32)
                tl.store(out_ptr + out_offs, y.to(tl.bfloat16), mask=mask)
        else:
            y = acc * tl.load(ws_ptr + offs_n)[:, None] * tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)[None, :]
            if HAS_RESIDUAL:
                y += tl.load(res_ptr + out_offs, mask=mask).to(tl.float32)
            tl.store(out_ptr + out_offs, y.to(tl.bfloat16), mask=mask)

    return quantize_rows_kernel, stream_kernel


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    quantize_rows_kernel = _triton_kernels()[0]
    m, k = x.shape
    q = activation_empty(m, k, torch.float8_e4m3fn, x.device)     # whole GEMM tiles of rows
    scale = torch.empty(m, device=x.device, dtype=torch.float32)
    quantize_rows_kernel[(m,)](x, q, scale, k, BLOCK_K=min(4096, 1 << (k - 1).bit_length()),
                               num_warps=8)
    return q, scale


def small_m_config(n: int, k: int, num_sms: int) -> dict:
    """Launch parameters of the weight-streaming kernel: 64-row tiles 256 deep (one 16 KB weight
    stage), 6 stages when there are fewer than 2 tiles per SM (deeper pipelines beat more programs
    on short layers) else 4. K is split (at most down to 2048 per program) only when N gives fewer
    than half a tile per SM, until there are 2 programs per SM: a split costs a reduction, which
    pays only on narrow, deep weights (the down projection)."""
    block_n = next((b for b in (64, 32, 16) if n % b == 0), 16)
    block_k = next(b for b in (256, 128, 64) if k % b == 0)
    tiles, split = n // block_n, 1
    if tiles < num_sms / 2:
        while tiles * split < 2 * num_sms and k % (2 * split * block_k) == 0 and k // (2 * split) >= 2048:
            split *= 2
    stages = 6 if split == 1 and tiles < 2 * num_sms else 4
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": 4,
            "num_stages": stages}


def fp8_gemm_small_m(qx, x_scale, qw, w_scale, residual=None, split: int | None = None,
                     out: torch.Tensor | None = None, config: dict | None = None):
    """bf16 [M, N] for M <= 16 on CUDA: weight streaming, one launch (grid: N tiles x K splits;
    split-K partial sums meet in engine/kernels/split_k.py's accumulator).

    split overrides the automatic K split (tests cover several), config the whole launch
    (small_m_config's keys, for the benchmark's sweep); out is written in place if given.
    """
    from engine.kernels.split_k import split_k_buffers
    stream_kernel = _triton_kernels()[1]
    m, k = qx.shape
    n = qw.shape[0]
    if m > SMALL_M or n % 16 or k % 64:
        raise ValueError(f"small-M kernel takes M <= {SMALL_M}, N % 16 == 0, K % 64 == 0; "
                         f"got M={m}, N={n}, K={k}")
    num_sms = sm_count_or_default(qx.device)
    cfg = dict(config or small_m_config(n, k, num_sms))
    split = split or cfg.pop("SPLIT_K")
    cfg.pop("SPLIT_K", None)
    if k % (split * cfg["BLOCK_K"]):
        raise ValueError(f"split {split} must divide K={k} into multiples of {cfg['BLOCK_K']}")
    if out is None:
        out = torch.empty(m, n, device=qx.device, dtype=torch.bfloat16)
    tiles = n // cfg["BLOCK_N"]
    acc, count = split_k_buffers(qx.device, m * n, tiles) if split > 1 else (out, out)
    res = residual.contiguous() if residual is not None else out
    stream_kernel[(tiles, split)](
        qx.contiguous(), x_scale.float().contiguous(), qw.contiguous(), w_scale.float().contiguous(),
        res, out, acc, count, m, n, K=k, HAS_RESIDUAL=residual is not None, SPLIT_K=split,
        BLOCK_M=16, FP8_DOT=qx.is_cuda and not interpreting(), **cfg)
    return out


@torch.library.custom_op("microengine::fp8_gemm_small_m", mutates_args=(), device_types="cuda")
def fp8_gemm_small_m_op(qx: torch.Tensor, x_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                        residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    return fp8_gemm_small_m(qx, x_scale, qw, w_scale, residual)


@fp8_gemm_small_m_op.register_fake
def _(qx, x_scale, qw, w_scale, residual=None):
    return qx.new_empty((qx.shape[0], qw.shape[0]), dtype=torch.bfloat16)
