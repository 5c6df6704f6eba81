"""Scratch memory for split-K decode kernels that finish their reduction in the same launch.

A decode GEMM (M <= 16) whose N alone leaves SMs idle splits K across programs. Instead of a
zeroed fp32 buffer plus a second kernel (a memset, the GEMM, a cast: three launches, which cost
more than the GEMM itself at 4096-wide shapes), the kernels add their partial sums into a
persistent fp32 accumulator with atomics, count the arrivals per output tile, and the last program
of a tile writes the output and returns the accumulator and its counter to zero.

`split_k_arrive` and `split_k_take` are that protocol, for the kernels to call:

    if split_k_arrive(acc, acc_ptrs, mask, counter_ptr, SPLIT_K):   # this program came last
        total = split_k_take(acc_ptrs, mask, counter_ptr)           # the sum; scratch zero again
        ... write the output from `total` ...

The buffers are allocated once per device (grown, never freed, so a CUDA graph captured with
them stays valid) and are zero between calls. Two split-K calls running concurrently on different
streams would share them: the engine runs its GEMMs on one stream.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BUFFERS: dict = {}
_RETIRED: list = []  # outgrown buffers, kept alive for graphs captured with them


def split_k_buffers(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 accumulator of at least `floats` zeros, int32 counters of at least `tiles` zeros)."""
    acc, count = _BUFFERS.get(device, (None, None))
    if acc is None or acc.numel() < floats or count.numel() < tiles:
        if acc is not None:
            _RETIRED.append((acc, count))
        floats = max(floats, 1 << 19, 0 if acc is None else 2 * acc.numel())
        tiles = max(tiles, 1 << 12, 0 if count is None else 2 * count.numel())
        acc = torch.zeros(floats, device=device, dtype=torch.float32)
        count = torch.zeros(tiles, device=device, dtype=torch.int32)
        _BUFFERS[device] = (acc, count)
    return acc, count


@triton.jit
def split_k_arrive(acc, acc_ptrs, mask, counter_ptr, SPLIT_K: tl.constexpr):
    """Add this program's partial sums `acc` into the accumulator at `acc_ptrs` and count its
    arrival at its tile's counter; true in the program that arrives last."""
    tl.atomic_add(acc_ptrs, acc, mask=mask, sem="relaxed")
    # Every thread's adds come before the counter's release (the barrier), and the last
    # program's reads after its acquire.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    tl.debug_barrier()
    return arrived == SPLIT_K - 1


@triton.jit
def split_k_take(acc_ptrs, mask, counter_ptr):
    """In the last program of a tile: the summed accumulator; leaves it and the counter zero."""
    total = tl.load(acc_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    # The zeroing store may run in another layout than the load (other threads, same addresses):
    # every read first.
    tl.debug_barrier()
    tl.store(acc_ptrs, tl.zeros_like(total), mask=mask)
    tl.store(counter_ptr, 0)
    return total
