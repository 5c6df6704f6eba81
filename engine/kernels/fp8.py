"""FP8 (e4m3) linear layers: quantisation, the PyTorch reference, kernel dispatch, the Linear backend.

Format: weights per output channel and activations per token, each row scaled by amax/448 so that
its largest magnitude lands on e4m3's largest finite value (448); fp32 scales; fp32 accumulation;
bf16 output. y[m, n] = sum_k qx[m, k] qw[n, k] * x_scale[m] * w_scale[n] (+ residual[m, n]).

Dispatch (`fp8_linear`), on Hopper CUDA tensors:
- M <= SMALL_M: a Triton weight-streaming kernel (decode is bound by reading the weight once): narrow
  weight tiles, autotuned per shape, so that every SM streams; K is split (plus a reduction pass)
  only when N is too small to give every SM its own rows;
- larger M: the CuTe DSL WGMMA kernel in engine/kernels/cute/fp8_gemm_sm90.py;
- anywhere else (CPU, other GPUs, shapes the kernels do not take): the reference, which dequantises
  to fp32 and multiplies.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch

from engine.linear import LinearBackend

E4M3_MAX = 448.0
SMALL_M = 16


# ------------------------------------------------------------------------------------ quantisation
def quantize_rows_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantisation: (q [R, C] float8_e4m3fn, scale [R] fp32) with t ~= q * scale[:, None].

    scale = amax/448; an all-zero row gets scale 1 (its values quantise to 0 either way, and a
    zero scale would turn 0/0 into NaN).
    """
    t32 = t.float()
    amax = t32.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (t32 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (qw float8_e4m3fn [N, K], scale fp32 [N]), one scale per output channel."""
    return quantize_rows_fp8(w)


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (qx float8_e4m3fn [M, K], scale fp32 [M]), one scale per token (one Triton pass on CUDA)."""
    if x.is_cuda and x.is_contiguous() and x.dim() == 2 and x.shape[0] > 0:
        return _quantize_rows_triton(x)
    return quantize_rows_fp8(x)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


# ------------------------------------------------------------------------------------ reference
def fp8_linear_reference(qx, x_scale, qw, w_scale, residual=None, out_dtype=torch.bfloat16):
    """The GEMM every kernel must match: the product of the dequantised operands, in fp32."""
    out = (qx.float() @ qw.float().t()) * x_scale.float()[:, None] * w_scale.float()[None, :]
    if residual is not None:
        out = out + residual.float()
    return out.to(out_dtype)


# ------------------------------------------------------------------------------------ dispatch
def fp8_linear(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, residual: torch.Tensor | None = None,
               x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T with W = qw * w_scale[:, None] (+ residual [..., N]).

    x is a bf16/fp16/fp32 activation, quantised per token here, or an already-quantised
    float8_e4m3fn activation with its per-token x_scale (as the fused norm kernels emit it).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = qw.shape[0]
    x2 = x.reshape(-1, k)
    if x.dtype == torch.float8_e4m3fn:
        if x_scale is None:
            raise ValueError("an fp8 activation needs its per-token x_scale")
        qx, xs = x2, x_scale.reshape(-1).float()
    else:
        qx, xs = quantize_act_fp8(x2)
    res2 = residual.reshape(-1, n) if residual is not None else None
    m = qx.shape[0]
    if m == 0:
        return torch.empty(*lead, n, device=x.device, dtype=out_dtype)
    kernel = _kernel_for(qx, n, k)
    # Under torch.compile the kernels are called through their custom ops (opaque graph nodes);
    # eager calls skip the op dispatcher's host overhead, which decode steps would feel.
    compiling = torch.compiler.is_compiling()
    if kernel == "small_m":
        out = (torch.ops.microengine.fp8_gemm_small_m if compiling else fp8_gemm_small_m)(
            qx, xs, qw, w_scale, res2)
    elif kernel == "sm90":
        from engine.kernels.cute.fp8_gemm_sm90 import fp8_gemm_sm90
        out = (torch.ops.microengine.fp8_gemm_sm90 if compiling else fp8_gemm_sm90)(
            qx, xs, qw, w_scale, res2)
    else:
        return fp8_linear_reference(qx, xs, qw, w_scale, res2, out_dtype).reshape(*lead, n)
    return out.to(out_dtype).reshape(*lead, n)


def _kernel_for(qx: torch.Tensor, n: int, k: int) -> str:
    if not (qx.is_cuda and _is_hopper(qx.device.index or 0)) or n % 64 or k % 64:
        return "reference"
    if qx.shape[0] <= SMALL_M:
        return "small_m"
    return "sm90" if _cute_available() else "reference"


@functools.cache
def _is_hopper(device: int) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def _cute_available() -> bool:
    from engine.kernels.cute.common import cute_available
    return cute_available()


# ------------------------------------------------------------------------------------ Triton kernels
@functools.cache
def _triton_kernels():
    """Compiled lazily so that importing this module needs neither Triton nor a GPU."""
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, BLOCK_K: tl.constexpr):
        # One program per row: pass 1 finds amax, pass 2 (an L1/L2 hit) scales and converts.
        row = tl.program_id(0).to(tl.int64)
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        row_amax = tl.max(amax, axis=0)
        scale = tl.where(row_amax > 0, row_amax / 448.0, 1.0)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
            q = tl.clamp(v / scale, -448.0, 448.0)
            tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=offs < K)

    # M is not specialised: Triton would otherwise compile (and tune) M == 1 separately.
    @triton.jit(do_not_specialize=["M"])
    def small_m_kernel(qx_ptr, xs_ptr, qw_ptr, ws_ptr, res_ptr, out_ptr, part_ptr, M, N, K,
                       K_PER_SPLIT, HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # acc[BLOCK_N, BLOCK_M] = W_tile @ X_tile^T: the weight rows sit on the MMA's M side, so the
        # weight tile feeds the tensor cores even when the batch is a single token. fp8
        # values are exact in fp16 (one cvt per pair on sm_90), so the fp16 MMA computes the fp8
        # products exactly.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        k_start = pid_k * K_PER_SPLIT
        w_ptrs = qw_ptr + offs_n[:, None].to(tl.int64) * K + (k_start + offs_k)[None, :]
        x_ptrs = qx_ptr + offs_m[:, None] * K + (k_start + offs_k)[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for _ in range(0, K_PER_SPLIT, BLOCK_K):
            w = tl.load(w_ptrs, eviction_policy="evict_first").to(tl.float16)
            xt = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0).to(tl.float16)
            acc = tl.dot(w, tl.trans(xt), acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
        if SPLIT == 1:
            xs = tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)
            ws = tl.load(ws_ptr + offs_n)
            y = acc * ws[:, None] * xs[None, :]
            if HAS_RESIDUAL:
                y += tl.load(res_ptr + offs_m[None, :] * N + offs_n[:, None], mask=mask).to(tl.float32)
            tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], y.to(tl.bfloat16), mask=mask)
        else:
            tl.store(part_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=mask)

    @triton.jit
    def split_reduce_kernel(part_ptr, xs_ptr, ws_ptr, res_ptr, out_ptr, M, N,
                            HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(SPLIT):
            acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
        y = acc * tl.load(xs_ptr + offs // N, mask=mask, other=0.0) * tl.load(ws_ptr + offs % N, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            y += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, y.to(tl.bfloat16), mask=mask)

    def prune(configs, named_args, **_):
        fits = [c for c in configs if named_args["N"] % c.kwargs["BLOCK_N"] == 0
                and named_args["K_PER_SPLIT"] % c.kwargs["BLOCK_K"] == 0]
        return fits or [triton.Config({"BLOCK_N": 16, "BLOCK_K": 64}, num_warps=4, num_stages=4)]

    # Tuned once per (N, K, split) on the device: stage size, depth and tile height trade bytes in
    # flight per SM against programs per SM. The tuner times with L2 flushed, as decode sees it.
    small_m_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
                 for bn, bk, w, st in [(16, 512, 4, 4), (16, 512, 4, 6), (16, 1024, 4, 3), (16, 256, 4, 6),
                                       (32, 256, 4, 4), (32, 512, 4, 4), (64, 128, 4, 4), (64, 256, 4, 4)]],
        key=["N", "K", "K_PER_SPLIT"], prune_configs_by={"early_config_prune": prune},
        do_bench=functools.partial(triton.testing.do_bench, warmup=5, rep=25))(small_m_kernel)

    return quantize_rows_kernel, small_m_kernel, small_m_tuned, split_reduce_kernel


def _quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    quantize_rows_kernel = _triton_kernels()[0]
    m, k = x.shape
    q = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(m, device=x.device, dtype=torch.float32)
    quantize_rows_kernel[(m,)](x, q, scale, k, BLOCK_K=min(4096, 1 << (k - 1).bit_length()),
                               num_warps=8)
    return q, scale


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def small_m_config(n: int, k: int, num_sms: int) -> tuple[int, int, int]:
    """(block_n, block_k, split) for the weight-streaming kernel.

    The widest weight tile (64, 32 or 16 rows) that still gives >= 1.5 programs per SM, so that
    every SM streams without a second reduction pass; K is split only when even 16-row tiles
    leave SMs idle. block_k keeps a pipeline stage near 8 KB. On a GPU the autotuner then picks
    block_n / block_k / depth (the split stays); block_n and block_k here serve the interpreter.
    """
    block_n = next((b for b in (64, 32, 16) if n % b == 0 and n // b >= 1.5 * num_sms), 16)
    block_k = next(b for b in (8192 // block_n, 256, 128, 64) if b <= 8192 // block_n and k % b == 0)
    split = 1
    while (n // block_n) * split < 1.5 * num_sms and k % (2 * split * block_k) == 0 \
            and k // (2 * split) >= 1024:
        split *= 2
    return block_n, block_k, split


def fp8_gemm_small_m(qx, x_scale, qw, w_scale, residual=None, split: int | None = None,
                     out: torch.Tensor | None = None):
    """bf16 [M, N] for M <= 16 on CUDA: weight streaming (grid over N tiles x K splits).

    split overrides the automatic K split (tests cover several); out is written in place if given.
    """
    _, small_m_kernel, small_m_tuned, split_reduce_kernel = _triton_kernels()
    m, k = qx.shape
    n = qw.shape[0]
    if m > SMALL_M or n % 16 or k % 64:
        raise ValueError(f"small-M kernel takes M <= {SMALL_M}, N % 16 == 0, K % 64 == 0; "
                         f"got M={m}, N={n}, K={k}")
    num_sms = torch.cuda.get_device_properties(qx.device).multi_processor_count if qx.is_cuda else 132
    block_n, block_k, auto_split = small_m_config(n, k, num_sms)
    split = split or auto_split
    if k % (split * block_k):
        raise ValueError(f"split {split} must divide K={k} into multiples of {block_k}")
    if out is None:
        out = torch.empty(m, n, device=qx.device, dtype=torch.bfloat16)
    part = torch.empty(split, m, n, device=qx.device, dtype=torch.float32) if split > 1 else out
    res = residual.contiguous() if residual is not None else out
    x_scale, w_scale = x_scale.float().contiguous(), w_scale.float().contiguous()
    args = (qx.contiguous(), x_scale, qw.contiguous(), w_scale, res, out, part, m, n, k, k // split)
    if qx.is_cuda and not _interpreting():
        small_m_tuned[lambda meta: (n // meta["BLOCK_N"], split)](
            *args, HAS_RESIDUAL=residual is not None, SPLIT=split, BLOCK_M=16)
    else:
        small_m_kernel[(n // block_n, split)](
            *args, HAS_RESIDUAL=residual is not None, SPLIT=split, BLOCK_M=16, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=4, num_stages=4)
    if split > 1:
        block = 1024
        split_reduce_kernel[(math.ceil(m * n / block),)](
            part, x_scale, w_scale, res, out, m, n, HAS_RESIDUAL=residual is not None, SPLIT=split,
            BLOCK=block)
    return out


@torch.library.custom_op("microengine::fp8_gemm_small_m", mutates_args=(), device_types="cuda")
def fp8_gemm_small_m_op(qx: torch.Tensor, x_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                        residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    return fp8_gemm_small_m(qx, x_scale, qw, w_scale, residual)


@fp8_gemm_small_m_op.register_fake
def _(qx, x_scale, qw, w_scale, residual=None):
    return qx.new_empty((qx.shape[0], qw.shape[0]), dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------ Linear backend
class Fp8Weight(LinearBackend):
    """e4m3 weight with a per-output-channel fp32 scale; activations quantised per token on the fly,
    or upstream by the fused norm / SwiGLU kernels (input_quant tells them to)."""
    name = "fp8"
    input_quant = "fp8"

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.qweight, self.scale, self.dtype = qweight, scale, dtype
        self.out_features, self.in_features = qweight.shape

    @classmethod
    def from_dense(cls, w: torch.Tensor) -> "Fp8Weight":
        qw, scale = quantize_weight_fp8(w)
        return cls(qw, scale, w.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                x_scale: torch.Tensor | None = None) -> torch.Tensor:
        out_dtype = self.dtype if x.dtype == torch.float8_e4m3fn else x.dtype
        return fp8_linear(x, self.qweight, self.scale, out_dtype=out_dtype, residual=residual,
                          x_scale=x_scale)

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.qweight, self.scale).to(self.dtype)

    def weight_bytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * 4
