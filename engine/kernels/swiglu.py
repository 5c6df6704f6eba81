"""SwiGLU: silu(gate) * up, read from the fused gate/up GEMM output [M, 2F] (gate first, then up).

`swiglu` runs the Triton kernel on CUDA tensors (or under TRITON_INTERPRET=1) and the reference
otherwise. With quant="fp8" the product is quantised per row to float8_e4m3fn in the same pass
(recompute instead of store): the bf16 intermediate [M, F] is never written, and the down
projection's FP8 GEMM reads 1 byte per element plus one fp32 scale per row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.norms import e4m3_scale, quantize_e4m3, quantize_fp8_rows_ref, row_launch_config
from engine.kernels.platform import activation_empty, interpreting, jit, triton_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference runs
    triton = None


def swiglu_ref(gate_up, quant=None):
    g, u = gate_up.chunk(2, dim=-1)
    h = F.silu(g.float()) * u.float()
    return quantize_fp8_rows_ref(h) if quant == "fp8" else h.to(gate_up.dtype)


@jit
def _swiglu_kernel(gate_up_ptr, out_ptr, n_ffn, in_stride, BLOCK: tl.constexpr):
    """One [BLOCK] slice of one row per program: a 2-D grid keeps every SM busy at any M."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < n_ffn
    g = tl.load(gate_up_ptr + row * in_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * in_stride + n_ffn + cols, mask=in_row, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * n_ffn + cols, h.to(out_ptr.dtype.element_ty), mask=in_row)


@jit
def _swiglu_fp8_kernel(gate_up_ptr, out_ptr, scale_ptr, n_ffn, in_stride,
                       ROUND_IN_FP32: tl.constexpr, BLOCK: tl.constexpr):
    """One whole row per program: the per-row amax needs every product before the first store."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < n_ffn
    g = tl.load(gate_up_ptr + row * in_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * in_stride + n_ffn + cols, mask=in_row, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    scale = e4m3_scale(tl.max(tl.abs(h), axis=0))
    tl.store(out_ptr + row * n_ffn + cols, quantize_e4m3(h, scale, ROUND_IN_FP32), mask=in_row)
    tl.store(scale_ptr + row, scale)


SLICE = 2048  # columns per program of the bf16 kernel (1024..4096 all stream at copy bandwidth)


def swiglu_triton(gate_up, quant=None):
    """The fused kernel; same contract as `swiglu_ref`."""
    if quant not in (None, "fp8"):
        raise ValueError(f"quant={quant!r}: only None and 'fp8' are supported")
    two_f = gate_up.shape[-1]
    if two_f % 2:
        raise ValueError(f"gate_up's last dim {two_f} is not even")
    f = two_f // 2
    x2 = gate_up.reshape(-1, two_f)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    lead = gate_up.shape[:-1]
    if quant == "fp8":
        out = activation_empty(m, f, torch.float8_e4m3fn, gate_up.device)     # whole GEMM tiles of rows
        scale = torch.empty(m, device=gate_up.device, dtype=torch.float32)
        block, num_warps = row_launch_config(f)
        if m > 0:
            _swiglu_fp8_kernel[(m,)](x2, out, scale, f, x2.stride(0),
                                     ROUND_IN_FP32=interpreting(), BLOCK=block, num_warps=num_warps)
        return out.view(*lead, f), scale.view(lead)
    out = torch.empty((m, f), device=gate_up.device, dtype=gate_up.dtype)
    block = min(SLICE, triton.next_power_of_2(f))
    if m > 0:
        _swiglu_kernel[(m, triton.cdiv(f, block))](x2, out, f, x2.stride(0), BLOCK=block, num_warps=4)
    return out.view(*lead, f)


def swiglu(gate_up, quant=None, fused=True):
    """silu(gate) * up in gate_up's dtype, or (float8_e4m3fn, per-row fp32 scale) with quant="fp8".
    fused=False: the reference (the engine's fused-kernels switch)."""
    if fused and triton_runs(gate_up):
        return swiglu_triton(gate_up, quant)
    return swiglu_ref(gate_up, quant)
