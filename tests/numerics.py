"""The tests' one measure of a kernel against its reference: the relative error in the Frobenius norm,
computed in float64. A non-finite output fails here, with its own message, before any bound."""
from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm()).item()
