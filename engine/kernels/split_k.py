"""Scratch memory for split-K decode kernels that finish their reduction in the same launch.

A decode GEMM (M <= 16) whose N alone leaves SMs idle splits K across programs. Instead of a
zeroed fp32 buffer plus a second kernel (a memset, the GEMM, a cast: three launches, which cost
more than the GEMM itself at 4096-wide shapes), each program stores its partial sums in its own
slot of a persistent fp32 scratch (one slot per K split), counts its arrival per output tile, and
the last program of a tile sums the slots in split order, writes the output and resets the
counter. The fixed order makes the result the same bits on every run, which partial sums added
with atomics (in arrival order) are not once three or more splits meet.

`split_k_arrive` and `split_k_take` are that protocol, for the kernels to call (`first` the
partials' addresses in slot 0, `slot` the distance between slots, at least M x N):

    if split_k_arrive(acc, first + pid_k * slot, mask, counter_ptr, SPLIT_K):   # came last
        total = split_k_take(first, slot, mask, counter_ptr, SPLIT_K)       # the ordered sum
        ... write the output from `total` ...

The buffers are allocated once per device (grown, never freed, so a CUDA graph captured with
them stays valid); the counters are zero between calls. Two split-K calls running concurrently on
different streams would share them: the engine runs its GEMMs on one stream.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BUFFERS: dict = {}
_RETIRED: list = []  # outgrown buffers, kept alive for graphs captured with them


def split_k_buffers(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 scratch of at least `floats` (SPLIT_K slots), int32 counters of at least `tiles` zeros)."""
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
def split_k_arrive(acc, slot_ptrs, mask, counter_ptr, SPLIT_K: tl.constexpr):
    """Store this program's partial sums `acc` at `slot_ptrs` (its K split's slot) and count its
    arrival at its tile's counter; true in the program that arrives last."""
    tl.store(slot_ptrs, acc, mask=mask)
    # Every thread's stores come before the counter's release (the barrier), and the last
    # program's reads after its acquire.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    tl.debug_barrier()
    return arrived == SPLIT_K - 1


@triton.jit
def split_k_take(first_ptrs, slot, mask, counter_ptr, SPLIT_K: tl.constexpr):
    """In the last program of a tile: the sum of the SPLIT_K slots in split order; resets the
    counter."""
    total = tl.load(first_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):
        total += tl.load(first_ptrs + s * slot, mask=mask, other=0.0, cache_modifier=".cg")
    tl.store(counter_ptr, 0)
    return total
