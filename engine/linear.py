"""One Linear interface with a backend per weight format.

The model is written once against `Linear`; a weight format (bf16, fp8, nvfp4, 2:4, 2:4+fp8) is a
backend object that holds the weight in its own storage and knows how to multiply by it. Loading
always fills the dense weight first; `Linear.convert(...)` then swaps in the backend and drops the
dense copy, so the peak is one layer's dense weight, not the model's.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn


class LinearBackend:
    """A weight in some storage format. y = x @ W^T with W of shape [out_features, in_features]."""
    name = "?"
    # "fp8": forward also takes x already quantised (float8_e4m3fn, with x_scale per row), so the
    # kernel before it can write 1 byte per element instead of a bf16 activation.
    input_quant: str | None = None
    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, K] -> [M, N]
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The dense weight this backend computes with (for tests and quality reports)."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes a matmul reads from device memory for the weight (values, scales, metadata)."""
        raise NotImplementedError

    def swiglu_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a fused gate/up weight ([gate | up] rows): silu(gate) * up [M, N/2] computed in the
        GEMM itself, or None where this backend does not (then the SwiGLU kernel runs after it)."""
        return None


class DenseWeight(LinearBackend):
    name = "dense"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def forward(self, x):
        return F.linear(x, self.weight)

    def dequantize(self):
        return self.weight

    def weight_bytes(self):
        return self.weight.numel() * self.weight.element_size()


# Formats other than dense live beside their kernels and are imported on first use, so importing the
# engine needs neither Triton nor CuTe DSL.
BACKENDS: dict[str, type | str] = {
    "bf16": DenseWeight,
    "fp8": "engine.kernels.fp8:Fp8Weight",
    "nvfp4": "engine.kernels.nvfp4:Nvfp4Weight",
    "2:4": "engine.kernels.sparse24:Sparse24Weight",
    "2:4+fp8": "engine.kernels.sparse24:Sparse24Fp8Weight",
}


def backend_class(fmt: str) -> type:
    if fmt not in BACKENDS:
        raise ValueError(f"weight format {fmt!r} is not one of {', '.join(BACKENDS)}")
    cls = BACKENDS[fmt]
    if isinstance(cls, str):
        module, name = cls.split(":")
        cls = BACKENDS[fmt] = getattr(importlib.import_module(module), name)
    return cls


class Linear(nn.Module):
    """A bias-free linear layer (Llama has no biases) whose weight format is a swappable backend."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)
        self.backend: LinearBackend = DenseWeight(self.weight.data)

    @property
    def input_quant(self) -> str | None:
        return self.backend.input_quant

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [..., K], or (x_fp8 [M, K], x_scale [M]) when the backend's input_quant is "fp8"."""
        if isinstance(x, tuple):
            return self.backend.forward(x[0], x_scale=x[1])
        shape = x.shape
        y = self.backend.forward(x.reshape(-1, shape[-1]))
        return y.reshape(*shape[:-1], self.out_features)

    def swiglu(self, x: torch.Tensor, quant: str | None = None):
        """silu(gate) * up of this gate/up projection's output (rows [0, N/2) gate, [N/2, N) up):
        in the GEMM's epilogue where the backend fuses it, else the SwiGLU kernel after the GEMM
        (with quant="fp8": e4m3 and a per-row scale, for an FP8 down projection)."""
        from engine.kernels.swiglu import swiglu
        if quant is None and not isinstance(x, tuple):
            h = self.backend.swiglu_forward(x.reshape(-1, x.shape[-1]))
            if h is not None:
                return h.reshape(*x.shape[:-1], self.out_features // 2)
        return swiglu(self(x), quant)

    def convert(self, fmt: str, **kwargs) -> None:
        """Replace the dense weight by backend `fmt` built from it (kwargs go to its from_dense)."""
        cls = backend_class(fmt)
        if cls is DenseWeight:
            return
        dense = self.backend.dequantize()
        self.backend = cls.from_dense(dense, **kwargs)
        # The dense copy is no longer needed: keep a 0-element placeholder so state_dict stays valid.
        self.weight = nn.Parameter(torch.empty(0, device=dense.device, dtype=dense.dtype),
                                   requires_grad=False)

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
            score = None
            if sparse_ffn == "wanda":
                from engine.kernels.sparse24 import wanda_score
                w = lin.backend.dequantize()
                score = wanda_score(w, input_norms[name].to(w.device))
            lin.convert("2:4+fp8" if weights == "fp8" else "2:4", score=score)
        elif weights != "bf16":
            lin.convert(weights)


def move_dense(module: nn.Module, device: torch.device) -> None:
    """Move a module whose Linears are still dense (just loaded, not converted) to `device`, in
    place. Module.to() would move each Linear's parameter but not the backend's alias of it, so the
    backend is rebuilt on the moved weight."""
    for sub in module.modules():
        for tensors in (sub._parameters, sub._buffers):
            for t in tensors.values():
                if t is not None and t.device != device:
                    t.data = t.data.to(device)
        if isinstance(sub, Linear):
            if not isinstance(sub.backend, DenseWeight):
                raise ValueError("move_dense: convert the weight formats after moving, not before")
            sub.backend = DenseWeight(sub.weight.data)


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
