"""Shared plumbing for the CuTe DSL kernels: lazy import, pointers, streams, the compile cache.

CuTe DSL is imported only when a kernel is compiled (importing it costs ~2 s and needs the
nvidia-cutlass-dsl package, which the CPU-only install may lack). Kernels take raw device pointers
plus the dynamic extents as scalars, so one compiled kernel serves every M: nothing is recompiled
when only the batch changes. Set CUTE_DSL_ARCH=sm_90a / sm_100a to compile without a GPU, and
CUTE_DSL_KEEP=ptx with CUTE_DSL_DUMP_DIR to keep the PTX (`__ptx__`), as tests/cute_ptx.py does.
"""
from __future__ import annotations

import threading

import torch

from engine.kernels.platform import storage_rows


def cutlass_dtype(dtype: torch.dtype):
    import cutlass
    return {
        torch.float8_e4m3fn: cutlass.Float8E4M3FN,
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
    }[dtype]


def gmem_ptr(dtype, address: int = 0, align: int = 16):
    """A global-memory pointer argument. address=0 gives a placeholder for compile-only runs."""
    from cutlass.cute.runtime import make_ptr
    from cutlass import AddressSpace
    return make_ptr(dtype, address, AddressSpace.gmem, assumed_align=align)


def scaled_gemm_tensors(a_ptr, b_ptr, xs_ptr, ws_ptr, out_ptr, res_ptr, m, a_rows, n: int, k: int):
    """The global tensors of y = (A @ B^T) * xs[:, None] * ws[None, :] (+ residual), as both FP8
    kernels take them: A [a_rows, K] and B [N, K] K-major, the per-row and per-column scales, and the
    output and residual [M, N] row-major. A's rows past M (a_rows >= M, where its storage holds them:
    engine/kernels/platform.py `activation_empty`) spare the TMA boxes that cross A's last row; the
    products of those rows are never stored. M and a_rows are run-time values; call it inside a
    @cute.jit."""
    import cutlass.cute as cute

    def matrix(ptr, rows, cols):
        return cute.make_tensor(ptr, cute.make_layout((rows, cols), stride=(cols, 1)))
    return (matrix(a_ptr, a_rows, k), matrix(b_ptr, n, k), cute.make_tensor(xs_ptr, cute.make_layout(m)),
            cute.make_tensor(ws_ptr, cute.make_layout(n)), matrix(out_ptr, m, n), matrix(res_ptr, m, n))


def tma_rows(qx: torch.Tensor, tile_m: int) -> int:
    """The rows of A to describe to TMA: M rounded up to whole tiles of tile_m rows where qx's storage
    holds them (engine/kernels/platform.py `activation_empty`), else as many as it holds (>= M)."""
    m = qx.shape[0]
    return min(storage_rows(qx), -(-m // tile_m) * tile_m)


def compile_scaled_gemm(kernel, stream=None):
    """cute.compile of an FP8 kernel whose __call__ takes (a, b, xs, ws, out, residual pointers, m,
    a_rows, stream), for the current target, with placeholder pointers: M and A's rows stay run-time
    arguments."""
    import cutlass
    import cutlass.cute as cute
    fp8, f32, bf16 = cutlass.Float8E4M3FN, cutlass.Float32, cutlass.BFloat16
    return cute.compile(
        kernel, gmem_ptr(fp8), gmem_ptr(fp8), gmem_ptr(f32, align=4), gmem_ptr(f32, align=4),
        gmem_ptr(bf16), gmem_ptr(bf16), cutlass.Int32(1), cutlass.Int32(1),
        stream if stream is not None else placeholder_stream())


def tensor_ptr(t: torch.Tensor, align: int = 16):
    if t.data_ptr() % align:
        raise ValueError(f"tensor data pointer must be {align}-byte aligned")
    return gmem_ptr(cutlass_dtype(t.dtype), t.data_ptr(), align)


def current_stream():
    import cuda.bindings.driver as cuda
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def placeholder_stream():
    from cutlass.runtime import make_fake_stream
    return make_fake_stream()


class CompileCache:
    """Compiled kernels keyed by their compile-time configuration (never by M)."""

    def __init__(self):
        self._compiled: dict = {}
        self._lock = threading.Lock()

    def get(self, key, build):
        fn = self._compiled.get(key)
        if fn is None:
            with self._lock:
                fn = self._compiled.get(key)
                if fn is None:
                    fn = self._compiled[key] = build()
        return fn

    def __len__(self):
        return len(self._compiled)
