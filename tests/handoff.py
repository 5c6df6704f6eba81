"""Checks of the RMSNorm hand-off's two GEMMs (engine/kernels/stream_triton.py states the protocol),
shared by the tests of the kernels that take part (the streaming kernel's under the interpreter,
the 2:4 sparse-MMA kernel's on the GPU): each against float64 from its own inputs, on poisoned
outputs."""
from __future__ import annotations

import torch
from tests.numerics import rel_err

BF16_TOL = 5e-3     # one bf16 rounding of the result


def group_squares(h: torch.Tensor, group: int) -> torch.Tensor:
    """The partial sums a producer with output groups of `group` columns writes for h [M, N]:
    [ceil(N / group), M] float64, row i the sums of squares of h's columns [group * i, group * (i + 1))."""
    m, n = h.shape
    squares = torch.zeros(m, -(-n // group) * group, dtype=torch.float64, device=h.device)
    squares[:, :n] = h.double() ** 2
    return squares.view(m, -1, group).sum(-1).t()


def check_norm_out(produce, x: torch.Tensor, w: torch.Tensor, group: int):
    """produce(x, residual, g, xg, parts): the GEMM before a norm, residual += x @ w^T in place (w the
    weight's float64 values [N, K]), xg = residual * g, parts[i] the sums of squares of the new
    residual over output columns [group * i, group * (i + 1)). Checks all three on fresh random
    inputs and poisoned buffers; returns (h, g, xg, parts)."""
    m, n = x.shape[0], w.shape[0]
    groups = -(-n // group)
    residual = torch.randn(m, n, device=x.device, dtype=torch.bfloat16)
    g = (1 + 0.2 * torch.randn(n, device=x.device)).to(torch.bfloat16)
    h = residual.clone()
    xg = torch.full_like(h, float("nan"))
    parts = torch.full((groups, 16), float("nan"), device=x.device)
    produce(x, h, g, xg, parts)
    assert rel_err(h, x.double() @ w.t() + residual.double()) < BF16_TOL
    assert not xg.isnan().any() and rel_err(xg, h.double() * g.double()) < BF16_TOL
    assert rel_err(parts[:, :m], group_squares(h, group)) < 1e-6
    return h, g, xg, parts


def random_parts(m: int, k: int, group: int, device):
    """A norm's input h [M, K] and g, xg = h * g, and the partial sums of squares a producer with
    output groups of `group` columns writes (columns past M NaN: a consumer must not read them)."""
    h = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    g = (1 + 0.2 * torch.randn(k, device=device)).to(torch.bfloat16)
    parts = torch.full((-(-k // group), 16), float("nan"), device=device)
    parts[:, :m] = group_squares(h, group).float()
    return h, g, (h.double() * g.double()).to(torch.bfloat16), parts


def check_row_scaled(y: torch.Tensor, h, g, w: torch.Tensor, eps: float, swiglu: bool, tol: float = 2 * BF16_TOL):
    """y, the GEMM after the norm (rsqrt(mean square of h + eps) applied to xg @ w^T, w float64),
    against RMSNorm(h) * g @ w^T in float64 (SwiGLU of it for a fused gate/up weight); the tolerance
    covers xg's rounding and y's."""
    hd = h.double()
    ref = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * g.double()) @ w.t()
    if swiglu:
        gate, up = ref.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
    assert not y.isnan().any() and y.shape == ref.shape
    assert rel_err(y, ref) < tol, rel_err(y, ref)
