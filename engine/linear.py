"""One Linear interface with a backend per weight format.

The model is written once against `Linear`; a weight format (bf16, fp8, nvfp4, 2:4, 2:4+fp8) is a
backend object that holds the weight in its own storage and knows how to multiply by it. Loading
always fills the dense weight first; `Linear.convert(...)` then swaps in the backend and drops the
dense copy, so the peak is one layer's dense weight, not the model's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearBackend:
    """A weight in some storage format. y = x @ W^T with W of shape [out_features, in_features]."""
    name = "?"
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


BACKENDS: dict[str, type] = {"bf16": DenseWeight}


def register_backend(name: str, cls: type) -> None:
    BACKENDS[name] = cls


class Linear(nn.Module):
    """A bias-free linear layer (Llama has no biases) whose weight format is a swappable backend."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)
        self.backend: LinearBackend = DenseWeight(self.weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.backend.forward(x.reshape(-1, shape[-1]))
        return y.reshape(*shape[:-1], self.out_features)

    def convert(self, fmt: str, **kwargs) -> None:
        """Replace the dense weight by backend `fmt` built from it (kwargs go to its from_dense)."""
        if fmt not in BACKENDS:
            raise ValueError(f"weight format {fmt!r} is not one of {', '.join(BACKENDS)}")
        if fmt == "bf16":
            return
        dense = self.backend.dequantize()
        self.backend = BACKENDS[fmt].from_dense(dense, **kwargs)
        # The dense copy is no longer needed: keep a 0-element placeholder so state_dict stays valid.
        self.weight = nn.Parameter(torch.empty(0, device=dense.device, dtype=dense.dtype),
                                   requires_grad=False)

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, format={self.backend.name}"
