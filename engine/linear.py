"""One Linear interface with a backend module per weight format.

The model is written once against `Linear`; a weight format (bf16, fp8, nvfp4, 2:4, 2:4+fp8) is a
backend module (engine/formats) that holds the weight as buffers in its own storage and knows how to
multiply by it. Loading fills the dense weight first (`Linear.weight`); `Linear.convert(...)` then
swaps in the format's backend and drops the dense copy, so the peak is one layer's dense weight, not
the model's. A checkpoint stored in a format gives its Linears their backends directly: built under
`deferred_weights()`, they never allocate the dense weight.

Under tensor parallelism (engine/parallel.py) a Linear holds one rank's `Shard` of the full weight:
`in_features` / `out_features` are the shard's, `full_shape` the whole weight's. Loading copies in
the rank's part of each full tensor (`load`). A format is made from the full weight, gathered from
every rank one Linear at a time, and then cut to the shard (`WeightFormat.shard`): each rank holds
exactly its slice of what one GPU would hold (the same scales), never the whole model.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch import nn

from engine.formats import DenseWeight, WeightFormat, format_class
from engine.kernels.swiglu import swiglu
from engine.parallel import Shard


_deferred = threading.local()


@contextmanager
def deferred_weights():
    """Linears built inside hold their dense weight on the meta device (no memory): for a loader that
    gives them their backends or dense weights afterwards."""
    _deferred.on = True
    try:
        yield
    finally:
        _deferred.on = False


class Linear(nn.Module):
    """A bias-free linear layer (Llama has no biases) whose weight format is a swappable backend.

    in_features, out_features: the full weight's shape. shards: with tensor parallelism, every
    rank's Shard of it (rank `tp.rank` holds shards[tp.rank]); None: the whole weight."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None,
                 shards: list[Shard] | None = None, tp=None):
        super().__init__()
        self.full_shape = (out_features, in_features)
        self.shards = shards or [Shard.whole(out_features, in_features)]
        self.tp = tp
        self.shard = self.shards[tp.rank if tp is not None else 0]
        self.out_features, self.in_features = self.shard.shape
        device = "meta" if getattr(_deferred, "on", False) else device
        self.backend: WeightFormat = DenseWeight(torch.empty(self.out_features, self.in_features,
                                                             device=device, dtype=dtype))
        self.fused = True   # the engine's fused-kernels switch, for the SwiGLU after this GEMM

    @property
    def sharded(self) -> bool:
        return self.shard != Shard.whole(*self.full_shape)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, for loading; only until the layer is converted to another format."""
        if not isinstance(self.backend, DenseWeight):
            raise RuntimeError(f"the weight is stored as {self.backend.name}: use backend.dequantize()")
        return self.backend.weight

    def input_quant(self, m: int) -> str | None:
        """How the backend wants M rows of activations: None (the model dtype) or "fp8"."""
        return self.backend.input_quant(m)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [..., K], or (x_fp8 [M, K], x_scale [M]) when the backend's input_quant is "fp8"."""
        if isinstance(x, tuple):
            return self.backend(x[0], x_scale=x[1])
        shape = x.shape
        y = self.backend(x.reshape(-1, shape[-1]))
        return y.reshape(*shape[:-1], self.out_features)

    def swiglu(self, x: torch.Tensor, quant: str | None = None):
        """silu(gate) * up of this gate/up projection's output (rows [0, N/2) gate, [N/2, N) up):
        in the GEMM's epilogue where the backend fuses it, else the SwiGLU kernel after the GEMM
        (with quant="fp8": e4m3 and a per-row scale, for an FP8 down projection)."""
        if quant is None and not isinstance(x, tuple):
            h = self.backend.swiglu_forward(x.reshape(-1, x.shape[-1]))
            if h is not None:
                return h.reshape(*x.shape[:-1], self.out_features // 2)
        return swiglu(self(x), quant, fused=self.fused)

    def load(self, value: torch.Tensor, row0: int = 0) -> None:
        """Copy in this rank's part of rows [row0, row0 + len(value)) of the full weight (a section
        of a fused weight, e.g. k of q/k/v, starts at row0; by default value is the whole weight)."""
        n, k = self.full_shape
        if value.dim() != 2 or value.shape[1] != k or row0 + value.shape[0] > n:
            raise ValueError(f"shape {tuple(value.shape)} at row {row0} does not fit a [{n}, {k}] weight")
        dst, (c0, c1), local = self.weight, self.shard.cols, 0
        for a, b in self.shard.rows:
            lo, hi = max(a, row0), min(b, row0 + value.shape[0])
            if lo < hi:
                dst[local + lo - a:local + hi - a].copy_(value[lo - row0:hi - row0, c0:c1])
            local += b - a

    def full_weight(self) -> torch.Tensor:
        """The whole dense weight: this rank's, or every rank's shard gathered (a collective)."""
        w = self.backend.dequantize()
        if not self.sharded:
            return w
        parts = self.tp.all_gather(w)
        full = torch.empty(self.full_shape, dtype=w.dtype, device=w.device)
        for shard, part in zip(self.shards, parts):
            full[shard.row_index(w.device), shard.cols[0]:shard.cols[1]] = part
        return full

    def set_backend(self, backend: WeightFormat) -> None:
        """Install a backend built for the full weight: cut to this rank's shard where sharded."""
        if (backend.out_features, backend.in_features) != self.full_shape:
            raise ValueError(f"a {backend.out_features} x {backend.in_features} weight for a layer of "
                             f"{self.full_shape[0]} x {self.full_shape[1]}")
        self.backend = backend.shard(self.shard) if self.sharded else backend

    def convert(self, fmt: str, full: torch.Tensor | None = None, **kwargs) -> None:
        """Replace the dense weight by backend `fmt` built from it (kwargs go to its from_dense);
        `full`: the whole dense weight where the caller already holds it (full_weight())."""
        cls = format_class(fmt)
        if cls is not type(self.backend):
            self.set_backend(cls.from_dense(self.full_weight() if full is None else full, **kwargs))

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, format={self.backend.name}"


def convert_model(model, weights: str = "bf16", sparse_ffn: str | None = None,
                  input_norms: dict[str, torch.Tensor] | None = None, layers: list[int] | None = None) -> None:
    """Put every decoder GEMM in its configured format (only those of decoder layers `layers`, when
    given: loading layer by layer). With `sparse_ffn` the FFN GEMMs are pruned to 2:4 along K: by
    |W| ("magnitude") or by |W| x the L2 norm of each input channel's activations ("wanda", which
    needs `input_norms` from `input_channel_norms`)."""
    if sparse_ffn and weights == "nvfp4":
        raise ValueError("sparse_ffn: 2:4 sparsity combines with bf16 or fp8 weights, not nvfp4")
    if sparse_ffn == "wanda" and input_norms is None:
        raise ValueError("sparse_ffn: wanda pruning needs calibration activation norms")
    prefixes = None if layers is None else tuple(f"layers.{i}." for i in layers)
    for name, lin in model.linear_layers():
        if prefixes is not None and not name.startswith(prefixes):
            continue
        if sparse_ffn and ".mlp." in name:
            score = w = None
            if sparse_ffn == "wanda":
                from engine.formats.sparse24 import wanda_score
                w = lin.full_weight()
                norms = input_norms[name].to(w.device)
                if lin.shard.cols != (0, lin.full_shape[1]):     # this rank's input channels: gather all
                    norms = lin.tp.all_gather(norms).flatten()
                score = wanda_score(w, norms)
            lin.convert("2:4+fp8" if weights == "fp8" else "2:4", full=w, score=score)
        elif weights != "bf16":
            lin.convert(weights)


def tune_model(model, tuner, m_values: list[int]) -> None:
    """Tune every decoder GEMM's kernels, and the LM head's, for the M values the engine will run
    (engine start)."""
    for name, lin in model.linear_layers():
        lin.backend.tune(tuner, m_values, **({"swiglu": True} if name.endswith("gate_up_proj") else {}))
    if model.lm_head is not None:
        model.lm_head.backend.tune(tuner, m_values)


@torch.inference_mode()
def input_channel_norms(model, run_forward, ffn_only: bool = True) -> dict[str, torch.Tensor]:
    """L2 norm over calibration tokens of each input channel of each (FFN) GEMM. `run_forward()`
    pushes the calibration text through the model."""
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name, lin in model.linear_layers(ffn_only=ffn_only):
        def hook(module, args, name=name):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + x.pow(2).sum(0)
        hooks.append(lin.register_forward_pre_hook(hook))
    try:
        run_forward()
    finally:
        for h in hooks:
            h.remove()
    return {k: v.sqrt() for k, v in sums.items()}
