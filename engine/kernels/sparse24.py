"""2:4 structured sparsity for FFN weights: pruning, compressed storage, kernels and linear backends.

W [N, K] keeps 2 of every 4 consecutive entries along K (the input dimension). Stored compressed:
the kept values [N, K/2] plus a 4-bit nibble per group (two 2-bit positions), 56% of dense bf16.

Two regimes, two kinds of kernel, one dispatch:
- decode (small M): `sparse24_mm`, kernels that stream the compressed weight, ~56% of the dense
  bytes with bf16 values or ~31% with fp8 values (weight-only: the activations stay bf16), tuned
  per shape. On sm_90 with bf16 values the Gluon sparse-MMA kernel (sparse24_sp_gluon.py: mma.sp
  on the stored values, metadata registers precomputed per weight) wins at M = 1..16, 3.0-4.0 TB/s
  of compressed weight at the Llama-3.1-8B FFN shapes, and can finish gate_up with the SwiGLU
  (`sparse24_swiglu_mm`); elsewhere the Triton kernels (sparse24_triton.py) run, the word-per-thread
  MMA kernel fastest (~2.7-3.0 TB/s on the H200).
- prefill (large M): sparse tensor cores. bf16 goes through cuSPARSELt (torch._cslt_sparse_mm) with
  the weight compressed once at load and the algorithm searched once per shape; FP8 goes through
  torchao's CUTLASS sm90 2:4 kernel with per-token activation scales.
The bf16 backend picks the path per M bucket by timing both on the device the first time a bucket is
seen (outside CUDA-graph capture). The FP8 backend always takes the CUTLASS kernel where it loads:
measured on an H200 it wins at every M, decode included.
Where cuSPARSELt's (or torchao's) buffer starts with the kept values in plain row-major order
(checked at load; true on torch 2.11 / torchao 0.18), the decode kernels read them from that buffer,
so the values are stored once: `values` is then a view into `packed`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.fp8 import quantize_act_fp8, quantize_rows_fp8
from engine.linear import LinearBackend

# ----------------------------------------------------------------------------- pruning

def wanda_score(w: torch.Tensor, act_norm: torch.Tensor) -> torch.Tensor:
    """Wanda importance |W_ij| * ||X_j||_2: act_norm [K] is the L2 norm of input channel j over calibration tokens."""
    return w.float().abs() * act_norm.float().reshape(1, -1)


def _top2_positions(key: torch.Tensor) -> torch.Tensor:
    """For key [N, K], the 2 largest per group of 4 as positions [N, K/4, 2], ascending; ties -> lower index."""
    groups = key.reshape(key.shape[0], -1, 4)
    order = torch.argsort(groups, dim=-1, descending=True, stable=True)
    return order[..., :2].sort(dim=-1).values


def is_24_sparse(w: torch.Tensor) -> bool:
    """True when every group of 4 consecutive entries along K has at most 2 nonzeros."""
    if w.dim() != 2 or w.shape[1] % 4:
        return False
    return bool(((w != 0).reshape(w.shape[0], -1, 4).sum(-1) <= 2).all())


def prune_24(w: torch.Tensor, score: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the 2 largest-|score| entries of each group of 4 along K (score defaults to |w|)."""
    if w.dim() != 2 or w.shape[1] % 4:
        raise ValueError(f"2:4 pruning needs a 2-D weight with K % 4 == 0, got {tuple(w.shape)}")
    key = (w if score is None else score).float().abs()
    pos = _top2_positions(key)
    mask = torch.zeros(w.shape[0], w.shape[1] // 4, 4, dtype=torch.bool, device=w.device)
    mask.scatter_(-1, pos, True)
    return w * mask.reshape(w.shape).to(w.dtype)


# ----------------------------------------------------------------------------- storage

@dataclass
class Sparse24Tensor:
    """A 2:4 matrix [N, K]: values [N, K/2] (kept entries, ascending position in each group) and
    meta [N, K/8] uint8 (nibble i0 | i1 << 2 per group, even group in the low nibble)."""
    values: torch.Tensor
    meta: torch.Tensor
    shape: tuple[int, int]

    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.meta.numel()


def compress_24(w: torch.Tensor) -> Sparse24Tensor:
    """Compress a matrix that is already 2:4 along K (K % 8 == 0). Exact: decompress_24 gives w back."""
    if w.dim() != 2 or w.shape[1] % 8:
        raise ValueError(f"compress_24 needs a 2-D weight with K % 8 == 0, got {tuple(w.shape)}")
    if not is_24_sparse(w):
        raise ValueError("compress_24 needs a 2:4-sparse weight: call prune_24 first")
    n, k = w.shape
    pos = _top2_positions((w != 0).to(torch.int8))  # nonzeros first; zero groups keep positions 0, 1
    values = torch.gather(w.reshape(n, k // 4, 4), -1, pos).reshape(n, k // 2)
    nib = (pos[..., 0] | (pos[..., 1] << 2)).to(torch.uint8).reshape(n, k // 8, 2)
    meta = nib[..., 0] | (nib[..., 1] << 4)
    return Sparse24Tensor(values.contiguous(), meta.contiguous(), (n, k))


def _positions(meta: torch.Tensor) -> torch.Tensor:
    """meta [N, K/8] uint8 -> kept positions [N, K/4, 2] int64."""
    nib = torch.stack([meta & 15, meta >> 4], dim=-1).reshape(meta.shape[0], -1).long()
    return torch.stack([nib & 3, nib >> 2], dim=-1)


def decompress_24(t: Sparse24Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense [N, K] matrix (in `dtype`, default the values' dtype)."""
    n, k = t.shape
    dtype = dtype or t.values.dtype
    values = t.values.to(dtype)
    if dtype.itemsize == 1:  # scatter has no float8 kernels: move the bytes
        values = values.view(torch.uint8)
    dense = torch.zeros(n, k // 4, 4, dtype=values.dtype, device=values.device)
    dense.scatter_(-1, _positions(t.meta), values.reshape(n, k // 4, 2))
    return dense.reshape(n, k).view(dtype)


def sparse24_linear_ref(x: torch.Tensor, t: Sparse24Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference y = x @ (W * scale[:, None])^T in fp32 from the decompressed weight, cast to x.dtype."""
    w = decompress_24(t, torch.float32)
    if scale is not None:
        w = w * scale.float().reshape(-1, 1)
    return (x.float() @ w.t()).to(x.dtype)


# ----------------------------------------------------------------------------- decode kernel

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# Launch candidates per M bucket: (kernel, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages),
# and for "mma" also CH (groups per thread per chunk) and the PTX decode's pack (16: two k16 steps,
# the meta byte decoded in the PTX). The first of each list is the untuned default (CPU
# interpreter, CUDA-graph capture); the tuner times them all on first use of a (bucket, N, K,
# dtypes) and keeps the fastest. The "mma" entries are the fastest of an H200 sweep at the
# Llama-3.1-8B FFN shapes (CUDA graphs, weights rotated beyond L2), M = 1 and 16: gate_up
# [28672 x 4096] 44.3-44.5 us with 128-row tiles and no split (2.97-2.99 TB/s of compressed weight),
# down [4096 x 14336] 23.4-24.1 us with 128-row tiles 128 deep split 8 ways (2.74-2.83 TB/s); the
# best earlier kernels there: fma 53.9 / 35.7 us at M = 1, wtile 96.3 / 72.6 us at M = 16. At
# M = 33..128 the "mma" entries (64- and 128-row x tiles) compete with the tile kernels and
# cuSPARSELt: the weight is still streamed once per program row of x.
_MMA = [("mma", 16, 128, 256, 1, 4, 3, 8, 16), ("mma", 16, 128, 256, 1, 4, 3, 4, 16),
        ("mma", 16, 128, 128, 8, 4, 4, 8, 16), ("mma", 16, 128, 256, 8, 4, 3, 8, 16),
        ("mma", 16, 64, 256, 4, 4, 3, 4, 16)]
# "sp": engine/kernels/sparse24_sp_gluon.py, the sparse tensor cores (mma.sp) on the stored values
# and the MMA-order metadata (sm_90, bf16), ("sp", BM, BLOCK_N = 16 * RB rows per row warp, WPT,
# SPLIT_K, num_warps, WK); where it cannot run (another GPU, the interpreter, fp8 values, K not a
# multiple of SPLIT_K * WK * 16 * WPT, strided operands, no MMA-order metadata) the first "mma"
# entry runs instead and GLUON_SKIPPED records why. The fastest of an H200 sweep (CUDA graphs, 3 weight
# copies, 2026-11-22) at M = 1 / 4 / 8 / 16: gate_up 33.1 / 33.8 / 35.0 / 38.1 us, down 18.6 / 19.1
# / 20.5 / 22.0 us; the stored-nibble metadata before: 34.0 / 35.4 / 38.4 / 42.3 and 19.6 / 20.1 /
# 22.0 / 25.5. An mma.sync Gluon kernel that expanded the values with `prmt` (removed) had 37.2 /
# 37.6 / 37.3 / 44.7 and 22.1 / 23.0 / 24.0 / 26.6 at best, and was never chosen against this one.
_SP = [("sp", 16, 128, 8, 1, 8, 1), ("sp", 16, 64, 8, 1, 4, 1), ("sp", 16, 128, 8, 1, 4, 1),
       ("sp", 16, 256, 8, 1, 8, 1), ("sp", 16, 64, 8, 8, 4, 1), ("sp", 16, 128, 8, 8, 8, 1),
       ("sp", 16, 16, 8, 1, 8, 8), ("sp", 16, 64, 8, 4, 8, 2)]
_SP8 = [("sp", 16, 128, 4, 1, 4, 2), ("sp", 16, 64, 4, 1, 4, 2), ("sp", 16, 128, 8, 1, 4, 2),
        ("sp", 16, 16, 4, 1, 8, 8), ("sp", 16, 64, 4, 8, 4, 1), ("sp", 16, 128, 4, 8, 4, 1)]
_SP16 = [("sp", 16, 128, 4, 1, 4, 2), ("sp", 16, 64, 4, 1, 4, 2), ("sp", 16, 256, 4, 1, 8, 2),
         ("sp", 16, 64, 4, 8, 4, 1), ("sp", 16, 16, 4, 1, 8, 8), ("sp", 16, 128, 4, 8, 4, 1)]
_DECODE_CONFIGS = {
    1: _MMA + [("fma", 1, 32, 256, 1, 4, 1), ("fma", 1, 16, 256, 2, 4, 1)] + _SP,
    4: _MMA + [("fma", 4, 32, 256, 1, 4, 1)] + _SP,
    8: _MMA + [("wtile", 16, 64, 256, 2, 4, 3)] + _SP8,
    16: _MMA + [("wtile", 16, 64, 256, 2, 4, 3)] + _SP16,
    32: [("mma", 32, 128, 256, 1, 4, 3, 8, 16), ("mma", 32, 128, 128, 8, 4, 4, 8, 16),
         ("mma", 32, 64, 256, 4, 4, 3, 4, 16), ("wtile", 32, 64, 256, 1, 4, 3), ("xsplit", 32, 32, 256, 1, 4, 3)],
    64: [("wtile", 64, 128, 128, 1, 8, 3), ("wtile", 64, 64, 128, 1, 4, 3), ("xsplit", 64, 64, 128, 1, 4, 3),
         ("mma", 64, 128, 256, 1, 4, 3, 8, 16), ("mma", 64, 128, 128, 8, 4, 3, 8, 16),
         ("mma", 32, 128, 256, 1, 4, 3, 8, 16)],
    128: [("wtile", 128, 128, 64, 1, 8, 3), ("wtile", 64, 128, 128, 1, 8, 3), ("xsplit", 128, 128, 128, 1, 8, 3),
          ("xsplit", 128, 64, 128, 1, 8, 3), ("mma", 64, 128, 256, 1, 4, 3, 8, 16),
          ("mma", 128, 128, 128, 1, 8, 3, 8, 16)],
}
_TUNED: dict[tuple, tuple] = {}
GLUON_SKIPPED: dict[tuple, str] = {}  # (config, M, N, K, value dtype) -> why the Gluon "sp" kernel did not run
TUNE_TIMES: dict[tuple, dict] = {}  # every candidate's median ms, for the benchmark's report


def _m_bucket(m: int) -> int:
    return (1 if m == 1 else 4 if m <= 4 else 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32
            else 64 if m <= 64 else 128)


def _launch(x, values, meta, scale, cfg, out=None, meta_mma=None):
    """out = x @ W^T with config cfg; meta_mma: the weight's MMA-order metadata per WPT (the "sp"
    kernel's; without it those configs fall back like an unsupported Gluon config)."""
    from engine.kernels import sparse24_triton as kernels
    kind, bm, bn, bk, split_k, warps, stages = cfg[:7]
    m, k = x.shape
    n = values.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if kind == "mma":
        return _launch_mma(x, values, meta, scale, cfg, out)
    if kind == "sp":
        from engine.kernels import sparse24_sp_gluon as sp
        reason = "interpreter" if _interpreting() else sp.unsupported(x, values, meta, cfg)
        if reason is None and (meta_mma is None or cfg[3] not in meta_mma):
            reason = "no MMA-order metadata for this WPT"
        if reason is None:
            return sp.launch(x, values, meta_mma[cfg[3]], scale, cfg, out)
        GLUON_SKIPPED[(cfg, m, n, k, values.dtype)] = reason
        return _launch_mma(x, values, meta, scale, _MMA[0], out)
    # Split-K partial sums meet in a zeroed fp32 buffer by atomics; one pass writes `out` directly.
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    kernel = {"fma": kernels.sparse24_fma_kernel, "wtile": kernels.sparse24_wtile_kernel,
              "xsplit": kernels.sparse24_xsplit_kernel}[kind]
    extra = {} if kind == "fma" else {"DOT_FP32": _interpreting()}
    kernel[(triton_cdiv(n, bn), triton_cdiv(m, bm), split_k)](
        x, values, meta, scale if scale is not None else values, y, m, n, k,
        x.stride(0), values.stride(0), meta.stride(0), y.stride(0),
        HAS_SCALE=scale is not None, SPLIT_K=split_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages, **extra)
    if split_k > 1:
        out.copy_(y)
    return out


# (config, K % BLOCK_K == 0, value dtype, scaled, out dtype) -> whether the compiled PTX decode
# has the MMA's A-operand layout.
_MMA_LAYOUT_OK: dict = {}


def _launch_mma(x, values, meta, scale, cfg, out):
    """The word-per-thread MMA kernel: values read as one word per group (int32 for bf16 pairs,
    int16 for e4m3 pairs); split-K reduces in the same launch (engine/kernels/split_k.py)."""
    from engine.kernels import sparse24_triton as kernels
    from engine.kernels.split_k import split_k_buffers
    _, bm, bn, bk, split_k, warps, stages, ch = cfg[:8]
    pack = cfg[8] if len(cfg) > 8 else 16
    m, k = x.shape
    n = values.shape[0]
    fp8 = values.element_size() == 1
    words = values.view(torch.int16 if fp8 else torch.int32)
    grid = (triton_cdiv(n, bn), triton_cdiv(m, bm), split_k)
    acc, count = split_k_buffers(x.device, m * n, grid[0] * grid[1]) if split_k > 1 else (out, out)
    args = (x, words, meta, scale if scale is not None else words, out, acc, count, m, n, k,
            x.stride(0), words.stride(0), meta.stride(0), out.stride(0))
    const = dict(HAS_SCALE=scale is not None, FP8_VALUES=fp8, SPLIT_K=split_k, EVEN_K=k % bk == 0,
                 INTERPRETER=_interpreting(), PTX_PACK=pack, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CH=ch,
                 num_warps=warps, num_stages=stages)
    use_ptx = not _interpreting() and _mma_layout_ok(args, grid, const, out.dtype)
    kernels.sparse24_mma_kernel[grid](*args, USE_PTX=use_ptx, **const)
    return out


def _mma_layout_ok(args, grid, const, out_dtype) -> bool:
    """Whether Triton gave the PTX decode's result the MMA's A-operand layout (bf16 pairs, kWidth
    2), the register order _DECODE_PTX is written for. Triton picks layouts itself; where it
    decodes in another layout and converts afterwards, the PTX would pair the wrong elements, and
    the arithmetic decode runs instead. Checked once per configuration on the compiled kernel."""
    from engine.kernels import sparse24_triton as kernels
    # Triton specializes integer arguments divisible by 16, which can change the layouts it picks.
    key = (tuple(sorted(const.items())), out_dtype, tuple(a % 16 == 0 for a in args if isinstance(a, int)))
    if key not in _MMA_LAYOUT_OK:
        ok = False
        try:
            compiled = kernels.sparse24_mma_kernel.warmup(*args, grid=grid, USE_PTX=True, **const)
            for line in compiled.asm["ttgir"].splitlines():
                if "elementwise_inline_asm" in line and "prmt.b32" in line:
                    result = line.rsplit("->", 1)[-1]
                    ok = "dot_op<{opIdx = 0" in result and "kWidth = 2" in result
        except Exception:  # a configuration the compiler rejects: the arithmetic path reports it
            ok = False
        _MMA_LAYOUT_OK[key] = ok
    return _MMA_LAYOUT_OK[key]


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sparse24_mm(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
                scale: torch.Tensor | None = None, config: tuple | None = None,
                out: torch.Tensor | None = None, meta_mma: dict | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T, W 2:4-compressed (values bf16 or fp8 [N, K/2], meta [N, K/8]),
    times scale[N] per output channel if given, written to `out` if given (contiguous [M, N]);
    meta_mma: {WPT: sparse24_sp_gluon.mma_order_meta(meta, WPT)} for the sparse-MMA kernel
    (`mma_order_metas`). The launch configuration is tuned per (M bucket, N, K, dtypes) on first
    use."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if config is not None:
        return _launch(x, values, meta, scale, config, out, meta_mma)
    bucket = _m_bucket(x.shape[0])
    key = (bucket, values.shape[0], x.shape[1], x.dtype, values.dtype, scale is not None)
    cfg = _tuned(key, _DECODE_CONFIGS[bucket], x, lambda c: _launch(x, values, meta, scale, c, None, meta_mma))
    return _launch(x, values, meta, scale, cfg, out, meta_mma)


# Per (M bucket, N, K): whether the SwiGLU epilogue beat the GEMM + SwiGLU kernel, timed on first
# use. H200, Llama-3.1-8B gate_up, one call after an L2 flush: fused 44.0 us against 43.7 for the
# GEMM alone at M = 1 (the SwiGLU kernel and its launch saved), but 46.5 / 51.3 against 45.3 / 48.1
# at 8 / 16 tokens, where it needs an even number of row blocks per warp and SPLIT_K = 1.
_SWIGLU_FUSED: dict[tuple, bool] = {}


def sparse24_swiglu_mm(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor,
                       meta_mma: dict) -> torch.Tensor | None:
    """silu(gate) * up [M, N/2] of y = x @ W^T, W a 2:4-compressed fused gate/up projection (rows
    [0, N/2) gate, [N/2, N) up, bf16), in one launch of the sparse-MMA kernel (its SwiGLU
    epilogue); None where no candidate configuration of M's bucket can run it, or where the GEMM
    followed by the SwiGLU kernel was faster when timed."""
    from engine.kernels import sparse24_sp_gluon as sp
    from engine.kernels.swiglu import swiglu
    if _interpreting() or not x.is_cuda:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    bucket = _m_bucket(x.shape[0])
    key = (bucket, values.shape[0], x.shape[1])
    if _SWIGLU_FUSED.get(key) is False:
        return None

    def runnable(c):
        return c[3] in meta_mma and sp.swiglu_unsupported(x, values, meta, c) is None

    def run(c):
        out = torch.empty(x.shape[0], values.shape[0] // 2, dtype=x.dtype, device=x.device)
        return sp.launch(x, values, meta_mma[c[3]], None, c, out, swiglu=True)
    cfg = _TUNED.get(("swiglu",) + key)
    if cfg is not None:  # tuned: only this call's operands are checked against the chosen config
        return run(cfg) if runnable(cfg) else None
    candidates = [c for c in _DECODE_CONFIGS.get(bucket, ()) if c[0] == "sp" and runnable(c)]
    if not candidates:
        return None
    cfg = _tuned(("swiglu",) + key, candidates, x, run)
    if key not in _SWIGLU_FUSED and ("swiglu",) + key in _TUNED:
        unfused = _time_ms(lambda: swiglu(sparse24_mm(x, values, meta, meta_mma=meta_mma)))
        _SWIGLU_FUSED[key] = _time_ms(lambda: run(cfg)) <= unfused
        if not _SWIGLU_FUSED[key]:
            return None
    return run(cfg)


def _tuned(key: tuple, candidates: list, x: torch.Tensor, run) -> tuple:
    """The fastest of `candidates` for `key`, timed on first use (run(config) launches one); the
    first candidate, untimed, under the interpreter, off CUDA or during CUDA-graph capture."""
    cfg = _TUNED.get(key)
    if cfg is None:
        if _interpreting() or not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return candidates[0]

        def time(c):
            return _time_ms(lambda: run(c))
        times = {c: time(c) for c in candidates}
        # One timing each picked the slower of two close configurations (1-3 us apart at 16 tokens):
        # the three fastest are timed again and ranked by the mean of both timings.
        for c in sorted(candidates, key=times.get)[:3]:
            times[c] = (times[c] + time(c)) / 2
        TUNE_TIMES[key] = times
        cfg = _TUNED[key] = min(candidates, key=times.get)
    return cfg


def mma_order_metas(t: "Sparse24Tensor") -> dict | None:
    """The sparse-MMA kernel's metadata, {WPT: int32 registers in MMA order} for the WPTs its
    candidates use: on sm_90 with bf16 values (where it runs), else None. The same bytes as meta
    once per WPT (1/8 of the values' bytes each); built with the weight so that the KV cache is
    sized after it."""
    if not (t.values.is_cuda and t.values.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(t.values.device)[0] == 9):
        return None
    from engine.kernels.sparse24_sp_gluon import mma_order_meta
    wpts = sorted({c[3] for cs in _DECODE_CONFIGS.values() for c in cs if c[0] == "sp"})
    return {wpt: mma_order_meta(t.meta, wpt) for wpt in wpts if (t.shape[1] // 8) % (2 * wpt) == 0}


def _time_ms(fn) -> float:
    """Median ms of fn replayed in a CUDA graph (how decode runs), eager where it cannot be
    captured. Eager timing counts the host's launch cost: it picked the CUDA-core kernel for the
    4096 x 14336 down projection at M = 1 (47.5 vs 50.4 us eager), which the MMA kernel beats in
    a graph (35.7 vs 23.4 us, H200)."""
    from triton.testing import do_bench
    try:
        fn()  # compile and allocate (split-K buffers) outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return do_bench(graph.replay, warmup=5, rep=20, return_mode="median")
    except Exception:  # not capturable here: time it eagerly
        torch.cuda.synchronize()
    try:
        return do_bench(fn, warmup=5, rep=20, return_mode="median")
    except Exception:  # a config the compiler or the GPU rejects (shared memory, registers)
        return float("inf")


# ----------------------------------------------------------------------------- prefill paths

_CSLT_ALG: dict[tuple, int] = {}
CSLT_SEARCH_ERRORS: dict[tuple, str] = {}  # layouts whose algorithm search failed (they run alg 0)


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -x.shape[0] % multiple
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def cslt_mm(packed: torch.Tensor, x: torch.Tensor, n: int, contiguous_b: bool = False) -> torch.Tensor:
    """y [M, n] = x @ W^T on cuSPARSELt, W compressed by torch._cslt_compress. The dense operand is
    x^T: a transposed view of x (no copy) or, with contiguous_b, a row-major copy of x^T.
    The algorithm is searched once per (shape, M bucket, layout) and cached."""
    m = x.shape[0]
    xp = _pad_rows(x.contiguous(), 8)
    b = xp.t().contiguous() if contiguous_b else xp.t()
    key = (n, x.shape[1], x.dtype, 1 << (xp.shape[0] - 1).bit_length(), contiguous_b)
    alg = _CSLT_ALG.get(key)
    if alg is None:
        alg = 0
        if not torch.cuda.is_current_stream_capturing():
            try:
                alg = int(torch._cslt_sparse_mm_search(packed, b, transpose_result=True))
            except RuntimeError as e:  # the search failed for this layout: keep the default algorithm
                CSLT_SEARCH_ERRORS[key] = str(e).splitlines()[0][:200]
            _CSLT_ALG[key] = alg
    return torch._cslt_sparse_mm(packed, b, transpose_result=True, alg_id=alg)[:m]


def _sparse_tc_shape(n: int, k: int) -> bool:
    """Shapes the sparse-tensor-core libraries take (cuSPARSELt: N, K multiples of 16 for bf16 and
    32 for fp8; torchao CUTLASS: K multiple of 32): N % 32 == 0 and K % 64 == 0 covers both."""
    return n % 32 == 0 and k % 64 == 0


def _cslt_compress(dense: torch.Tensor) -> torch.Tensor | None:
    if not _sparse_tc_shape(*dense.shape):
        return None
    try:
        return torch._cslt_compress(dense)
    except (RuntimeError, AttributeError):
        return None  # no cuSPARSELt in this build, or this dtype/shape is unsupported


def _values_view(packed: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """`values` itself, or the identical plain-order prefix of cuSPARSELt's buffer (then stored once)."""
    if packed is None:
        return values
    prefix = packed.reshape(-1)[: values.numel()]
    if prefix.dtype == values.dtype and torch.equal(prefix.view(torch.uint8), values.reshape(-1).view(torch.uint8)):
        return prefix.view(values.shape)
    return values


def _torchao_sparse_fp8():
    try:
        import torchao.ops as ops
        return ops.to_sparse_semi_structured_cutlass_sm9x_f8, ops.rowwise_scaled_linear_sparse_cutlass_f8f8
    except (ImportError, AttributeError):
        return None


# ----------------------------------------------------------------------------- dispatch

# Per (N, K, M bucket): "decode" (Triton) or "prefill" (cuSPARSELt) for bf16 2:4, measured on first
# sight of a bucket, in a CUDA graph (_time_ms): eagerly cuSPARSELt pays ~0.5 ms of host work per
# call (descriptor and plan set up on every call), which a graph removes. Measured on an H200 at the
# Llama-3.1-8B FFN shapes in graphs: the MMA decode kernel wins at M = 1 and 16 (gate_up 52 vs
# 89-96 us, down 32 vs 60-64 us, one call after an L2 flush).
_PATH: dict[tuple, str] = {}
# Capture with no timing yet: the Triton decode kernels up to M = 16 (the MMA kernel costs the same
# at M = 1 and 16: it streams the weight once per 16 rows of x), cuSPARSELt above.
DECODE_MAX_M = 16


def _dispatch_bucket(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def _choose(kind: tuple, x: torch.Tensor, decode, prefill):
    m = x.shape[0]
    key = kind + (_dispatch_bucket(m),)
    path = _PATH.get(key)
    if path is None:
        if torch.cuda.is_current_stream_capturing():
            return decode(x) if m <= DECODE_MAX_M else prefill(x)
        t_dec, t_pre = _time_ms(lambda: decode(x)), _time_ms(lambda: prefill(x))
        path = _PATH[key] = "decode" if t_dec <= t_pre else "prefill"
    return decode(x) if path == "decode" else prefill(x)


# ----------------------------------------------------------------------------- backends

class Sparse24Weight(LinearBackend):
    """bf16 2:4 weight. CPU: reference matmul. CUDA: Triton decode kernel or cuSPARSELt, by measurement."""
    name = "2:4"

    def __init__(self, t: Sparse24Tensor):
        self.out_features, self.in_features = t.shape
        self.meta = t.meta
        self.packed = None
        if t.values.is_cuda:
            self.packed = _cslt_compress(decompress_24(t))
        self.values = _values_view(self.packed, t.values)
        self.meta_mma = mma_order_metas(t)

    @classmethod
    def from_dense(cls, w: torch.Tensor, score: torch.Tensor | None = None) -> "Sparse24Weight":
        if not is_24_sparse(w):  # a checkpoint that is already 2:4 is kept exactly
            w = prune_24(w, score)
        return cls(compress_24(w))

    @property
    def tensor(self) -> Sparse24Tensor:
        return Sparse24Tensor(self.values, self.meta, (self.out_features, self.in_features))

    def decode(self, x):
        return sparse24_mm(x, self.values, self.meta, meta_mma=self.meta_mma)

    def swiglu_forward(self, x):
        """silu(gate) * up in the GEMM's epilogue at decode sizes (sparse24_swiglu_mm), else None."""
        if self.meta_mma is None or x.shape[0] > DECODE_MAX_M:
            return None
        return sparse24_swiglu_mm(x, self.values, self.meta, self.meta_mma)

    def prefill(self, x):
        return cslt_mm(self.packed, x, self.out_features)

    def forward(self, x):
        if not x.is_cuda:
            return sparse24_linear_ref(x, self.tensor)
        if self.packed is None:
            return self.decode(x)
        return _choose(("bf16", self.out_features, self.in_features), x, self.decode, self.prefill)

    def dequantize(self):
        return decompress_24(self.tensor)

    def weight_bytes(self):
        return self.tensor.nbytes()


class Sparse24Fp8Weight(LinearBackend):
    """2:4 weight with e4m3 values and a per-output-channel fp32 scale.
    All M: torchao's CUTLASS sm90 2:4 FP8 GEMM (sparse wgmma) with per-token activation scales (the
    activations arrive quantised by the fused RMSNorm / SwiGLU kernels, see input_quant, or are
    quantised here in one Triton pass). Where torchao's kernel is missing: the Triton kernels, fp8 values
    widened in registers (activations stay bf16). cuSPARSELt FP8 is not an option here: on torch
    2.11 its per-channel alpha (CUSPARSELT_MATMUL_ALPHA_VECTOR_SCALING) fails, 'operation not supported'."""
    name = "2:4+fp8"

    def __init__(self, t: Sparse24Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
        self.out_features, self.in_features = t.shape
        self.meta, self.scale, self.dtype = t.meta, scale.float().contiguous(), dtype
        self.packed = self.ao_meta = None
        values = t.values
        ao = _torchao_sparse_fp8()
        sm90 = values.is_cuda and torch.cuda.get_device_capability(values.device)[0] == 9
        if sm90 and ao is not None and _sparse_tc_shape(*t.shape):  # the kernel is built for sm90 only
            try:
                self.packed, self.ao_meta = ao[0](decompress_24(t))
                values = _values_view(self.packed, values)
            except RuntimeError:
                self.packed = None  # a shape or build the kernel does not take
        self.values = values

    @classmethod
    def from_dense(cls, w: torch.Tensor, score: torch.Tensor | None = None) -> "Sparse24Fp8Weight":
        if not is_24_sparse(w):  # a checkpoint that is already 2:4 is kept exactly
            w = prune_24(w, score)
        t = compress_24(w)
        q, scale = quantize_rows_fp8(t.values)
        return cls(Sparse24Tensor(q, t.meta, t.shape), scale, w.dtype)

    @property
    def tensor(self) -> Sparse24Tensor:
        return Sparse24Tensor(self.values, self.meta, (self.out_features, self.in_features))

    def decode(self, x):
        return sparse24_mm(x, self.values, self.meta, self.scale)

    @property
    def input_quant(self) -> str | None:
        """"fp8" where torchao's kernel runs: the fused RMSNorm / SwiGLU kernels then hand over e4m3
        activations with per-token scales, and no separate quantisation pass reads them again. The
        weight-only Triton kernels take bf16 activations."""
        return "fp8" if self.packed is not None else None

    def prefill(self, x, x_scale=None):
        if x_scale is None:
            (q, s), out_dtype = quantize_act_fp8(x), x.dtype
        else:
            q, s, out_dtype = x, x_scale.reshape(-1).float(), self.dtype
        return _torchao_sparse_fp8()[1](q, s, self.packed, self.ao_meta, self.scale, None, out_dtype)

    def forward(self, x, x_scale=None):
        """x bf16 [M, K], or e4m3 [M, K] with its per-token fp32 scale [M] (see input_quant)."""
        if x_scale is not None and self.packed is None:  # nothing here takes e4m3 activations
            x, x_scale = (x.float() * x_scale.float().reshape(-1, 1)).to(self.dtype), None
        if not x.is_cuda:
            return sparse24_linear_ref(x, self.tensor, self.scale)
        # Measured on an H200 at both Llama-8B FFN shapes, the CUTLASS kernel (with the activation
        # quantization) beats the weight-only Triton kernels at every M from 1 to 8192, so there is
        # nothing to time: Triton runs only where torchao's kernel is missing.
        return self.prefill(x, x_scale) if self.packed is not None else self.decode(x)

    def dequantize(self):
        return (decompress_24(self.tensor, torch.float32) * self.scale[:, None]).to(self.dtype)

    def weight_bytes(self):
        return self.tensor.nbytes() + self.scale.numel() * 4

