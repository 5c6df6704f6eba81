"""The row argmax (engine/kernels/argmax.py) against torch.argmax: the same index exactly, ties (the
first), signed zeros (equal) and NaN (the largest) included. Small shapes run compiled with CUDA
and in Triton's interpreter without it (marker `interpreter`, tests/test_interpreter.py); the
Llama-3 vocabulary needs the GPU. The output and the partials are allocated poisoned.
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels.argmax import ARGMAX_CHUNK, argmax, argmax_ref
from engine.kernels.platform import triton_runs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def needs_triton():
    if not triton_runs(torch.empty(0, device=DEVICE)):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")


def _argmax_cases(dtype):
    """Rows that probe the ordering: random, ties across chunks, signed zeros, NaN, all -inf."""
    chunk = ARGMAX_CHUNK
    v = 2 * chunk + 17
    x = torch.randn(8, v, device=DEVICE).to(dtype)
    top = x.max().item() + 1
    x[1, chunk + 3] = x[1, 5] = top                     # a tie across chunks: the first wins
    x[2, -1] = top                                      # in the last, partial chunk
    x[3] = -float("inf")
    x[3, chunk + 1], x[3, 2 * chunk + 2] = 0.0, -0.0    # -0.0 after +0.0: equal, the first wins
    x[4] = -1.0
    x[4, 7], x[4, 9] = -0.0, 0.0                        # -0.0 first
    x[5, 11], x[5, chunk + 9] = float("nan"), float("nan")     # NaN is the largest; the first
    x[5, 3] = float("inf")
    x[6] = -float("inf")                                # every value equal: index 0
    x[7, 2 * chunk] = -float("nan")                     # a NaN with its sign bit set
    return x


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_matches_torch(poisoned, dtype):
    needs_triton()
    x = _argmax_cases(dtype)
    got = argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == argmax_ref(x).tolist()


@pytest.mark.interpreter
@pytest.mark.parametrize("batch,vocab", [(1, 1), (3, 100), (2, ARGMAX_CHUNK)])
def test_argmax_shapes_and_strided_rows(poisoned, batch, vocab):
    needs_triton()
    wide = torch.randn(batch, vocab + 40, device=DEVICE)
    x = wide[:, 20:20 + vocab]                          # rows 40 values apart in memory
    assert argmax(x).tolist() == x.argmax(-1).tolist()
    assert argmax(x[:0]).shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 16, 64, 256])
def test_argmax_llama_vocab(poisoned, batch):
    x = torch.randn(batch, 128256, device="cuda") * 4
    x[0, 100_000] = x[0, 7] = x.max() + 1
    assert argmax(x).tolist() == x.argmax(-1).tolist()
    b16 = x.bfloat16()      # bf16 logits tie often
    assert argmax(b16).tolist() == b16.argmax(-1).tolist()
