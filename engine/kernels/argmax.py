"""The argmax of each row of a step's logits, for greedy decoding and the sampler's exponential race.

`argmax(x)`: x fp32, bf16 or fp16 [B, V] (unit stride along V) -> int64 [B], the index of each
row's largest value and, among equal values, the first, as torch.argmax: +0.0 and -0.0 are equal,
and a NaN is larger than any number (the first NaN wins). `argmax_ref` is torch.argmax.

Why a kernel: torch reduces each of a decode step's few 128K-wide rows in one block, so a few SMs
read what all of them could (BENCHMARKS.md, "Where a decode step's GPU time goes", has the times).
Here each row is split over programs of ARGMAX_CHUNK values, and a second launch reduces their
(key, index) pairs.
The comparison runs on integer keys: the float's bits with the magnitude bits of negative numbers
flipped order as the floats do, exactly, with -0.0 folded onto +0.0 and every NaN onto the largest
key; ties resolve to the lowest index in both passes.

Triton on CUDA tensors (or everywhere under TRITON_INTERPRET=1), the reference otherwise.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the references run
    triton = None

from engine.kernels.platform import jit, triton_runs

ARGMAX_CHUNK = 4096     # values per program of the first pass: 32 programs a 128K-wide row
KEYED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # exact in fp32, whose bits make the key


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(-1)


@jit
def _order_key(x):
    """int32 keys that order as the floats x do (module docstring)."""
    x = x.to(tl.float32) + 0.0                      # -0.0 + 0.0 is +0.0
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)        # arithmetic shift: flips negatives' magnitudes
    return tl.where(x != x, 0x7FFFFFFF, key)


@jit
def _argmax_partial_kernel(x_ptr, key_ptr, idx_ptr, V, x_stride, CHUNKS,
                           CHUNK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + cols, mask=cols < V, other=0.0)
    # Past V: the smallest int32, which no float's key is (it would be a negative NaN's).
    key = tl.where(cols < V, _order_key(x), -2147483648)
    best, where = tl.max(key, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(key_ptr + row * CHUNKS + chunk, best)
    tl.store(idx_ptr + row * CHUNKS + chunk, chunk * CHUNK + where)


@jit
def _argmax_final_kernel(key_ptr, idx_ptr, out_ptr, CHUNKS, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    key = tl.load(key_ptr + row * CHUNKS + j, mask=j < CHUNKS, other=-2147483648)
    # The first chunk holding the row's largest key holds its first occurrence.
    _, first = tl.max(key, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * CHUNKS + first).to(tl.int64))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first largest value's index (module docstring)."""
    if not triton_runs(x) or x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in KEYED_DTYPES:
        return argmax_ref(x)
    b, v = x.shape
    if v == 0:
        return argmax_ref(x)     # torch's error for an empty row
    chunks = triton.cdiv(v, ARGMAX_CHUNK)
    keys = torch.empty(b, chunks, dtype=torch.int32, device=x.device)
    idx = torch.empty(b, chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b:
        _argmax_partial_kernel[(b, chunks)](x, keys, idx, v, x.stride(0), chunks, CHUNK=ARGMAX_CHUNK, num_warps=8)
        _argmax_final_kernel[(b,)](keys, idx, out, chunks, BLOCK=max(triton.next_power_of_2(chunks), 16),
                                   num_warps=1)
    return out


__all__ = ["argmax", "argmax_ref"]
