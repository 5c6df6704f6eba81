"""FP8 (e4m3) Triton kernels: per-row activation quantisation and the small-M weight-streaming GEMM's
FP8 entry point.

Format (engine/formats/fp8.py): e4m3 weights with one fp32 scale per output channel, e4m3
activations with one fp32 scale per token; y[m, n] = sum_k qx[m, k] qw[n, k] * x_scale[m] *
w_scale[n] (+ residual[m, n]), fp32 accumulation, bf16 out.

`fp8_gemm_small_m` (M <= 16, K % 64 == 0, any N): the weight-streaming kernel of
engine/kernels/stream_triton.py on e4m3 operands: the weight tile is the A operand of an e4m3 x e4m3
WGMMA read straight from shared memory (no conversion instruction per weight byte), with split-K
reduced in the same launch. Its launch is stream_triton's rule for 1-byte weights
(`stream_config(n, k, sms, weight_bytes=1)`), as the dense format's default is the same rule for 2.

`quantize_rows_triton(x)`: one pass per row, amax then scale and convert (the second read hits L1/L2).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from engine.kernels.platform import activation_empty, sm_count_or_default

SMALL_M = 16


@functools.cache
def _triton_kernels():
    """Compiled lazily so that importing this module needs neither Triton nor a GPU."""
    import triton
    import triton.language as tl

    # A module global, not a local: Triton (its interpreter too) looks a kernel's callees up there.
    global e4m3_scale
    from engine.kernels.norms import e4m3_scale

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

    return quantize_rows_kernel


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    quantize_rows_kernel = _triton_kernels()
    m, k = x.shape
    q = activation_empty(m, k, torch.float8_e4m3fn, x.device)     # whole GEMM tiles of rows
    scale = torch.empty(m, device=x.device, dtype=torch.float32)
    quantize_rows_kernel[(m,)](x, q, scale, k, BLOCK_K=min(4096, 1 << (k - 1).bit_length()),
                               num_warps=8)
    return q, scale


def fp8_gemm_small_m(qx, x_scale, qw, w_scale, residual=None, split: int | None = None,
                     out: torch.Tensor | None = None, config: dict | None = None):
    """bf16 [M, N] for M <= 16 on CUDA: weight streaming, one launch (grid: N tiles x K splits;
    split-K partial sums meet in engine/kernels/split_k.py's accumulator).

    split overrides the automatic K split (tests cover several), config the whole launch
    (stream_config's keys, for the benchmark's sweep); out is written in place if given.
    """
    from engine.kernels.stream_triton import launch, stream_config
    m, k = qx.shape
    n = qw.shape[0]
    if m > SMALL_M or k % 64:
        raise ValueError(f"small-M kernel takes M <= {SMALL_M} and K % 64 == 0; got M={m}, K={k}")
    num_sms = sm_count_or_default(qx.device)
    cfg = dict(config or stream_config(n, k, num_sms, weight_bytes=1))
    cfg["SPLIT_K"] = split or cfg["SPLIT_K"]
    if out is None:
        out = torch.empty(m, n, device=qx.device, dtype=torch.bfloat16)
    elif not out.is_contiguous():
        raise ValueError("out: the kernel writes a contiguous [M, N]")
    return launch(qx.contiguous(), qw.contiguous(), out, cfg, x_scale=x_scale.float().contiguous(),
                  w_scale=w_scale.float().contiguous(),
                  residual=residual.contiguous() if residual is not None else None)


@torch.library.custom_op("microengine::fp8_gemm_small_m", mutates_args=(), device_types="cuda")
def fp8_gemm_small_m_op(qx: torch.Tensor, x_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                        residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    return fp8_gemm_small_m(qx, x_scale, qw, w_scale, residual)


@fp8_gemm_small_m_op.register_fake
def _(qx, x_scale, qw, w_scale, residual=None):
    return qx.new_empty((qx.shape[0], qw.shape[0]), dtype=torch.bfloat16)
