"""Scratch memory for split-K decode kernels that finish their reduction in the same launch.

A decode GEMM (M <= 16) whose N alone leaves SMs idle splits K across programs. Instead of a
zeroed fp32 buffer plus a second kernel (a memset, the GEMM, a cast: three launches, which cost
more than the GEMM itself at 4096-wide shapes), the kernels add their partial sums into a
persistent fp32 accumulator with atomics, count the arrivals per output tile, and the last program
of a tile writes the output and returns the accumulator and its counter to zero.

The buffers are allocated once per device (grown, never freed, so a CUDA graph captured with
them stays valid) and are zero between calls. Two split-K calls running concurrently on different
streams would share them: the engine runs its GEMMs on one stream.
"""
from __future__ import annotations

import torch

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
