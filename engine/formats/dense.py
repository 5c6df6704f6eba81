"""Dense weights in the model dtype, and the dense GEMM's kernel lists.

y = x @ W^T with W [N, K] as loaded, in the model dtype, fp32 accumulation.

The dense GEMM, per architecture (engine/kernels/select.py):
- sm_90: M <= 16 the Triton weight-streaming kernel (engine/kernels/stream_triton.py), which also
  forms SwiGLU in its epilogue for a fused gate/up weight, and takes the RMSNorm between two such
  GEMMs out of its own launch (`norm_handoff`); larger M torch's GEMM (cuBLAS). The tuner times
  the streaming kernel's configurations against cuBLAS at engine start, per M bucket.
- anything else (the CPU, other GPUs): torch's GEMM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.formats.base import WeightFormat
from engine.kernels.platform import sm_count_or_default
from engine.kernels.select import Kernel, Problem, m_bucket, runnable, select

MAX_M = 16   # engine/kernels/stream_triton.py's MAX_M (that module needs Triton to import)


def _torch_linear(x, w, config=None):
    return F.linear(x, w)


def _stream(x, w, config=None, swiglu=False):
    from engine.kernels.stream_triton import stream_matmul
    return stream_matmul(x if x.stride(-1) == 1 else x.contiguous(), w, config=config, swiglu=swiglu)


def _stream_fits(p: Problem) -> str | None:
    w_dtype, x_dtype, contiguous = p.detail
    if w_dtype != x_dtype or w_dtype not in (torch.bfloat16, torch.float16):
        return f"takes bf16 or fp16 weights and activations of one dtype, not {w_dtype} and {x_dtype}"
    if not contiguous:
        return "reads a contiguous weight"
    if p.k % 64:
        return "needs K % 64 == 0"
    if p.op == "dense_swiglu" and p.n % 2:
        return "a fused gate/up weight has an even row count"
    return None


def _stream_configs(p: Problem) -> list:
    from engine.kernels.stream_triton import stream_configs
    swiglu = p.op == "dense_swiglu"
    return stream_configs(p.n // 2 if swiglu else p.n, p.k, sm_count_or_default(p.device), swiglu)


TORCH = Kernel("torch_linear", _torch_linear, needs_cuda=False)
TRITON_STREAM = Kernel("triton_stream", _stream, max_m=MAX_M, check=_stream_fits, configs=_stream_configs)
DENSE_GEMM = {9: [TRITON_STREAM, TORCH], "other": [TORCH]}

# silu(gate) * up of a fused gate/up weight in the streaming kernel's epilogue; "separate": the GEMM,
# then the SwiGLU kernel (Linear.swiglu).
SEPARATE = Kernel("separate", None, needs_cuda=False)
DENSE_SWIGLU = {
    9: [Kernel("triton_stream_swiglu", lambda x, w, config=None: _stream(x, w, config, swiglu=True),
               max_m=MAX_M, check=_stream_fits, configs=_stream_configs), SEPARATE],
    "other": [SEPARATE]}


class DenseWeight(WeightFormat):
    name = "bf16"

    def __init__(self, weight: torch.Tensor):
        super().__init__(*weight.shape)
        self.register_buffer("weight", weight)

    @classmethod
    def from_dense(cls, w: torch.Tensor) -> "DenseWeight":
        return cls(w)

    def _problem(self, op: str, m: int, x_dtype: torch.dtype) -> Problem:
        w = self.weight
        return Problem(op, m, self.out_features, self.in_features, w.device, (w.dtype, x_dtype, w.is_contiguous()))

    def forward(self, x, x_scale=None):
        if torch.compiler.is_compiling():   # the compiler sees torch's op
            return F.linear(x, self.weight)
        choice = select(DENSE_GEMM, self._problem("dense_gemm", x.shape[0], x.dtype), self.tuned.get("dense_gemm"))
        return choice.kernel.run(x, self.weight, config=choice.config)

    def swiglu_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        if torch.compiler.is_compiling():
            return None
        choice = select(DENSE_SWIGLU, self._problem("dense_swiglu", x.shape[0], x.dtype), self.tuned.get("dense_swiglu"))
        return None if choice.kernel.run is None else choice.kernel.run(x, self.weight, config=choice.config)

    def _streaming(self, m: int, swiglu: bool):
        """The streaming kernel's choice at M rows where it is the one selected, else None."""
        if torch.compiler.is_compiling() or not 0 < m <= MAX_M:
            return None
        op, table = ("dense_swiglu", DENSE_SWIGLU) if swiglu else ("dense_gemm", DENSE_GEMM)
        choice = select(table, self._problem(op, m, self.weight.dtype), self.tuned.get(op))
        return choice if choice.kernel.name in ("triton_stream", "triton_stream_swiglu") else None

    def norm_handoff(self, m: int, swiglu: bool = False) -> bool:
        return self._streaming(m, swiglu) is not None

    def norm_out_forward(self, x, residual, norm_weight):
        from engine.kernels.stream_triton import norm_parts, stream_matmul_norm_out
        m = x.shape[0]
        xg, parts = torch.empty_like(residual), norm_parts(self.out_features, x.device)
        stream_matmul_norm_out(x if x.stride(-1) == 1 else x.contiguous(), self.weight, residual,
                               norm_weight, xg, parts, self._streaming(m, False).config)
        return xg, parts

    def row_scaled_forward(self, xg, parts, eps, swiglu=False):
        from engine.kernels.stream_triton import stream_matmul_row_scaled
        return stream_matmul_row_scaled(xg, self.weight, parts, eps, self._streaming(xg.shape[0], swiglu).config,
                                        swiglu)

    def tune(self, tuner, m_values: list[int], swiglu: bool = False) -> None:
        """Time the streaming kernel's configurations against cuBLAS for each M up to 16. For a fused
        gate/up weight, first its SwiGLU epilogue against the GEMM plus the SwiGLU kernel; the plain
        GEMM is then timed only where the latter won, the one case in which it runs."""
        from engine.kernels.swiglu import swiglu as swiglu_kernel
        w = self.weight
        if w.device.type != "cuda":
            return      # torch's GEMM is all there is
        ops = ([("dense_swiglu", DENSE_SWIGLU)] if swiglu else []) + [("dense_gemm", DENSE_GEMM)]
        for m in m_values:
            # sample activations to time on (none past MAX_M: only torch's GEMM runs there)
            x = torch.randn(m, self.in_features, device=w.device, dtype=w.dtype) * 0.1 if m <= MAX_M else None
            for op, table in ops:
                problem = self._problem(op, m, w.dtype)
                if x is not None:
                    def candidates(table=table, problem=problem, x=x, separate=op == "dense_swiglu"):
                        listed = [(k.name, c, lambda k=k, c=c: k.run(x, w, config=c))
                                  for k, c in runnable(table, problem) if k.run is not None]
                        if separate and listed:
                            listed.append((SEPARATE.name, None, lambda: swiglu_kernel(F.linear(x, w))))
                        return listed
                    pick = tuner.best(problem, candidates)
                    if pick is not None:
                        self.tuned.setdefault(op, {})[m_bucket(m)] = pick
                choice = select(table, problem, self.tuned.get(op))   # chosen and logged now
                if op == "dense_swiglu" and choice.kernel is not SEPARATE:
                    break       # the epilogue runs: this weight's plain GEMM never does at this M

    def dequantize(self):
        return self.weight

    def shard(self, shard):
        c0, c1 = self._check_cols(shard)
        return DenseWeight(self.weight[shard.row_index(self.weight.device), c0:c1].contiguous())

    def weight_bytes(self):
        return self.weight.nbytes
