"""Weight-streaming decode GEMM for M <= 16 tokens, in Triton: y = x @ W^T, for 16-bit weights
(the dense format) and for e4m3 weights with per-channel scales (the FP8 format).

`stream_matmul(x, w, out=None, config=None, swiglu=False)`, 16-bit: x [M, K] with unit stride along
K, w [N, K] contiguous, both bf16 or both fp16; out [M, N] in the same dtype; fp32 accumulation.
swiglu=True: w is a fused gate/up projection (rows [0, N/2) gate, [N/2, N) up) and out [M, N/2] =
silu(gate) * up, formed in the epilogue, so the [M, N] product is never stored and no SwiGLU
kernel follows. Constraints: M <= 16 (no rows: nothing launches), K a multiple of 64 and of the
configuration's SPLIT_K x BLOCK_K. `stream_config` is the launch rule for both weight kinds (by
bytes per weight), `stream_configs` what the dense tuner times around it (engine/formats/dense.py
lists the kernel against cuBLAS).

The RMSNorm hand-off, which takes the norm between two decode GEMMs out of its own launch
(models/llama.py uses it where both GEMMs' formats can, `WeightFormat.norm_handoff`). The
protocol, which every kernel that takes part follows (this one with 16-bit weights, the 2:4
sparse-MMA kernel of engine/kernels/sparse24_gluon.py), so that the two GEMMs may be of different
formats (the 2:4 FFN beside the dense attention projections):
- The GEMM before the norm (o_proj, down) adds its product into the residual in place (rounded
  once), writes xg = residual * g (the norm's weight), and `parts` [G, 16] fp32: row i the sums of
  squares of the new residual over the producer's i-th group of output columns, column t token t
  (G and the groups are the producer's: its row tiles; no atomics, no zeroing, the same sums
  every run; columns past M undefined). Here `stream_matmul_norm_out`, 64-column groups.
- The GEMM after it (q/k/v, gate/up with SwiGLU) takes xg as x, sums all G rows of parts into each
  token's mean square, and scales the token's fp32 products by rsqrt(mean + eps) before its
  epilogue: RMSNorm(h) * g @ w^T = (h * g @ w^T) / rms(h). Here `stream_matmul_row_scaled`.
Nothing is added to the weight loop (measured: any work on x there slows the stream more than a
launch).
Numerics against the norm kernel: the residual is rounded once (acc + residual) instead of twice,
and 1 / rms multiplies the fp32 product instead of x before its bf16 rounding.

`launch(...)`, the kernel itself for both weight kinds: engine/kernels/fp8_triton.py's
`fp8_gemm_small_m` calls it with e4m3 x and w, their fp32 scales (y = acc * x_scale[m] *
w_scale[n]) and an optional bf16 residual added in the epilogue, launched by the same rule for
1-byte weights.

Design: at decode every weight byte is read once and nothing else is large, so the kernel is a
weight stream. The weight tile is the MMA's A operand (BLOCK_N rows on its M side, so one token
still fills the instruction) and x^T, padded to 16 columns, its B operand; Triton's pipeliner keeps
`num_stages` tiles in flight through shared memory. e4m3 tiles go to an e4m3 x e4m3 WGMMA as
stored (no conversion instruction per weight byte), each BLOCK_K-deep product added into the fp32
sum apart (Hopper's FP8 MMA accumulates at reduced precision within one). Weights with too few row
tiles to fill the SMs split K across programs, reduced in the same launch
(engine/kernels/split_k.py). Weight rows past N re-read row N - 1 and are never stored; x rows past
M load as zeros.

Numerics: fp32 accumulation; with split-K the partial sums meet through fp32 atomics, whose order
varies from run to run (a last-bit difference in the fp32 sum, as in the NVFP4 decode kernels).
Under Triton's interpreter the operands are widened first (to fp32, e4m3 to fp16: exact), since
its dot takes neither bf16 nor e4m3.
"""
from __future__ import annotations

import torch

from engine.kernels.platform import interpreting, jit, sm_count_or_default
from engine.kernels.split_k import split_k_arrive, split_k_buffers, split_k_take

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: engine/formats/dense.py never selects this kernel
    triton = None

MAX_M = 16
SHARED_BYTES = 227 * 1024   # a Hopper block's shared memory
STAGE_BYTES = 16 * 1024     # the weight one pipeline stage holds (stream_config)


@jit
def _dot(w, xt, acc, E4M3: tl.constexpr, NATIVE: tl.constexpr):
    """acc + w @ xt in fp32 (module docstring: how each operand kind multiplies)."""
    if E4M3:
        if NATIVE:
            return acc + tl.dot(w, xt)
        return tl.dot(w.to(tl.float16), xt.to(tl.float16), acc)
    if NATIVE:
        return tl.dot(w, xt, acc)
    return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)


@jit
def _load_parts(part_ptr, n_parts, M, PARTS: tl.constexpr):
    """The hand-off's partial sums [n_parts, 16] as [PARTS, 16] (zeros past n_parts and M)."""
    groups, cols = tl.arange(0, PARTS), tl.arange(0, 16)
    return tl.load(part_ptr + groups[:, None] * 16 + cols[None, :],
                   mask=(groups < n_parts)[:, None] & (cols < M)[None, :], other=0.0)


@jit(do_not_specialize=["M", "n_parts"])   # one binary for every M up to 16
def _stream_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, res_ptr, out_ptr, acc_ptr, count_ptr,
                   g_ptr, xg_ptr, part_ptr, part_in_ptr, n_parts, eps,
                   M, N, stride_xm, stride_om, K: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr,
                   E4M3: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM_OUT: tl.constexpr,
                   ROW_SCALE: tl.constexpr, PARTS: tl.constexpr, NATIVE: tl.constexpr):
    """acc[BLOCK_N, 16] = W[rows, K slice] @ x[:, K slice]^T. SWIGLU: N is the output width F,
    the program also streams up rows F + rows, and the split-K scratch holds gate then up
    ([M, 2N]). E4M3: e4m3 operands, scaled in the epilogue by x_scale[m] * w_scale[n].
    HAS_RESIDUAL: a residual [M, N] (out's row stride) added last. NORM_OUT (with the residual):
    also x * g to xg_ptr and the 64-row groups' sums of squares to part_ptr [N / 64, 16]. ROW_SCALE:
    each token's sums scaled by rsqrt(sum of part_in_ptr [n_parts, 16] / K + eps) first (PARTS:
    n_parts rounded up to a power of two). NATIVE: the GPU's dot on the operands as stored, else widened
    first (the interpreter)."""
    tl.static_assert(not (SWIGLU and (E4M3 or HAS_RESIDUAL)), "SwiGLU: 16-bit weights, no residual")
    tl.static_assert(not NORM_OUT or (HAS_RESIDUAL and not E4M3), "the norm's hand-off: 16-bit, residual")
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    K_SPLIT: tl.constexpr = K // SPLIT_K
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, 16)
    ks = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    # The hand-off's partial sums are loaded before the weight loop (the kernel before this one
    # wrote them), unless there are more than 64 rows of them (a producer of narrower tiles): then
    # after it, rather than hold their registers through it.
    PARTS_EARLY: tl.constexpr = PARTS <= 64
    if ROW_SCALE and PARTS_EARLY:
        parts = _load_parts(part_in_ptr, n_parts, M, PARTS)
    w_ptrs = w_ptr + tl.minimum(rows, N - 1)[:, None].to(tl.int64) * K + ks[None, :]
    x_ptrs = x_ptr + cols[:, None] * stride_xm + ks[None, :]
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        # Rows past M are masked, not clamped to M - 1: the loads go to L2 (cp.async.cg), where every
        # program reading the same row at once queues on one address.
        xt = tl.trans(tl.load(x_ptrs, mask=(cols < M)[:, None], other=0.0))
        acc = _dot(tl.load(w_ptrs), xt, acc, E4M3, NATIVE)
        if SWIGLU:
            acc_up = _dot(tl.load(w_ptrs + N * K), xt, acc_up, E4M3, NATIVE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    mask = (cols < M)[None, :] & (rows < N)[:, None]
    last = True
    if SPLIT_K > 1:
        scratch = acc_ptr + cols[None, :] * (2 * N) + rows[:, None]
        if SWIGLU:  # up's partials first: the counter's release below orders them with gate's
            tl.atomic_add(scratch + N, acc_up, mask=mask, sem="relaxed")
        last = split_k_arrive(acc, scratch, mask, count_ptr + pid_n, SPLIT_K)
        if last:
            if SWIGLU:
                acc_up = split_k_take(scratch + N, mask, count_ptr + pid_n)
            acc = split_k_take(scratch, mask, count_ptr + pid_n)
    if last:
        out_offs = cols[None, :] * stride_om + rows[:, None]
        if E4M3:
            x_scale = tl.load(x_scale_ptr + cols, mask=cols < M, other=0.0)
            acc = acc * tl.load(w_scale_ptr + tl.minimum(rows, N - 1))[:, None] * x_scale[None, :]
        if ROW_SCALE:
            if not PARTS_EARLY:
                parts = _load_parts(part_in_ptr, n_parts, M, PARTS)
            rstd = tl.rsqrt(tl.sum(parts, axis=0) / K + eps)
            acc = acc * rstd[None, :]
            if SWIGLU:
                acc_up = acc_up * rstd[None, :]
        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc_up
        if HAS_RESIDUAL:
            acc += tl.load(res_ptr + out_offs, mask=mask).to(tl.float32)
        y = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + out_offs, y, mask=mask)
        if NORM_OUT:    # the norm of what was just stored, as the next GEMM's ROW_SCALE reads it
            h = tl.where(mask, y.to(tl.float32), 0.0)
            g = tl.load(g_ptr + tl.minimum(rows, N - 1)).to(tl.float32)
            tl.store(xg_ptr + out_offs, (h * g[:, None]).to(xg_ptr.dtype.element_ty), mask=mask)
            squares = tl.sum(tl.reshape(h * h, [BLOCK_N // 64, 64, 16]), axis=1)
            groups = pid_n * (BLOCK_N // 64) + tl.arange(0, BLOCK_N // 64)
            tl.store(part_ptr + groups[:, None] * 16 + cols[None, :], squares,
                     mask=(groups < tl.cdiv(N, 64))[:, None])   # a 128-row tile may end past N's groups


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: dict, swiglu: bool = False,
           x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm_out: tuple | None = None,
           row_scale: tuple | None = None) -> torch.Tensor:
    """One launch of the kernel on checked operands: x [M, K] (unit stride along K), w [N, K]
    contiguous (2N rows with swiglu), out [M, N] with unit stride along N; e4m3 x and w come with
    their fp32 scales; residual [M, N] with out's strides (it may be out). norm_out = (g [N], xg
    [M, N] with out's strides, partial sums [N / 64, 16] fp32) and row_scale = (any producer's
    partial sums [G, 16], eps): the RMSNorm hand-off (module docstring). cfg: BLOCK_N, BLOCK_K,
    SPLIT_K, num_stages, num_warps; its K split is checked here, for both entry points."""
    m, k = x.shape
    n = out.shape[1]
    split = cfg["SPLIT_K"]
    if k % (split * cfg["BLOCK_K"]):
        raise ValueError(f"config: K={k} is not a multiple of SPLIT_K={split} x BLOCK_K={cfg['BLOCK_K']}")
    if m == 0:
        return out
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    acc, count = split_k_buffers(x.device, 2 * m * n, tiles) if split > 1 else (out, out)
    e4m3 = x_scale is not None
    g, xg, part = norm_out if norm_out is not None else (out, out, out)
    part_in, eps = row_scale if row_scale is not None else (out, 0.0)
    n_parts = part_in.shape[0] if row_scale is not None else 0
    _stream_kernel[(tiles, split)](
        x, w, x_scale if e4m3 else out, w_scale if e4m3 else out, residual if residual is not None else out,
        out, acc, count, g, xg, part, part_in, n_parts, eps, m, n, x.stride(0), out.stride(0), K=k,
        SPLIT_K=split, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SWIGLU=swiglu, E4M3=e4m3,
        HAS_RESIDUAL=residual is not None, NORM_OUT=norm_out is not None, ROW_SCALE=row_scale is not None,
        PARTS=triton.next_power_of_2(n_parts) if row_scale is not None else 1, NATIVE=not interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def _fits(n: int, k: int, block_n: int, block_k: int, split: int, stages: int, swiglu: bool) -> bool:
    """K divides into the splits' tiles, and the pipeline's stages fit in shared memory."""
    stage_bytes = 2 * (block_n * block_k * (2 if swiglu else 1) + 16 * block_k)
    return k % (split * block_k) == 0 and stages * stage_bytes <= SHARED_BYTES


def stream_config(n: int, k: int, num_sms: int, weight_bytes: int = 2, swiglu: bool = False) -> dict:
    """The default launch for a weight of `weight_bytes` per element (2: bf16 / fp16, 1: e4m3; n the
    output rows, F for SwiGLU): 64-row tiles, each stage 16 KB of weight (128 deep in 16 bits, 256
    in e4m3, shallower where K needs it). K is split only where the row tiles are fewer than half
    the SMs, doubling while there are fewer programs than SMs and each split keeps 8 tiles of K: a
    split costs a reduction, which pays on narrow, deep weights (o, down). 6 stages in flight where
    unsplit with fewer than 2 weight tiles streaming per SM (a deeper pipeline beats a split on
    short layers; a SwiGLU program streams two, gate and up), else 4.
    `benchmarks/bench_dense.py --sweep` times it against `stream_configs`."""
    depth = STAGE_BYTES // (64 * weight_bytes)
    block_k = next(b for b in (256, 128, 64) if b <= depth and k % b == 0)
    tiles, split = triton.cdiv(n, 64), 1
    if tiles < num_sms / 2:
        while tiles * split < num_sms and k % (2 * split * block_k) == 0 and k // (2 * split) >= 8 * block_k:
            split *= 2
    streams = tiles * (2 if swiglu else 1)
    stages = 6 if split == 1 and streams < 2 * num_sms else 4
    return {"BLOCK_N": 64, "BLOCK_K": block_k, "SPLIT_K": split, "num_stages": stages, "num_warps": 4}


def stream_configs(n: int, k: int, num_sms: int, swiglu: bool = False) -> list[tuple]:
    """What the dense tuner times: the rule's launch first, then other depths, wider tiles and the
    neighbouring splits, each as a hashable (BLOCK_N, BLOCK_K, SPLIT_K, num_stages) that fits."""
    d = stream_config(n, k, num_sms, swiglu=swiglu)
    base = (d["BLOCK_N"], d["BLOCK_K"], d["SPLIT_K"], d["num_stages"])
    out = [base]
    for bn, bk, split, stages in ((64, 128, base[2], 6), (64, 128, base[2], 4), (64, 256, base[2], 3),
                                  (64, 256, base[2], 4), (128, 128, base[2], 3), (64, 128, base[2] * 2, 4),
                                  (64, 128, max(1, base[2] // 2), 4), (64, 128, max(1, base[2] // 2), 6)):
        cfg = (bn, bk, split, stages)
        if cfg not in out and _fits(n, k, bn, bk, split, stages, swiglu):
            out.append(cfg)
    return out


def as_config(cfg: tuple | dict) -> dict:
    if isinstance(cfg, dict):
        return cfg
    bn, bk, split, stages = cfg
    return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_stages": stages, "num_warps": 4}


def _checked(x: torch.Tensor, w: torch.Tensor, config, swiglu: bool) -> tuple[int, dict]:
    """(N, the launch) for operands the kernel takes; ValueError naming what it does not."""
    m, k = x.shape
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    if m > MAX_M:
        raise ValueError(f"x: the streaming kernel takes up to {MAX_M} rows, got {m}")
    if w.shape[1] != k or w.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"w {tuple(w.shape)} {w.dtype} and x {tuple(x.shape)} {x.dtype}: the same K and "
                         "dtype, bf16 or fp16")
    if k % 64:
        raise ValueError(f"x: K={k} is not a multiple of 64")
    if x.stride(1) != 1 or not w.is_contiguous():
        raise ValueError("x needs unit stride along K and w must be contiguous")
    if swiglu and w.shape[0] % 2:
        raise ValueError(f"w: a fused gate/up weight has an even row count, got {w.shape[0]}")
    return n, as_config(config or stream_config(n, k, sm_count_or_default(x.device), swiglu=swiglu))


def stream_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                  config: tuple | dict | None = None, swiglu: bool = False) -> torch.Tensor:
    """out[M, N] = x @ w^T (swiglu: out[M, N/2] = silu(gate) * up) for M <= 16 (module docstring)."""
    n, cfg = _checked(x, w, config, swiglu)
    if out is None:
        out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    return launch(x, w, out, cfg, swiglu)


def norm_parts(n: int, device: torch.device, group: int = 64) -> torch.Tensor:
    """The buffer a hand-off producer of N output columns in groups of `group` (its row tiles; this
    kernel's 64) writes its partial sums of squares to: [ceil(N / group), 16] fp32."""
    return torch.empty(triton.cdiv(n, group), 16, device=device, dtype=torch.float32)


def check_parts(parts: torch.Tensor, groups: int | None = None) -> None:
    """ValueError unless parts is a hand-off's partial sums: [G, 16] fp32 (G = groups where given)."""
    if parts.dim() != 2 or parts.shape[1] != 16 or parts.dtype != torch.float32 or \
            groups is not None and parts.shape[0] != groups:
        raise ValueError(f"parts: [{'G' if groups is None else groups}, 16] fp32 (norm_parts), got "
                         f"{tuple(parts.shape)} {parts.dtype}")


def stream_matmul_norm_out(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, g: torch.Tensor,
                           xg: torch.Tensor, parts: torch.Tensor, config: tuple | dict | None = None) -> None:
    """The GEMM before an RMSNorm: residual += x @ w^T in place (rounded once), xg = residual * g,
    and parts = the partial sums of squares of residual's rows that `stream_matmul_row_scaled`
    takes. residual and xg [M, N] contiguous, g [N], parts from `norm_parts`."""
    n, cfg = _checked(x, w, config, False)
    m = x.shape[0]
    for name, t in (("residual", residual), ("xg", xg)):
        if t.shape != (m, n) or t.dtype != x.dtype or not t.is_contiguous():
            raise ValueError(f"{name}: [{m}, {n}] {x.dtype} contiguous, got {tuple(t.shape)} {t.dtype}")
    if g.shape != (n,):
        raise ValueError(f"g: [{n}], got {tuple(g.shape)}")
    check_parts(parts, triton.cdiv(n, 64))
    launch(x, w, residual, cfg, residual=residual, norm_out=(g, xg, parts))


def stream_matmul_row_scaled(x: torch.Tensor, w: torch.Tensor, parts: torch.Tensor, eps: float,
                             config: tuple | dict | None = None, swiglu: bool = False) -> torch.Tensor:
    """The GEMM after an RMSNorm handed off by `stream_matmul_norm_out`: x is its xg, and each
    token's product is scaled by rsqrt(mean of its squares + eps) before the (SwiGLU) epilogue:
    RMSNorm(h) * g @ w^T with the norm's 1 / rms applied to the fp32 sums."""
    n, cfg = _checked(x, w, config, swiglu)
    check_parts(parts)
    out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    return launch(x, w, out, cfg, swiglu, row_scale=(parts, float(eps)))


def stream_matmul_ref(x: torch.Tensor, w: torch.Tensor, swiglu: bool = False,
                      row_scale: tuple | None = None) -> torch.Tensor:
    """The reference: the product (and SwiGLU) in fp32, or in x's dtype where that is wider (float64
    for the tests), rounded once to x's dtype. row_scale = (parts, eps): each row first scaled as
    `stream_matmul_row_scaled` does."""
    wide = torch.promote_types(x.dtype, torch.float32)
    y = x.to(wide) @ w.to(wide).t()
    if row_scale is not None:
        parts, eps = row_scale
        y = y * torch.rsqrt(parts.to(wide).sum(0)[:x.shape[0], None] / x.shape[1] + eps)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y.to(x.dtype)


def norm_out_ref(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, g: torch.Tensor):
    """The reference of `stream_matmul_norm_out`: (new residual, xg, parts), the product in fp32 (x's
    dtype where wider), each output rounded once to residual's dtype; parts from the rounded rows."""
    wide = torch.promote_types(x.dtype, torch.float32)
    h = (x.to(wide) @ w.to(wide).t() + residual.to(wide)).to(residual.dtype)
    xg = (h.to(wide) * g.to(wide)).to(residual.dtype)
    m, n = h.shape
    sq = torch.zeros(16, (n + 63) // 64 * 64, dtype=wide, device=h.device)
    sq[:m, :n] = h.to(wide) ** 2
    return h, xg, sq.view(16, -1, 64).sum(-1).t()
