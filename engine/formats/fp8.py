"""FP8 (e4m3) weights: the format, its reference, the `fp8` backend and the FP8 GEMM's kernel lists.

Format: weights per output channel and activations per token, each row scaled by amax/448 so that
its largest magnitude lands on e4m3's largest finite value (448); an all-zero row gets scale 1;
fp32 scales; fp32 accumulation; bf16 output.
    y[m, n] = sum_k qx[m, k] qw[n, k] * x_scale[m] * w_scale[n] (+ residual[m, n])
Activations arrive quantised from the fused RMSNorm / SwiGLU kernels (`input_quant`), or are
quantised here in one pass.

The FP8 GEMM, per architecture (engine/kernels/select.py):
- sm_90: M <= 16 the Triton weight-streaming kernel (engine/kernels/fp8_triton.py: decode reads the
  weight once); larger M the warp-specialised CuTe DSL WGMMA kernel (engine/kernels/cute/
  fp8_gemm_sm90.py); shapes neither takes (N or K not a multiple of 64) the reference.
- sm_100: the CuTe DSL tcgen05 kernel (engine/kernels/cute/fp8_gemm_sm100.py, N % 256 == 0), else
  the Triton kernel at M <= 16, else the reference.
- anything else: the reference, with a warning on CUDA.
"""
from __future__ import annotations

import torch

from engine.formats.base import WeightFormat
from engine.kernels.fp8_triton import SMALL_M
from engine.kernels.platform import cute_available
from engine.kernels.select import Kernel, Problem, select

E4M3_MAX = 448.0


# ------------------------------------------------------------------------------------ format
def quantize_rows_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantisation: (q [R, C] float8_e4m3fn, scale [R] fp32), t ~= q * scale[:, None]."""
    t32 = t.float()
    amax = t32.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (t32 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (qx float8_e4m3fn [M, K], scale fp32 [M]): one Triton pass on CUDA."""
    if x.is_cuda and x.is_contiguous() and x.dim() == 2 and x.shape[0] > 0:
        from engine.kernels.fp8_triton import quantize_rows_triton
        return quantize_rows_triton(x)
    return quantize_rows_fp8(x)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def fp8_linear_reference(qx, x_scale, qw, w_scale, residual=None, out_dtype=torch.bfloat16, config=None):
    """The GEMM every kernel must match: the product of the dequantised operands, in fp32."""
    out = (qx.float() @ qw.float().t()) * x_scale.float()[:, None] * w_scale.float()[None, :]
    if residual is not None:
        out = out + residual.float()
    return out.to(out_dtype)


# ------------------------------------------------------------------------------------ kernels
def _triton_stream(qx, xs, qw, ws, residual, out_dtype, config=None):
    from engine.kernels import fp8_triton
    gemm = fp8_triton.fp8_gemm_small_m_op if torch.compiler.is_compiling() else fp8_triton.fp8_gemm_small_m
    return gemm(qx, xs, qw, ws, residual).to(out_dtype)


def _cute_sm90(qx, xs, qw, ws, residual, out_dtype, config=None):
    from engine.kernels.cute import fp8_gemm_sm90 as k
    gemm = k.fp8_gemm_sm90_op if torch.compiler.is_compiling() else k.fp8_gemm_sm90
    return gemm(qx, xs, qw, ws, residual).to(out_dtype)


def _cute_sm100(qx, xs, qw, ws, residual, out_dtype, config=None):
    from engine.kernels.cute.fp8_gemm_sm100 import fp8_gemm_sm100
    return fp8_gemm_sm100(qx, xs, qw, ws, residual).to(out_dtype)


def _multiple_of(n_mult: int, k_mult: int):
    def check(p: Problem) -> str | None:
        if p.n % n_mult or p.k % k_mult:
            return f"needs N % {n_mult} == 0 and K % {k_mult} == 0"
        return None
    return check


def _cute(n_mult: int):
    shape = _multiple_of(n_mult, 64)

    def check(p: Problem) -> str | None:
        return "nvidia-cutlass-dsl is not installed" if not cute_available() else shape(p)
    return check


# Any N: the streaming kernel clamps the rows of its last tile past N.
TRITON_STREAM = Kernel("triton_stream", _triton_stream, max_m=SMALL_M, check=_multiple_of(1, 64))
REFERENCE = Kernel("reference", fp8_linear_reference, reference=True)
FP8_GEMM = {
    9: [TRITON_STREAM, Kernel("cute_wgmma_sm90", _cute_sm90, check=_cute(64)), REFERENCE],
    10: [Kernel("cute_tcgen05_sm100", _cute_sm100, check=_cute(256)), TRITON_STREAM, REFERENCE],
    "other": [REFERENCE],
}


def fp8_linear(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16, residual: torch.Tensor | None = None,
               x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T with W = qw * w_scale[:, None] (+ residual [M, N]).

    x is a bf16/fp16/fp32 activation, quantised per token here, or an already-quantised
    float8_e4m3fn activation with its per-token x_scale."""
    n, k = qw.shape
    if x.dtype == torch.float8_e4m3fn:
        if x_scale is None:
            raise ValueError("x_scale: an fp8 activation needs its per-token scale")
        qx, xs = x, x_scale.reshape(-1).float()
    else:
        qx, xs = quantize_act_fp8(x)
    m = qx.shape[0]
    if m == 0:
        return torch.empty(0, n, device=x.device, dtype=out_dtype)
    choice = select(FP8_GEMM, Problem("fp8_gemm", m, n, k, x.device))
    return choice.kernel.run(qx, xs, qw, w_scale, residual, out_dtype, config=choice.config)


# ------------------------------------------------------------------------------------ backend
class Fp8Weight(WeightFormat):
    """`--weights fp8`: e4m3 weight [N, K] with a per-output-channel fp32 scale [N]."""
    name = "fp8"

    def input_quant(self, m: int) -> str | None:
        return "fp8"

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__(*qweight.shape)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())
        self.dtype = dtype

    @classmethod
    def from_dense(cls, w: torch.Tensor) -> "Fp8Weight":
        qw, scale = quantize_rows_fp8(w)
        return cls(qw, scale, w.dtype)

    def forward(self, x: torch.Tensor, x_scale: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        out_dtype = self.dtype if x.dtype == torch.float8_e4m3fn else x.dtype
        return fp8_linear(x, self.qweight, self.scale, out_dtype, residual, x_scale)

    def tune(self, tuner, m_values: list[int], swiglu: bool = False) -> None:
        """Nothing to time (one configuration per kernel): the choice for each M is made, and
        logged, now rather than in the first step that meets it."""
        for m in m_values:
            select(FP8_GEMM, Problem("fp8_gemm", m, self.out_features, self.in_features, self.qweight.device))

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.qweight, self.scale).to(self.dtype)

    def shard(self, shard) -> "Fp8Weight":
        """Each row keeps its scale (made from the whole row), whichever K range the shard takes."""
        c0, c1 = self._check_cols(shard)
        rows = shard.row_index(self.qweight.device)
        return Fp8Weight(self.qweight[rows, c0:c1].contiguous(), self.scale[rows].contiguous(), self.dtype)

    def weight_bytes(self) -> int:
        return self.qweight.nbytes + self.scale.nbytes


__all__ = ["E4M3_MAX", "FP8_GEMM", "Fp8Weight", "dequantize_fp8", "fp8_linear", "fp8_linear_reference",
           "quantize_act_fp8", "quantize_rows_fp8"]
