"""Rotary position embedding (HF Llama's rotate-half convention), Llama-3 frequency scaling included.

The reference builds cos/sin from the inverse frequencies; the fused kernel recomputes the angles
from the positions in registers, so no cos/sin table is stored or read. It rotates q and k in place
(they may be strided views of the fused qkv GEMM output) in one launch: one program per token in
prefill, one per token and DECODE_HEADS heads at decode sizes.
"""
from __future__ import annotations

import math

import torch

from engine.kernels.norms import triton_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference runs
    triton = None


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """fp32 [head_dim // 2] inverse frequencies, with Llama-3 scaling when `scaling` says so."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    elif scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope_scaling type {scaling.get('rope_type', scaling.get('type'))!r} "
                         "is not supported (default and llama3 are)")
    return inv.float()


def apply_rope_ref(q, k, positions, inv_freq):
    """q: [T, nh, hd], k: [T, nkv, hd], positions: [T]. Returns rotated (q, k) in their dtypes."""
    angles = positions.float()[:, None] * inv_freq.to(q.device)[None, :]   # [T, hd/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]

    def rot(x):
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)

    return rot(q), rot(k)


@_jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, inv_freq_ptr,
                 q_stride_t, q_stride_h, k_stride_t, k_stride_h, n_q_heads, n_heads, half,
                 HEADS: tl.constexpr, HALF: tl.constexpr):
    """Token program_id(0), heads HEADS * program_id(1) .. of the q heads followed by the k heads."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, HALF)[None, :]
    at = tl.where(h < n_q_heads, q_ptr + t * q_stride_t + h * q_stride_h,
                  k_ptr + t * k_stride_t + (h - n_q_heads) * k_stride_h) + d
    mask = (h < n_heads) & (d < half)
    x1 = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(at + half, mask=mask, other=0.0).to(tl.float32)

    # the angle is pos * inv_freq rounded to fp32, exactly as the reference forms it; then reduced
    # to [-pi, pi] so the hardware sin/cos see the range where they are accurate
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + d, mask=d < half, other=0.0)
    # minus the nearest multiple of 2*pi, with 2*pi split in three parts (Cody-Waite): the first has
    # 8 significant bits, so turns * 6.28125 is exact for the < 2^16 turns that positions up to
    # ~400k reach, and fma keeps the reduced angle within ~1e-6 of the exact fp32 one
    turns = tl.floor(angle * 0.15915494309189535 + 0.5)
    reduced = tl.fma(-turns, 6.28125, angle)
    reduced = tl.fma(-turns, 0.0019353071693331003, reduced)
    reduced = tl.fma(-turns, 1.0253131677018246e-11, reduced)
    cos = tl.cos(reduced)
    sin = tl.sin(reduced)

    tl.store(at, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(at + half, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mask)


# Heads per program at decode sizes (up to DECODE_TOKENS tokens): spread over several SMs, a token's
# rotation is no longer one CTA's serial work. H200, Llama-3.1-8B (32 + 8 heads of 128): 1.31 us a
# call at 1 token and 1.52 at 16 with 4 heads per program, against 2.81 / 2.93 with all 40 in one.
DECODE_HEADS = 4
DECODE_TOKENS = 64


def apply_rope_triton(q, k, positions, inv_freq):
    """Rotates q [T, nh, hd] and k [T, nkv, hd] in place (any token/head strides, unit stride along
    hd) and returns them."""
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("apply_rope needs unit stride along head_dim")
    if q.dtype != k.dtype:   # one kernel pointer walks both (the slices of one qkv output)
        raise ValueError(f"apply_rope needs q and k of one dtype, got {q.dtype} and {k.dtype}")
    t, nh, hd = q.shape
    heads = nh + k.shape[1]
    per_program = DECODE_HEADS if t <= DECODE_TOKENS else triton.next_power_of_2(heads)
    if t > 0:
        _rope_kernel[(t, triton.cdiv(heads, per_program))](
            q, k, positions, inv_freq.to(q.device), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            nh, heads, hd // 2, HEADS=per_program, HALF=triton.next_power_of_2(hd // 2), num_warps=4)
    return q, k


def apply_rope(q, k, positions, inv_freq):
    """Rotated (q, k). The Triton path rotates in place, the reference returns new tensors: use the
    returned pair."""
    if triton_enabled(q):
        return apply_rope_triton(q, k, positions, inv_freq)
    return apply_rope_ref(q, k, positions, inv_freq)
