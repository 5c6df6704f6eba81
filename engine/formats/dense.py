"""Dense weights in the model dtype: torch's GEMM (cuBLAS on CUDA), nothing to select."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.formats.base import WeightFormat


class DenseWeight(WeightFormat):
    name = "bf16"

    def __init__(self, weight: torch.Tensor):
        super().__init__(*weight.shape)
        self.register_buffer("weight", weight)

    @classmethod
    def from_dense(cls, w: torch.Tensor) -> "DenseWeight":
        return cls(w)

    def forward(self, x, x_scale=None):
        return F.linear(x, self.weight)

    def dequantize(self):
        return self.weight

    def shard(self, shard):
        c0, c1 = self._check_cols(shard)
        return DenseWeight(self.weight[shard.row_index(self.weight.device), c0:c1].contiguous())

    def weight_bytes(self):
        return self.weight.nbytes
