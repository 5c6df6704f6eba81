"""RMSNorm (with the residual add fused in, optionally quantising its output to FP8) and row-wise L2 norm.

`rms_norm` / `l2_norm` are what the model calls; they run the Triton kernels on CUDA tensors (or
everywhere under TRITON_INTERPRET=1) and the PyTorch references otherwise. The references compute
in fp32 and return the input dtype.

The fused kernel reads x (and the residual) once and writes the new residual and the normalised
row in the same pass; with quant="fp8" the normalised row leaves as float8_e4m3fn with one fp32
scale per row (scale = amax / 448), so the next FP8 GEMM reads 1 byte per element and no bf16 copy
of the activation is ever written.
"""
from __future__ import annotations


import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the references run
    triton = None

from engine.kernels.platform import activation_empty, interpreting, jit, output_buffer, triton_runs

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_rows_ref(y):
    """Per-row (per-token) float8_e4m3fn quantisation of fp32 rows y [..., N]: scale = amax / 448
    (1 for an all-zero row, whose codes are all zero anyway). Returns (q, scale fp32 [...])."""
    amax = y.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (y / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.squeeze(-1)


def rms_norm_ref(x, weight, eps, residual=None, quant=None, out=None, residual_out=None):
    """RMSNorm(x [+ residual]) * weight. With a residual returns (normed, x + residual): the new
    residual stream, rounded to x.dtype exactly as the model stores it. With quant="fp8" `normed`
    is (q float8_e4m3fn, per-row fp32 scale), quantised from the fp32 result. out / residual_out:
    contiguous tensors of x's shape that the normed rows / the new residual stream go to (the step
    graphs' static buffers; out only without quant); residual_out may alias residual."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        residual = x if residual_out is None else residual_out.copy_(x)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    normed = quantize_fp8_rows_ref(normed) if quant == "fp8" else normed.to(x.dtype)
    if out is not None:
        normed = out.copy_(normed)
    return normed if residual is None else (normed, residual)


def l2_norm_ref(x, eps=1e-12):
    """x / max(||x||_2, eps) along the last dim, fp32 math."""
    xf = x.float()
    return (xf * torch.rsqrt(torch.clamp(xf.pow(2).sum(-1, keepdim=True), min=eps * eps))).to(x.dtype)


@jit
def e4m3_scale(amax):
    """A row's float8_e4m3fn scale from its fp32 amax: amax / 448, and 1 for an all-zero row (as
    quantize_fp8_rows_ref)."""
    return tl.where(amax > 0, amax / 448.0, 1.0)


@jit
def quantize_e4m3(y, scale, ROUND_IN_FP32: tl.constexpr):
    """fp32 y / scale as float8_e4m3fn codes, rounded to nearest even and saturated at +-448.
    The GPU's conversion (cvt.rn.satfinite) rounds that way itself; Triton's interpreter truncates
    and mishandles mantissa carries, so under it (ROUND_IN_FP32) the value is first rounded onto
    the e4m3 grid in fp32 arithmetic and the conversion is exact."""
    v = tl.clamp(y / scale, -448.0, 448.0)
    if ROUND_IN_FP32:
        bits = v.to(tl.uint32, bitcast=True)  # normal range: round the fp32 mantissa to 3 bits
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        subnormal = (v + 24576.0) - 24576.0   # below 2^-6 the grid is multiples of 2^-9
        v = tl.where(tl.abs(v) < 0.015625, subnormal, normal)
    return v.to(tl.float8e4nv)


def row_launch_config(n_cols: int):
    """(BLOCK, num_warps) for kernels that hold one whole row in registers: 16-byte accesses, 8..16
    elements per thread; the warp counts are bench_fused.py's best at 8192 rows (wide rows want
    more warps: 16384-element SwiGLU->FP8 rows run best with 32)."""
    block = triton.next_power_of_2(n_cols)
    if block > 65536:
        raise ValueError(f"rows of {n_cols} elements are longer than the one-row kernels hold (65536)")
    num_warps = 4 if block < 2048 else 8 if block < 8192 else 16 if block < 16384 else 32
    return block, num_warps


@jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
                     n_cols, x_stride, res_stride, eps,
                     HAS_RESIDUAL: tl.constexpr, QUANT_FP8: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=in_row, other=0.0)
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)   # before any store
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=in_row, other=0.0)
        # the residual stream is stored in x's dtype; normalise exactly what is stored
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=in_row)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = xf * rstd * w
    if QUANT_FP8:
        scale = e4m3_scale(tl.max(tl.abs(y), axis=0))
        tl.store(out_ptr + row * n_cols + cols, quantize_e4m3(y, scale, ROUND_IN_FP32), mask=in_row)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=in_row)


@jit
def _l2_norm_kernel(x_ptr, out_ptr, n_cols, x_stride, eps_sq, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < n_cols
    xf = tl.load(x_ptr + row * x_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    inv_norm = tl.rsqrt(tl.maximum(tl.sum(xf * xf, axis=0), eps_sq))  # once per row
    tl.store(out_ptr + row * n_cols + cols, (xf * inv_norm).to(out_ptr.dtype.element_ty), mask=in_row)


def _rows(x):
    """x [..., N] as a 2-D view [M, N] with unit column stride (a copy only if it must be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_triton(x, weight, eps, residual=None, quant=None, out=None, residual_out=None):
    """The fused kernel; same contract as `rms_norm_ref` (residual_out may alias residual: a
    program reads its whole row before it writes)."""
    if quant not in (None, "fp8"):
        raise ValueError(f"quant={quant!r}: only None and 'fp8' are supported")
    if out is not None and quant is not None:
        raise ValueError("out: only for normed rows in x's dtype (quant=None)")
    n = x.shape[-1]
    x2 = _rows(x)
    m = x2.shape[0]
    if quant == "fp8":      # rows padded to whole FP8 GEMM tiles (platform.activation_empty)
        out = activation_empty(m, n, torch.float8_e4m3fn, x.device)
        scale = torch.empty(m, device=x.device, dtype=torch.float32)
    else:
        out = scale = output_buffer(out, x.shape, x.dtype, x.device).view(m, n)
    if residual is not None:
        r2 = _rows(residual)
        res_out = output_buffer(residual_out, x.shape, x.dtype, x.device, "residual_out").view(m, n)
    else:
        r2, res_out = x2, out  # unused: HAS_RESIDUAL is off
    block, num_warps = row_launch_config(n)
    if m > 0:
        _rms_norm_kernel[(m,)](x2, r2, weight, out, res_out, scale, n, x2.stride(0), r2.stride(0), eps,
                               HAS_RESIDUAL=residual is not None, QUANT_FP8=quant == "fp8",
                               ROUND_IN_FP32=interpreting(), BLOCK=block, num_warps=num_warps)
    lead = x.shape[:-1]
    normed = (out.view(*lead, n), scale.view(lead)) if quant == "fp8" else out.view(*lead, n)
    return normed if residual is None else (normed, res_out.view(*lead, n))


def l2_norm_triton(x, eps=1e-12):
    n = x.shape[-1]
    x2 = _rows(x)
    m = x2.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    block, num_warps = row_launch_config(n)
    if m > 0:
        _l2_norm_kernel[(m,)](x2, out, n, x2.stride(0), eps * eps, BLOCK=block, num_warps=num_warps)
    return out.view(x.shape)


def rms_norm(x, weight, eps, residual=None, quant=None, fused=True, out=None, residual_out=None):
    """RMSNorm(x [+ residual]) * weight; contract of `rms_norm_ref`. fused=False: the reference
    (the engine's fused-kernels switch)."""
    if fused and triton_runs(x):
        return rms_norm_triton(x, weight, eps, residual, quant, out, residual_out)
    return rms_norm_ref(x, weight, eps, residual, quant, out, residual_out)


def l2_norm(x, eps=1e-12, fused=True):
    """x / max(||x||_2, eps) along the last dim."""
    if fused and triton_runs(x):
        return l2_norm_triton(x, eps)
    return l2_norm_ref(x, eps)
