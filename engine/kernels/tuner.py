"""The one tuner: times an op's candidate (kernel, config) pairs once, before serving, and
remembers the winner on disk.

`Tuner.best(problem, candidates)` returns the (kernel name, config) to run `problem`'s M bucket:
from the cache where an entry matches, else by timing every candidate (`graph_time_ms`: CUDA-graph
replays, each after L2 is filled with clean lines, the median of 30; the three fastest timed again
and ranked by the mean of both timings, since configurations a few microseconds apart can swap
places in one timing), then saved.

The cache is one JSON file, `$MICROENGINE_CACHE_DIR/tuning.json` (default
`~/.cache/microengine/tuning.json`). An entry's key holds the device name, the torch / Triton /
CuTe DSL versions, the op, N, K, the M bucket and the op's detail: a new driver stack or another
GPU never reuses a stale winner. A file that cannot be read is ignored with a warning and
rewritten on the next save.

The engine tunes when it starts (Engine.__init__, before graph capture), for the M buckets it will
run; nothing times, synchronises or captures once serving has begun. `enabled=False` (`--tune
off`) times nothing and leaves every op on its list's defaults; cached entries are still used.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import warnings
from pathlib import Path
from typing import Callable

import torch

from engine.kernels.platform import capture, device_name, library_versions
from engine.kernels.select import Problem, m_bucket

log = logging.getLogger("microengine.kernels")


def default_cache_path() -> Path:
    root = os.environ.get("MICROENGINE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "microengine")
    return Path(root) / "tuning.json"


def event_ms(fn: Callable[[], object], rep: int = 60, warmup: int = 10, before=None) -> float:
    """Median ms of fn() between CUDA events, over `rep` calls after `warmup` untimed ones; each
    call after before() where given (outside the events)."""
    times = []
    for i in range(warmup + rep):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def l2_filler() -> torch.Tensor:
    """256 MB on the GPU: reading it (`.sum()`) fills L2 with clean lines (graph_time_ms says why
    clean, not dirty)."""
    return torch.ones(1 << 26, dtype=torch.int32, device="cuda")


def graph_time_ms(fn: Callable[[], object]) -> float:
    """Median ms of fn as a decode step runs it: replayed in a CUDA graph (eager where it cannot be
    captured), its operands in HBM; inf for a configuration the compiler or the GPU rejects.

    Before each call a 256 MB read fills L2 with clean lines, so fn finds its weight in HBM and
    nothing dirty to write back, as a step's GEMM does. (triton.testing.do_bench zeroes its buffer
    instead: the timed kernel then pays the write-back of up to an L2 of dirty lines, which ranked
    the NVFP4 decode kernels otherwise than the step runs them: BENCHMARKS.md, "The kernel layer".)"""
    try:
        fn()  # compile and allocate outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with capture(graph):
            fn()
        call = graph.replay
    except Exception:  # not capturable here: time it eagerly
        torch.cuda.synchronize()
        call = fn
    try:
        flush = l2_filler()   # freed on return
        return event_ms(call, rep=30, warmup=5, before=flush.sum)
    except Exception:
        return float("inf")


class Tuner:
    def __init__(self, path: str | Path | None = None, enabled: bool = True,
                 timer: Callable[[Callable], float] = graph_time_ms):
        self.path = Path(path) if path is not None else default_cache_path()
        self.enabled = enabled
        self.timer = timer
        self.entries = self._read()
        self.timed = 0      # candidates timed by this tuner (0 when everything came from the cache)

    def _read(self) -> dict:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
                raise ValueError("no 'entries' object")
            return data["entries"]
        except (OSError, ValueError) as e:
            warnings.warn(f"tuning cache {self.path} is unreadable ({e}); ignoring it", RuntimeWarning)
            return {}

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"entries": self.entries}, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as e:  # a read-only home: tuning still applies to this run
            log.warning("could not write the tuning cache %s: %s", self.path, e)

    @staticmethod
    def key(problem: Problem) -> str:
        return json.dumps({"device": device_name(problem.device), **library_versions(), "op": problem.op,
                           "n": problem.n, "k": problem.k, "m_bucket": m_bucket(problem.m),
                           "detail": [str(d) for d in problem.detail]}, sort_keys=True)

    def best(self, problem: Problem, candidates: Callable[[], list[tuple[str, object, Callable[[], object]]]]):
        """(kernel name, config) for problem's M bucket. candidates() lists (name, config, run), run()
        launching that candidate once on sample operands; it is called only when nothing is cached.
        None where nothing is cached and tuning is off or there is nothing to choose."""
        entry = self.entries.get(self.key(problem))
        if entry is not None:
            return entry["kernel"], _hashable(entry["config"])
        if not self.enabled:
            return None
        listed = candidates()
        if len(listed) < 2:
            return None
        times = {i: self.timer(run) for i, (_, _, run) in enumerate(listed)}
        for i in sorted(times, key=times.get)[:3]:
            times[i] = (times[i] + self.timer(listed[i][2])) / 2
        self.timed += len(listed) + min(3, len(listed))
        best = min(times, key=times.get)
        name, config, _ = listed[best]
        self.entries[self.key(problem)] = {"kernel": name, "config": config, "ms": times[best]}
        return name, _hashable(config)


def _hashable(config):
    """JSON gives lists back: configs are compared and cached as tuples."""
    if isinstance(config, (list, tuple)):
        return tuple(_hashable(c) for c in config)
    return config
