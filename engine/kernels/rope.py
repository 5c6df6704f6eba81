"""Rotary position embedding (HF Llama's rotate-half convention), Llama-3 frequency scaling included.

The reference builds cos/sin from the inverse frequencies; the fused kernel recomputes the angles
from the positions in registers, so no cos/sin table is stored or read. It rotates q and k in place
(they may be strided views of the fused qkv GEMM output) in one launch: one program per token in
prefill, one per token and DECODE_HEADS heads at decode sizes. Given the paged KV cache, the same
launch stores the rotated k and v at the step's slots (write_kv_ref's job, fused). The angle and
rotation helpers are shared with the decode attention kernel, which rotates its rows itself.

Paged KV cache layout (per layer): k_cache, v_cache [num_blocks, block_size, n_kv_heads, head_dim],
block_size a power of two; a token's flat slot is block * block_size + row (`check_cache`). The
cache holds the model dtype, or FP8 (e4m3): then each (token, KV head) row of head_dim values is
quantised as the FP8 activations are (norms.py: row / scale, scale = amax(|row|) / 448), and the
fp32 scales sit in k_scale, v_scale [num_blocks, block_size, n_kv_heads], laid out as the cache
without its last dimension (a row's scale is at the row's offset / head_dim). The row is quantised
as the model dtype holds it, as `write_kv_ref` does.
"""
from __future__ import annotations

import math

import torch

from engine.kernels.norms import e4m3_scale, quantize_e4m3, quantize_fp8_rows_ref
from engine.kernels.platform import interpreting, jit, output_buffer, triton_runs

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference runs
    triton = None


KV_FP8 = torch.float8_e4m3fn


def check_cache(k_cache, v_cache, head_dim, scales=None):
    """The paged KV cache's layout, as every kernel that reads or writes it takes it. scales:
    (k_scale, v_scale), given exactly when the cache is FP8."""
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache need one dtype and layout, with unit stride along head_dim")
    page = k_cache.shape[1]
    if page & (page - 1):
        raise ValueError(f"block_size {page} is not a power of two")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim}: the attention kernels need a power of two >= 16")
    check_kv_scales(k_cache, head_dim, scales)


def check_kv_scales(k_cache, head_dim, scales):
    """An FP8 cache comes with its scales (rope.py's layout), any other cache without."""
    if (k_cache.dtype == KV_FP8) != (scales is not None):
        raise ValueError(f"kv_scales: an FP8 cache needs its scales and only it takes them (cache {k_cache.dtype})")
    if scales is not None:
        want = tuple(s // head_dim for s in k_cache.stride()[:-1])
        if k_cache.stride(2) != head_dim or any(sc.dtype != torch.float32 or sc.shape != k_cache.shape[:-1]
                                                or sc.stride() != want for sc in scales):
            raise ValueError(f"kv_scales: fp32 {tuple(k_cache.shape[:-1])} laid out as the cache "
                             "without head_dim, on a cache whose head rows are contiguous")


def quantize_kv_ref(x):
    """[..., hd] rows -> (e4m3 rows, fp32 scales [...]), as norms.quantize_fp8_rows_ref."""
    return quantize_fp8_rows_ref(x.float())


def dequantize_kv_ref(x, scale):
    """quantize_kv_ref's inverse, in fp32."""
    return x.float() * scale[..., None]


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping, scales=None):
    """k, v: [T, n_kv, hd] -> rows slot_mapping[t] of the flattened caches (quantised, with their
    scales, where the cache is FP8)."""
    nb, bs, nkv, hd = k_cache.shape
    for x, cache, i in ((k, k_cache, 0), (v, v_cache, 1)):
        if scales is None:
            cache.view(nb * bs, nkv, hd).index_copy_(0, slot_mapping, x.to(cache.dtype))
        else:
            xq, sc = quantize_kv_ref(x)     # (copied as bytes: index_copy_ takes no fp8 on the CPU)
            cache.view(torch.uint8).view(nb * bs, nkv, hd).index_copy_(0, slot_mapping, xq.view(torch.uint8))
            scales[i].view(nb * bs, nkv).index_copy_(0, slot_mapping, sc)


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


@jit
def rope_cos_sin(pos, inv_freq_ptr, d, half):
    """cos and sin (fp32) of the angles pos * inv_freq[d] (d < half), computed in registers: what
    the RoPE kernel and the decode attention kernel (which rotates its own q and k) share, so both
    rotate to the same bits."""
    # the angle is pos * inv_freq rounded to fp32, exactly as the reference forms it; then reduced
    # to [-pi, pi] so the hardware sin/cos see the range where they are accurate
    angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + d, mask=d < half, other=0.0)
    # minus the nearest multiple of 2*pi, with 2*pi split in three parts (Cody-Waite): the first has
    # 8 significant bits, so turns * 6.28125 is exact for the < 2^16 turns that positions up to
    # ~400k reach, and fma keeps the reduced angle within ~1e-6 of the exact fp32 one
    turns = tl.floor(angle * 0.15915494309189535 + 0.5)
    reduced = tl.fma(-turns, 6.28125, angle)
    reduced = tl.fma(-turns, 0.0019353071693331003, reduced)
    reduced = tl.fma(-turns, 1.0253131677018246e-11, reduced)
    return tl.cos(reduced), tl.sin(reduced)


@jit
def rope_rotate(x1, x2, cos, sin):
    """The rotate-half pair: (x1, x2) = the first and second halves of a head, in fp32."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                 v_scale_ptr, slot_ptr, out_ptr,
                 q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                 c_stride_block, c_stride_row, c_stride_head, out_stride_t, n_q_heads, n_k_heads, n_heads,
                 half, HEADS: tl.constexpr, HALF: tl.constexpr, WRITE_KV: tl.constexpr, PAGE: tl.constexpr,
                 OUT: tl.constexpr, KV_FP8: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """Token program_id(0), heads HEADS * program_id(1) .. of [q heads, k heads, v heads (WRITE_KV
    only)]: q and k rotated in place, or with OUT every head (v unrotated) written to its row of
    out_ptr instead (heads back to back); with WRITE_KV the rotated k and v also stored at the
    token's slot of the paged cache (what write_kv_ref does, without a kernel of its own), KV_FP8:
    quantised, each head row with its scale."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, HALF)[None, :]
    n_qk = n_q_heads + n_k_heads
    is_v = h >= n_qk
    at = tl.where(h < n_q_heads, q_ptr + t * q_stride_t + h * q_stride_h,
                  tl.where(is_v, v_ptr + t * v_stride_t + (h - n_qk) * v_stride_h,
                           k_ptr + t * k_stride_t + (h - n_q_heads) * k_stride_h)) + d
    mask = (h < n_heads) & (d < half)
    x1 = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(at + half, mask=mask, other=0.0).to(tl.float32)

    cos, sin = rope_cos_sin(tl.load(pos_ptr + t), inv_freq_ptr, d, half)
    cos = tl.where(is_v, 1.0, cos)   # v heads pass through unrotated
    sin = tl.where(is_v, 0.0, sin)
    y1, y2 = rope_rotate(x1, x2, cos, sin)

    if OUT:
        dst = out_ptr + t * out_stride_t + h * (2 * half) + d
        tl.store(dst, y1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half, y2.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        in_place = mask & (h < n_qk)
        tl.store(at, y1.to(q_ptr.dtype.element_ty), mask=in_place)
        tl.store(at + half, y2.to(q_ptr.dtype.element_ty), mask=in_place)
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        head = tl.where(is_v, h - n_qk, h - n_q_heads)
        head_row = (slot // PAGE) * c_stride_block + (slot % PAGE) * c_stride_row + head * c_stride_head
        dst = tl.where(is_v, v_cache_ptr, k_cache_ptr) + head_row + d
        cached = mask & (h >= n_q_heads)
        if KV_FP8:
            # quantised from the values the model dtype holds (write_kv_ref's input)
            y1 = y1.to(q_ptr.dtype.element_ty).to(tl.float32)
            y2 = y2.to(q_ptr.dtype.element_ty).to(tl.float32)
            scale = e4m3_scale(tl.maximum(tl.max(tl.abs(y1), axis=1, keep_dims=True),
                                          tl.max(tl.abs(y2), axis=1, keep_dims=True)))
            tl.store(tl.where(is_v, v_scale_ptr, k_scale_ptr) + head_row // (2 * HALF), scale,
                     mask=(h >= n_q_heads) & (h < n_heads))
            tl.store(dst, quantize_e4m3(y1, scale, ROUND_IN_FP32), mask=cached)
            tl.store(dst + half, quantize_e4m3(y2, scale, ROUND_IN_FP32), mask=cached)
        else:
            tl.store(dst, y1.to(k_cache_ptr.dtype.element_ty), mask=cached)
            tl.store(dst + half, y2.to(k_cache_ptr.dtype.element_ty), mask=cached)


# Heads per program at decode sizes (up to DECODE_TOKENS tokens): spread over several SMs, a token's
# rotation is no longer one CTA's serial work (about twice as fast as all heads in one program at
# Llama-3.1-8B's 32 + 8 heads).
DECODE_HEADS = 4
DECODE_TOKENS = 64


def apply_rope_triton(q, k, positions, inv_freq, kv_write=None, out=None):
    """Rotates q [T, nh, hd] and k [T, nkv, hd] in place (any token/head strides, unit stride along
    hd) and returns them. kv_write = (v, k_cache, v_cache, slot_mapping, kv_scales): also store the
    rotated k and v at their cache slots, as write_kv_ref would (kv_scales: (k_scale, v_scale) of an
    FP8 cache, else None). out (with kv_write): a contiguous
    [T, (nh + 2 nkv) * hd] tensor that takes the rotated q, k and the unrotated v instead,
    laid out as the fused qkv projection lays them out (q, k, v left as they were); returns the
    rotated (q, k) as views of it."""
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("apply_rope needs unit stride along head_dim")
    if q.dtype != k.dtype:   # one kernel pointer walks both (the slices of one qkv output)
        raise ValueError(f"apply_rope needs q and k of one dtype, got {q.dtype} and {k.dtype}")
    t, nh, hd = q.shape
    nkv = k.shape[1]
    heads = nh + nkv
    if kv_write is not None:
        v, k_cache, v_cache, slots, scales = kv_write
        check_cache(k_cache, v_cache, hd, scales)
        if v.stride(-1) != 1 or v.dtype != k.dtype or v.shape != k.shape:
            raise ValueError("apply_rope: v must match k (shape, dtype, unit stride along head_dim)")
        heads += nkv
        cache = dict(v=v, k_cache=k_cache, v_cache=v_cache, scales=scales or (k_cache, v_cache), slots=slots,
                     v_strides=(v.stride(0), v.stride(1)), c_strides=k_cache.stride()[:3], page=k_cache.shape[1])
    else:   # unused pointers and strides: WRITE_KV is off
        cache = dict(v=k, k_cache=k, v_cache=k, scales=(k, k), slots=positions, v_strides=(0, 0),
                     c_strides=(0, 0, 0), page=1)
        scales = None
    out_rows = _check_out(out, q, heads, kv_write) if out is not None else q
    per_program = DECODE_HEADS if t <= DECODE_TOKENS else triton.next_power_of_2(heads)
    if t > 0:
        _rope_kernel[(t, triton.cdiv(heads, per_program))](
            q, k, cache["v"], positions, inv_freq.to(q.device), cache["k_cache"], cache["v_cache"],
            *cache["scales"], cache["slots"], out_rows, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            *cache["v_strides"],
            *cache["c_strides"], out_rows.stride(0), nh, nkv, heads, hd // 2, HEADS=per_program,
            HALF=triton.next_power_of_2(hd // 2), WRITE_KV=kv_write is not None, PAGE=cache["page"],
            OUT=out is not None, KV_FP8=scales is not None, ROUND_IN_FP32=interpreting(), num_warps=4)
    return (q, k) if out is None else _rotated_of(out, nh, nkv, hd)


def _check_out(out, q, heads, kv_write):
    t, _, hd = q.shape
    if kv_write is None:
        raise ValueError("apply_rope: out needs kv_write (v comes with it)")
    return output_buffer(out, (t, heads * hd), q.dtype, q.device, "apply_rope: out")


def _rotated_of(out, nh, nkv, hd):
    """The rotated (q [T, nh, hd], k [T, nkv, hd]) as views of `out` (apply_rope_triton's layout)."""
    t = out.shape[0]
    return out[:, :nh * hd].view(t, nh, hd), out[:, nh * hd:(nh + nkv) * hd].view(t, nkv, hd)


def apply_rope(q, k, positions, inv_freq, kv_write=None, fused=True, out=None):
    """Rotated (q, k); with kv_write = (v, k_cache, v_cache, slot_mapping, kv_scales) the rotated k and v are
    also stored in the paged cache (one kernel for both where the fused kernels run), and with out
    (apply_rope_triton's) q, k and v go there. The Triton path rotates in place, the reference
    returns new tensors: use the returned pair. fused=False: the reference (the engine's
    fused-kernels switch)."""
    if fused and triton_runs(q):
        return apply_rope_triton(q, k, positions, inv_freq, kv_write, out)
    t, nh, hd = q.shape
    nkv = k.shape[1]
    if out is not None:     # checked before anything is written, as the Triton path does
        _check_out(out, q, nh + 2 * nkv, kv_write)
    q, k = apply_rope_ref(q, k, positions, inv_freq)
    if kv_write is not None:
        v, k_cache, v_cache, slots, scales = kv_write
        check_kv_scales(k_cache, hd, scales)
        write_kv_ref(k, v, k_cache, v_cache, slots, scales)
    if out is None:
        return q, k
    out.copy_(torch.cat([q.reshape(t, -1), k.reshape(t, -1), kv_write[0].reshape(t, -1)], 1))
    return _rotated_of(out, nh, nkv, hd)
