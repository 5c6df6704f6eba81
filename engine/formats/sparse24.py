"""2:4 structured sparsity for FFN weights: pruning, compressed storage, the reference, the `2:4`
and `2:4+fp8` backends and their kernel lists.

W [N, K] keeps 2 of every 4 consecutive entries along K (the input dimension). Stored compressed:
the kept values [N, K/2] (bf16, or e4m3 with a per-output-channel fp32 scale) plus a 4-bit nibble
per group (two 2-bit positions): 56% of dense bf16, 31% with e4m3 values. On sm_90 the kernels'
own orders of the metadata come on top (BENCHMARKS.md, "2:4-sparse FFN": memory).

The 2:4 GEMM with bf16 values, per architecture (engine/kernels/select.py):
- sm_90: M <= 16 the Gluon sparse-MMA kernel (engine/kernels/sparse24_gluon.py: mma.sp on the
  stored values, its metadata registers precomputed per weight); cuSPARSELt (the sparse tensor
  cores for large M); the Triton kernel that streams the compressed weight (engine/kernels/
  sparse24_triton.py), which runs any shape.
- other GPUs: cuSPARSELt, then the Triton kernel.
Each has several launch configurations, and which wins depends on the shape and M: the engine tunes
them when it starts (engine/kernels/tuner.py; `--tune off` takes the list's order and each kernel's
first configuration). For the fused gate/up projection at decode sizes the Gluon kernel can also
finish silu(gate) * up in its epilogue; the tuner times that against the GEMM and the SwiGLU kernel.
Where it runs the GEMM, it also takes part in the RMSNorm hand-off (`norm_handoff`: the norm between
two decode GEMMs runs in their epilogues, engine/kernels/stream_triton.py), beside the dense
attention projections; not with its SwiGLU epilogue, which forms silu(gate) * up before the norm's
1 / rms could apply.

The 2:4 GEMM with e4m3 values, on sm_90: M <= 16 the same Gluon sparse-MMA kernel, which widens
the stored e4m3 values and e4m3 activations to f16 in registers (exact) for the f16 `mma.sp`;
torchao's CUTLASS sm90 kernel (sparse WGMMA) for larger M. Both take e4m3 activations with
per-token scales, which the fused RMSNorm / SwiGLU kernels write (`input_quant`). Other GPUs: the
Triton kernel with the e4m3 values widened in registers (weight-only: activations stay bf16).

Where a library's buffer starts with the kept values in plain row-major order (checked at load),
the Triton and Gluon kernels read them from that buffer, so the values are stored once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.formats.base import WeightFormat
from engine.formats.fp8 import quantize_act_fp8, quantize_rows_fp8
from engine.kernels.platform import capability, gluon_missing
from engine.kernels.select import Kernel, Problem, m_bucket, runnable, select

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



# ----------------------------------------------------------------------------- kernels
# Launch configurations, the default first. Triton kernel, per M bucket (larger M: the last list):
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, CH groups per thread and chunk, PTX_PACK).
TRITON_CONFIGS = {
    16: [(16, 128, 256, 1, 4, 3, 8, 16), (16, 128, 256, 1, 4, 3, 4, 16), (16, 128, 128, 8, 4, 4, 8, 16),
         (16, 128, 256, 8, 4, 3, 8, 16), (16, 64, 256, 4, 4, 3, 4, 16)],
    32: [(32, 128, 256, 1, 4, 3, 8, 16), (32, 128, 128, 8, 4, 4, 8, 16), (32, 64, 256, 4, 4, 3, 4, 16)],
    64: [(64, 128, 256, 1, 4, 3, 8, 16), (64, 128, 128, 8, 4, 3, 8, 16), (32, 128, 256, 1, 4, 3, 8, 16)],
    128: [(64, 128, 256, 1, 4, 3, 8, 16), (128, 128, 128, 1, 8, 3, 8, 16)],
}
# Gluon sparse-MMA kernel, per M bucket: ("sp", BM, BLOCK_N = 16 RB rows per row warp, WPT, SPLIT_K,
# num_warps, WK).
_SP4 = [("sp", 16, 128, 8, 1, 8, 1), ("sp", 16, 64, 8, 1, 4, 1), ("sp", 16, 128, 8, 1, 4, 1),
        ("sp", 16, 256, 8, 1, 8, 1), ("sp", 16, 64, 8, 8, 4, 1), ("sp", 16, 128, 8, 8, 8, 1),
        ("sp", 16, 16, 8, 1, 8, 8), ("sp", 16, 64, 8, 4, 8, 2)]
GLUON_CONFIGS = {
    1: _SP4, 2: _SP4, 4: _SP4,
    8: [("sp", 16, 128, 4, 1, 4, 2), ("sp", 16, 64, 4, 1, 4, 2), ("sp", 16, 128, 8, 1, 4, 2),
        ("sp", 16, 16, 4, 1, 8, 8), ("sp", 16, 64, 4, 8, 4, 1), ("sp", 16, 128, 4, 8, 4, 1)],
    16: [("sp", 16, 128, 4, 1, 4, 2), ("sp", 16, 64, 4, 1, 4, 2), ("sp", 16, 256, 4, 1, 8, 2),
         ("sp", 16, 64, 4, 8, 4, 1), ("sp", 16, 16, 4, 1, 8, 8), ("sp", 16, 128, 4, 8, 4, 1)],
}
MMA_ORDER_WPTS = (4, 8)  # the WPTs of GLUON_CONFIGS: one copy of the metadata in MMA order each


def _triton_configs(p: Problem) -> list:
    return TRITON_CONFIGS[min(max(m_bucket(p.m), 16), 128)]


def _gluon_configs(p: Problem) -> list:
    from engine.kernels.sparse24_gluon import config_unfit   # reached past _gluon_check's Gluon test
    e4m3 = bool(p.detail) and p.detail[0] == torch.float8_e4m3fn
    swiglu = p.op.endswith("swiglu")
    return [c for c in GLUON_CONFIGS[m_bucket(p.m)] if config_unfit(p.n, p.k, c, e4m3, swiglu) is None]


def _gluon_check(p: Problem) -> str | None:
    values_dtype, x_dtype, library, mma_order = p.detail
    if reason := gluon_missing():
        return reason
    if values_dtype not in (torch.bfloat16, torch.float8_e4m3fn) or x_dtype != torch.bfloat16:
        return "bf16 or e4m3 values, bf16 model"
    if not mma_order:
        return "no metadata in MMA order"
    return None if _gluon_configs(p) else f"no configuration divides K={p.k}"


def _library_check(p: Problem) -> str | None:
    return None if p.detail[2] else "the library refused this shape or is missing (see the load log)"


def _dense_input(x, x_scale, dtype):
    """An e4m3 activation with its per-token scale, back in the model dtype (for the kernels that
    take bf16 activations)."""
    return x if x_scale is None else (x.float() * x_scale.float().reshape(-1, 1)).to(dtype)


def _run_gluon(x, w, config, x_scale=None, swiglu=False, out=None, **handoff):
    """handoff: the RMSNorm hand-off's norm_out (out is then the residual) or row_scale
    (engine/kernels/sparse24_gluon.py `launch`). e4m3 values (`2:4+fp8`): x e4m3 with its
    per-token scale, quantised here when it comes in the model dtype."""
    from engine.kernels import sparse24_gluon as sp
    if w.values.dtype == torch.float8_e4m3fn:
        if x_scale is None:
            x, x_scale = quantize_act_fp8(x)
        handoff["x_scale"] = x_scale.reshape(-1).float()
    else:
        x = _dense_input(x, x_scale, w.dtype)
    reason = sp.unsupported(x, w.values, config, swiglu)
    if reason is not None:
        raise ValueError(f"sparse-MMA kernel, config {config}: {reason}")
    if out is None:
        n = w.out_features // 2 if swiglu else w.out_features
        out = torch.empty(x.shape[0], n, dtype=w.dtype, device=x.device)
    return sp.launch(x, w.values, getattr(w, f"meta_mma_{config[3]}"), w.scale, config, out, swiglu, **handoff)


def _run_triton(x, w, config, x_scale=None):
    from engine.kernels.sparse24_triton import mma_gemm
    x = _dense_input(x, x_scale, w.dtype)
    out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype, device=x.device)
    return mma_gemm(x, w.values, w.meta, w.scale, config, out)


def _run_cusparselt(x, w, config, x_scale=None):
    from engine.kernels.sparse24_libs import cslt_mm
    return cslt_mm(w.packed, _dense_input(x, x_scale, w.dtype), config or 0)


def _run_torchao(x, w, config, x_scale=None):
    from engine.kernels.sparse24_libs import torchao_fp8_gemm
    if x_scale is None:
        (qx, xs), out_dtype = quantize_act_fp8(x), x.dtype
    else:
        qx, xs, out_dtype = x, x_scale.reshape(-1).float(), w.dtype
    return torchao_fp8_gemm(qx, xs, w.packed, w.ao_meta, w.scale, out_dtype)


def _run_reference(x, w, config, x_scale=None):
    return sparse24_linear_ref(_dense_input(x, x_scale, w.dtype), w.tensor, w.scale)


GLUON_SP = Kernel("gluon_sparse_mma", _run_gluon, max_m=16, check=_gluon_check, configs=_gluon_configs)
CUSPARSELT = Kernel("cusparselt", _run_cusparselt, check=_library_check, configs=lambda p: [0])
TRITON = Kernel("triton_stream", _run_triton, configs=_triton_configs)
REFERENCE = Kernel("reference", _run_reference, reference=True)
SPARSE24_GEMM = {9: [GLUON_SP, CUSPARSELT, TRITON, REFERENCE], "other": [CUSPARSELT, TRITON, REFERENCE]}
GLUON_SP_FP8 = Kernel("gluon_sparse_mma_fp8", _run_gluon, max_m=16, check=_gluon_check, configs=_gluon_configs,
                      input_quant="fp8")
SPARSE24_FP8_GEMM = {9: [GLUON_SP_FP8, Kernel("torchao_cutlass_sm90", _run_torchao, check=_library_check,
                                              input_quant="fp8"), TRITON, REFERENCE],
                     "other": [TRITON, REFERENCE]}
# silu(gate) * up of a fused gate/up weight: in the sparse-MMA kernel's epilogue, or "separate" (the
# GEMM, then the SwiGLU kernel: Linear.swiglu). Up to 4 tokens only: it needs SPLIT_K = 1 and two row
# blocks per warp, which cost more than the SwiGLU kernel saves at 8-16 tokens.
SEPARATE = Kernel("separate", None, needs_cuda=False)


def _gluon_swiglu_check(p: Problem) -> str | None:
    return "e4m3 values: the plain epilogue only" if p.detail[0] == torch.float8_e4m3fn else _gluon_check(p)


SPARSE24_SWIGLU = {
    9: [Kernel("gluon_sparse_mma_swiglu", lambda x, w, config: _run_gluon(x, w, config, swiglu=True),
               max_m=4, check=_gluon_swiglu_check, configs=_gluon_configs), SEPARATE],
    "other": [SEPARATE]}


# ----------------------------------------------------------------------------- backends
def _values_view(packed: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """`values` itself, or the identical plain-order prefix of a library's buffer (stored once)."""
    if packed is None:
        return values
    prefix = packed.reshape(-1)[: values.numel()]
    if prefix.dtype == values.dtype and torch.equal(prefix.view(torch.uint8), values.reshape(-1).view(torch.uint8)):
        return prefix.view(values.shape)
    return values


class _Sparse24Base(WeightFormat):
    table: dict
    op: str
    swiglu_table: dict | None = None    # where a fused gate/up can take silu(gate) * up in its GEMM

    def __init__(self, t: Sparse24Tensor):
        super().__init__(*t.shape)
        self.register_buffer("meta", t.meta)

    def _register_mma_meta(self, t: Sparse24Tensor) -> None:
        """The sparse-MMA kernel's metadata in MMA order, `meta_mma_<WPT>` for each WPT of its
        configurations (e4m3 values: the order of the f16 pairs they widen to, 2 * WPT), built with
        the weight so that the KV cache is sized after it; None where the kernel cannot run."""
        cap = capability(t.values.device)
        e4m3 = t.values.dtype == torch.float8_e4m3fn
        for wpt in MMA_ORDER_WPTS:
            meta = None
            if cap is not None and cap[0] == 9 and self.dtype == torch.bfloat16 and not gluon_missing():
                from engine.kernels.sparse24_gluon import meta_wpt, mma_order_meta
                order_wpt = meta_wpt(wpt, e4m3)
                if t.shape[1] % (16 * order_wpt) == 0:
                    meta = mma_order_meta(t.meta, order_wpt)
            self.register_buffer(f"meta_mma_{wpt}", meta)

    @property
    def tensor(self) -> Sparse24Tensor:
        return Sparse24Tensor(self.values, self.meta, (self.out_features, self.in_features))

    def _problem(self, op: str, x: torch.Tensor) -> Problem:
        x_dtype = self.dtype if x.dtype == torch.float8_e4m3fn else x.dtype
        return self._problem_at(op, x.shape[0], x_dtype, x.device)

    def _problem_at(self, op: str, m: int, x_dtype: torch.dtype, device) -> Problem:
        mma_order = getattr(self, "meta_mma_4", None) is not None
        return Problem(op, m, self.out_features, self.in_features, device,
                       (self.values.dtype, x_dtype, self.packed is not None, mma_order))

    def forward(self, x: torch.Tensor, x_scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] in the model dtype, or e4m3 with its per-token fp32 scale (see input_quant)."""
        choice = select(self.table, self._problem(self.op, x), self.tuned.get(self.op))
        return choice.kernel.run(x.contiguous(), self, config=choice.config, x_scale=x_scale)

    def tune(self, tuner, m_values: list[int], swiglu: bool = False) -> None:
        for m in m_values:
            x = torch.randn(m, self.in_features, device=self.meta.device, dtype=self.dtype) * 0.1
            problem = self._problem(self.op, x)
            # Timed on the activations the model hands over: e4m3 with per-token scales where the
            # norm / SwiGLU before quantises for this weight (a bf16 kernel then pays the widening).
            xq, xs = quantize_act_fp8(x) if self.input_quant(m) == "fp8" else (x, None)
            pick = tuner.best(problem, lambda: [(k.name, c, lambda k=k, c=c: k.run(xq, self, config=c, x_scale=xs))
                                                for k, c in self._candidates(problem, x)])
            if pick is not None:
                self.tuned.setdefault(self.op, {})[m_bucket(m)] = pick
            select(self.table, problem, self.tuned.get(self.op))   # chosen and logged now
            if swiglu and m <= 4 and self.swiglu_table is not None:
                self._tune_swiglu(tuner, x)

    def _candidates(self, problem, x):
        """What the tuner times: every runnable (kernel, config), cuSPARSELt with its searched algorithm."""
        from engine.kernels.sparse24_libs import cslt_search
        return [(k, cslt_search(self.packed, x) if k is CUSPARSELT else c) for k, c in runnable(self.table, problem)]

    def _tune_swiglu(self, tuner, x):
        from engine.kernels.swiglu import swiglu
        problem = self._problem("sparse24_swiglu", x)

        def candidates():
            fused = [(k.name, c, lambda k=k, c=c: k.run(x, self, config=c))
                     for k, c in runnable(self.swiglu_table, problem) if k is not SEPARATE]
            return fused + [(SEPARATE.name, None, lambda: swiglu(self(x)))] if fused else []
        pick = tuner.best(problem, candidates)
        if pick is not None:
            self.tuned.setdefault("sparse24_swiglu", {})[m_bucket(x.shape[0])] = pick

    def dequantize(self):
        w = decompress_24(self.tensor, torch.float32)
        return (w if self.scale is None else w * self.scale[:, None]).to(self.dtype)

    def weight_bytes(self):
        return self.tensor.nbytes() + (0 if self.scale is None else self.scale.nbytes)

    k_granule = 8   # one metadata byte: two groups of 4

    def _shard_tensor(self, shard) -> tuple[Sparse24Tensor, torch.Tensor]:
        """The kept values and metadata of the shard's rows and K range (the same entries, positions
        and, for FP8, row scales), and the row index."""
        c0, c1 = self._check_cols(shard)
        rows = shard.row_index(self.meta.device)
        t = self.tensor
        return Sparse24Tensor(t.values[rows, c0 // 2:c1 // 2].contiguous(),
                              t.meta[rows, c0 // 8:c1 // 8].contiguous(), shard.shape), rows


class Sparse24Weight(_Sparse24Base):
    """`--sparse-ffn`: a bf16 2:4 weight."""
    name = "2:4"
    table, op, swiglu_table = SPARSE24_GEMM, "sparse24_gemm", SPARSE24_SWIGLU

    def __init__(self, t: Sparse24Tensor):
        super().__init__(t)
        from engine.kernels.sparse24_libs import cslt_compress
        self.dtype = t.values.dtype
        self.scale = None
        packed = cslt_compress(decompress_24(t)) if t.values.is_cuda else None
        self.register_buffer("packed", packed)
        self.register_buffer("values", _values_view(packed, t.values))
        self._register_mma_meta(t)

    @classmethod
    def from_dense(cls, w: torch.Tensor, score: torch.Tensor | None = None) -> "Sparse24Weight":
        if not is_24_sparse(w):  # a checkpoint that is already 2:4 is kept exactly
            w = prune_24(w, score)
        return cls(compress_24(w))

    def shard(self, shard) -> "Sparse24Weight":
        return Sparse24Weight(self._shard_tensor(shard)[0])

    def swiglu_forward(self, x):
        choice = select(SPARSE24_SWIGLU, self._problem("sparse24_swiglu", x), self.tuned.get("sparse24_swiglu"))
        return None if choice.kernel.run is None else choice.kernel.run(x.contiguous(), self, config=choice.config)

    def _handoff_config(self, m: int, swiglu: bool):
        """The sparse-MMA kernel's configuration at M rows where it runs this weight's GEMM in the
        RMSNorm hand-off, else None. A fused gate/up takes part only where the SwiGLU kernel follows
        the GEMM: the SwiGLU epilogue forms silu(gate) * up before the row scale could apply."""
        if torch.compiler.is_compiling() or not 0 < m <= 16:
            return None
        device = self.meta.device
        if swiglu and select(SPARSE24_SWIGLU, self._problem_at("sparse24_swiglu", m, self.dtype, device),
                             self.tuned.get("sparse24_swiglu")).kernel.run is not None:
            return None
        choice = select(self.table, self._problem_at(self.op, m, self.dtype, device), self.tuned.get(self.op))
        return choice.config if choice.kernel is GLUON_SP else None

    def norm_handoff(self, m: int, swiglu: bool = False) -> bool:
        return self._handoff_config(m, swiglu) is not None

    def norm_out_forward(self, x, residual, norm_weight):
        from engine.kernels.stream_triton import norm_parts
        config = self._handoff_config(x.shape[0], False)
        xg, parts = torch.empty_like(residual), norm_parts(self.out_features, x.device, group=config[2])
        _run_gluon(x.contiguous(), self, config, out=residual, norm_out=(norm_weight, xg, parts))
        return xg, parts

    def row_scaled_forward(self, xg, parts, eps, swiglu=False):
        from engine.kernels.swiglu import swiglu as swiglu_kernel
        y = _run_gluon(xg.contiguous(), self, self._handoff_config(xg.shape[0], swiglu), row_scale=(parts, eps))
        return swiglu_kernel(y) if swiglu else y


class Sparse24Fp8Weight(_Sparse24Base):
    """`--sparse-ffn` with `--weights fp8`: e4m3 2:4 values with a per-output-channel fp32 scale."""
    name = "2:4+fp8"
    table, op = SPARSE24_FP8_GEMM, "sparse24_fp8_gemm"

    def __init__(self, t: Sparse24Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
        super().__init__(t)
        from engine.kernels.sparse24_libs import torchao_compress
        self.dtype = dtype
        self.register_buffer("scale", scale.float().contiguous())
        cap = capability(t.values.device)
        packed = torchao_compress(decompress_24(t)) if cap is not None and cap[0] == 9 else None
        self.register_buffer("packed", packed[0] if packed is not None else None)
        self.register_buffer("ao_meta", packed[1] if packed is not None else None)
        self.register_buffer("values", _values_view(self.packed, t.values))
        self._register_mma_meta(t)

    @classmethod
    def from_dense(cls, w: torch.Tensor, score: torch.Tensor | None = None) -> "Sparse24Fp8Weight":
        if not is_24_sparse(w):  # a checkpoint that is already 2:4 is kept exactly
            w = prune_24(w, score)
        t = compress_24(w)
        q, scale = quantize_rows_fp8(t.values)
        return cls(Sparse24Tensor(q, t.meta, t.shape), scale, w.dtype)

    def shard(self, shard) -> "Sparse24Fp8Weight":
        t, rows = self._shard_tensor(shard)
        return Sparse24Fp8Weight(t, self.scale[rows], self.dtype)

    def input_quant(self, m: int) -> str | None:
        """"fp8" where the kernel for M rows takes e4m3 activations with per-token scales (the
        sparse-MMA kernel, torchao's): the fused RMSNorm / SwiGLU kernels then write them so. The
        Triton kernel takes bf16 activations."""
        choice = select(self.table, self._problem_at(self.op, m, self.dtype, self.meta.device), self.tuned.get(self.op))
        return choice.kernel.input_quant
