"""What every weight format's backend is: an nn.Module holding its weight as registered buffers.

y = x @ W^T with W of shape [out_features, in_features]. Because the tensors are buffers,
`.to()`, `state_dict()`, layer streaming (engine/streams/offload.py) and sharding see every byte
without knowing the format. Each format module (engine/formats/*.py) also owns its storage,
quantise / dequantise, the PyTorch reference, and the ordered kernel lists of its ops
(engine/kernels/select.py).
"""
from __future__ import annotations

import torch
from torch import nn


class WeightFormat(nn.Module):
    name = "?"

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        # {M bucket: (kernel name, config)} per op, filled by tune() when the engine starts.
        self.tuned: dict[str, dict] = {}

    @classmethod
    def from_dense(cls, w: torch.Tensor, **kwargs) -> "WeightFormat":
        raise NotImplementedError

    def forward(self, x: torch.Tensor, x_scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N]; x_scale only where input_quant(M) says "fp8" (x then float8_e4m3fn)."""
        raise NotImplementedError

    def input_quant(self, m: int) -> str | None:
        """"fp8" where the kernel for M activation rows multiplies them as e4m3 with a per-row
        scale: forward then takes them so, and the kernel before it (RMSNorm, SwiGLU) writes 1 byte
        per element instead of a bf16 activation. None: the model dtype."""
        return None

    def dequantize(self) -> torch.Tensor:
        """The dense weight this backend computes with (for tests and quality reports)."""
        raise NotImplementedError

    # Shards cut K only at multiples of this (a block scale's or a metadata byte's width).
    k_granule = 1

    def shard(self, shard) -> "WeightFormat":
        """The same format holding only `shard` (engine/parallel.py Shard: row ranges and a K range)
        of this weight, with the same values and scales: tensor parallelism's slice of it."""
        raise NotImplementedError

    def _check_cols(self, shard) -> tuple[int, int]:
        c0, c1 = shard.cols
        g = self.k_granule
        if c0 % g or (c1 % g and c1 != self.in_features):
            raise ValueError(f"tensor_parallel_size: a {self.name} weight is split along K only at multiples "
                             f"of {g}; columns [{c0}, {c1}) of {self.in_features} are not")
        return c0, c1

    def weight_bytes(self) -> int:
        """Bytes a matmul reads from device memory for the weight (values, scales, metadata)."""
        raise NotImplementedError

    def swiglu_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a fused gate/up weight ([gate | up] rows): silu(gate) * up [M, N/2] computed in the
        GEMM itself, or None where no kernel of this format does (the SwiGLU kernel runs after)."""
        return None

    def norm_handoff(self, m: int, swiglu: bool = False) -> bool:
        """Whether this weight's GEMM at M activation rows takes part in the RMSNorm hand-off
        (engine/kernels/stream_triton.py states the protocol, which lets the two sides be of
        different formats): as the GEMM before a norm (`norm_out_forward`) and as the one after it
        (`row_scaled_forward`, swiglu: a fused gate/up projection, returning silu(gate) * up).
        Default: no; the norm kernel runs between them."""
        return False

    def norm_out_forward(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor):
        """residual += x @ W^T in place; returns (xg = residual * norm_weight, the partial sums of
        squares of residual's rows) for the next GEMM's `row_scaled_forward`."""
        raise NotImplementedError

    def row_scaled_forward(self, xg: torch.Tensor, parts: torch.Tensor, eps: float,
                           swiglu: bool = False) -> torch.Tensor:
        """RMSNorm(h) * g @ W^T from `norm_out_forward`'s (xg, parts) of h (swiglu: silu(gate) * up)."""
        raise NotImplementedError

    def tune(self, tuner, m_values: list[int], swiglu: bool = False) -> None:
        """Time this weight's candidate kernels for each M (engine start; swiglu: a fused gate/up
        projection, whose SwiGLU epilogue is tuned too); default: nothing to tune."""

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"
