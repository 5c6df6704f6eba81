"""CUDA-graph timing shared by the per-kernel benchmarks.

A kernel of a few microseconds timed by events around eager launches measures the launch; captured
in a CUDA graph, many calls replay back to back and the events bracket only the GPU's work.
"""
from __future__ import annotations

import math
import statistics

import torch


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
    with torch.cuda.graph(graph):
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
