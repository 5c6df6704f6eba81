"""Kernel selection: one ordered list of implementations per op, one place that picks from it.

An op (the FP8 GEMM, the NVFP4 GEMM, the 2:4 GEMM, ..., the decode and prefill attention) has,
per GPU architecture, a list of `Kernel`s in priority order, written in its weight format's module
(engine/formats; the attention's in engine/kernels/attention.py) as a table {capability major:
[Kernel, ...], "other": [...]}; the CPU and architectures the table does not name take "other".
Each kernel says whether it can run and why not: the largest M it takes and a `check` of the
operands (shapes, dtypes, storage, libraries). `select` returns the first kernel that can run, or
the one the tuner chose for this M bucket where that one can run, with its launch configuration.

The choice is cached per (op, architecture, M bucket, N, K, detail): every later call is one dict
lookup. It is logged once per such key. A CUDA call that ends on the reference warns once, with
every skipped kernel's reason; an op with no kernel that can run raises ValueError with them.

M buckets are powers of two (1, 2, 4, ...): every M limit in a kernel list is a power of two,
so a bucket never straddles one.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.kernels.platform import arch_name, capability

log = logging.getLogger("microengine.kernels")


@dataclass(frozen=True)
class Problem:
    """One GEMM-like call: M rows of activations against an [N, K] weight on `device` (for the
    attention: M query rows, N query heads, K their dimension); `detail` holds what else a kernel
    may depend on (value dtype, storage order, ...), hashable."""
    op: str
    m: int
    n: int
    k: int
    device: torch.device
    detail: tuple = ()


@dataclass(frozen=True)
class Kernel:
    """One implementation of an op.

    max_m: the largest M it takes. check(problem): None, or why these operands do not fit.
    configs(problem): its launch configurations, the default first (None: one, `None`).
    run: the op's call, plus `config=`. reference: the PyTorch reference (runs anywhere, warns
    on CUDA); needs_cuda: False for portable calls (torch's own GEMM). input_quant: the form of
    the activations it multiplies, None (the model dtype) or "fp8" (e4m3 with a per-token scale),
    so that the norm or SwiGLU before the GEMM can write them in that form (WeightFormat)."""
    name: str
    run: Callable
    max_m: int | None = None
    check: Callable[[Problem], str | None] | None = None
    configs: Callable[[Problem], list] | None = None
    reference: bool = False
    needs_cuda: bool = True
    input_quant: str | None = None

    def why_not(self, problem: Problem, cap: tuple[int, int] | None) -> str | None:
        if cap is None and self.needs_cuda and not self.reference:
            return "needs a CUDA device"
        if self.max_m is not None and problem.m > self.max_m:
            return f"takes M <= {self.max_m}"
        return self.check(problem) if self.check is not None else None

    def config_list(self, problem: Problem) -> list:
        return self.configs(problem) if self.configs is not None else [None]


@dataclass
class Choice:
    kernel: Kernel
    config: object
    skipped: dict[str, str] = field(default_factory=dict)


def m_bucket(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


_CHOSEN: dict[tuple, Choice] = {}


def kernels_for(table: dict, cap: tuple[int, int] | None) -> list[Kernel]:
    return table.get(cap[0], table["other"]) if cap is not None else table["other"]


def select(table: dict, problem: Problem, tuned: dict | None = None) -> Choice:
    """The kernel (and config) that runs `problem`: the tuned one for its M bucket where given and
    able to run, else the first of its architecture's list that can. `tuned`: {bucket: (kernel
    name, config)}."""
    bucket = m_bucket(problem.m)
    cap = capability(problem.device)
    pick = tuned.get(bucket) if tuned else None
    key = (problem.op, cap, bucket, problem.n, problem.k, problem.detail, problem.device.type, pick)
    choice = _CHOSEN.get(key)
    if choice is not None:
        return choice
    # The bucket's largest M decides (so one choice serves the whole bucket), and this M too.
    probe = Problem(problem.op, bucket, problem.n, problem.k, problem.device, problem.detail)
    kernels = kernels_for(table, cap)
    reasons = {k.name: k.why_not(probe, cap) or k.why_not(problem, cap) for k in kernels}
    able = [k for k in kernels if reasons[k.name] is None]
    tuned_kernel = next((k for k in able if pick is not None and k.name == pick[0]), None)
    if tuned_kernel is not None:
        choice = Choice(tuned_kernel, pick[1], {})
    elif able:
        skipped = {}
        for k in kernels:
            if k is able[0]:
                break
            skipped[k.name] = reasons[k.name]
        choice = Choice(able[0], able[0].config_list(probe)[0], skipped)
    else:
        skipped = reasons
        raise ValueError(f"{problem.op}: no kernel can run M={problem.m}, N={problem.n}, K={problem.k} "
                         f"on {arch_name(cap)}: " + "; ".join(f"{k}: {r}" for k, r in skipped.items()))
    _log_once(problem, cap, bucket, choice)
    _CHOSEN[key] = choice
    return choice


def runnable(table: dict, problem: Problem) -> list[tuple[Kernel, object]]:
    """Every (kernel, config) that can run `problem`'s bucket: what the tuner times."""
    probe = Problem(problem.op, m_bucket(problem.m), problem.n, problem.k, problem.device, problem.detail)
    cap = capability(problem.device)
    kernels = kernels_for(table, cap)
    return [(k, c) for k in kernels if not k.reference and k.why_not(probe, cap) is None
            and k.why_not(problem, cap) is None for c in k.config_list(probe)]


def _log_once(problem: Problem, cap, bucket: int, choice: Choice) -> None:
    where = f"{problem.op} [{arch_name(cap)}, M<={bucket}, N={problem.n}, K={problem.k}]"
    skipped = ", ".join(f"{k}: {r}" for k, r in choice.skipped.items())
    log.info("%s: %s%s", where, choice.kernel.name, f" (skipped {skipped})" if skipped else "")
    if choice.kernel.reference and problem.device.type == "cuda":
        warnings.warn(f"{where} runs the PyTorch reference on CUDA: {skipped or 'no kernel listed'}",
                      RuntimeWarning, stacklevel=3)


def clear_cache() -> None:
    """Forget every choice (tests that fake a capability)."""
    _CHOSEN.clear()
