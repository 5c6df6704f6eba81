"""2:4-sparse GEMMs from libraries, on the sparse tensor cores: cuSPARSELt for bf16 (through
torch._cslt_*) and torchao's CUTLASS sm90 kernel for e4m3 with per-token activation scales.

- cuSPARSELt: the weight is compressed once (`cslt_compress`, N % 32 == 0 and K % 64 == 0 cover
  both libraries' constraints); the dense operand is x^T, a transposed view of x with its rows
  padded to a multiple of 8; `alg` picks the library's algorithm, which `cslt_search` finds for one
  shape (the tuner runs it before serving; alg 0 otherwise).
- torchao: `torchao_compress` packs an e4m3 2:4 weight into CUTLASS's values + metadata;
  `torchao_fp8_gemm` multiplies per-token-scaled e4m3 activations by it, per-channel weight scales
  in the epilogue. Built for sm_90 only.
Both have a plain row-major copy of the kept values at the start of their buffer on the torch /
torchao versions used here; the format keeps the values once when it does (checked at load).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sparse_tc_shape(n: int, k: int) -> bool:
    return n % 32 == 0 and k % 64 == 0


def cslt_compress(dense: torch.Tensor) -> torch.Tensor | None:
    """cuSPARSELt's compressed weight, or None where this build or shape has none."""
    if not sparse_tc_shape(*dense.shape):
        return None
    try:
        return torch._cslt_compress(dense)
    except (RuntimeError, AttributeError):
        return None


def _x_transposed(x: torch.Tensor) -> torch.Tensor:
    pad = -x.shape[0] % 8
    return (F.pad(x, (0, 0, 0, pad)) if pad else x.contiguous()).t()


def cslt_mm(packed: torch.Tensor, x: torch.Tensor, alg: int = 0) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T, W compressed by cslt_compress."""
    return torch._cslt_sparse_mm(packed, _x_transposed(x), transpose_result=True, alg_id=alg)[:x.shape[0]]


def cslt_search(packed: torch.Tensor, x: torch.Tensor) -> int:
    """The algorithm cuSPARSELt finds fastest for x's shape (0 where its search fails)."""
    try:
        return int(torch._cslt_sparse_mm_search(packed, _x_transposed(x), transpose_result=True))
    except RuntimeError:
        return 0


def torchao_compress(dense_e4m3: torch.Tensor):
    """(packed, metadata) for torchao_fp8_gemm, or None where torchao's kernel is missing or
    refuses the shape."""
    if not sparse_tc_shape(*dense_e4m3.shape):
        return None
    try:
        import torchao.ops as ops
        return ops.to_sparse_semi_structured_cutlass_sm9x_f8(dense_e4m3)
    except (ImportError, AttributeError, RuntimeError):
        return None


def torchao_fp8_gemm(qx, x_scale, packed, meta, w_scale, out_dtype):
    """y [M, N] = (qx @ W^T) * x_scale[:, None] * w_scale[None, :], qx e4m3 [M, K]."""
    import torchao.ops as ops
    return ops.rowwise_scaled_linear_sparse_cutlass_f8f8(qx, x_scale, packed, meta, w_scale, None, out_dtype)
