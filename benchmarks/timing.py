"""Timing shared by the per-kernel benchmarks.

`time_graph`: a kernel of a few microseconds timed by events around eager launches measures the
launch; captured in a CUDA graph, many calls replay back to back and the events bracket only the
GPU's work.

`event_ms`: one call at a time between CUDA events (a captured graph's replay, say).
`cold_ms`: the same, each call after `evict_l2`, so its operands come from HBM. The eviction
reads 256 MB, as the tuner's timer does before each call (engine/kernels/tuner.py).
"""
from __future__ import annotations

import math
import statistics

import torch

from engine.kernels.platform import capture
from engine.kernels.tuner import event_ms, l2_filler


def time_graph(fn, args, replays: int = 15, min_calls: int = 20) -> float:
    """Median seconds per call of fn(a), a rotating over `args` (operand sets or copy indices, so
    that the operands can exceed L2), from replays of one graph of at least `min_calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for a in args:  # warm-up: compiles, autotunes, cuBLAS handles and workspaces, outside the capture
            fn(a)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    rounds = max(1, math.ceil(min_calls / len(args)))
    graph = torch.cuda.CUDAGraph()
    with capture(graph):      # (Triton kernels under either allocator)
        for _ in range(rounds):
            for a in args:
                fn(a)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / (rounds * len(args)))
    return statistics.median(times)


_EVICT: list = []


def evict_l2() -> None:
    """Fill L2 with clean lines of a 256 MB buffer, kept for the process (read, not written: nothing
    to write back; engine/kernels/tuner.py graph_time_ms says why that matters)."""
    if not _EVICT:
        _EVICT.append(l2_filler())
    _EVICT[0].sum()


def cold_ms(fn, rep: int = 60, warmup: int = 10) -> float:
    """Median ms of fn() between CUDA events, each call after evict_l2()."""
    return event_ms(fn, rep, warmup, before=evict_l2)
