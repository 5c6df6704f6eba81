"""A decode step's MLP block for NVFP4 weights in one persistent Gluon kernel (sm_90, M <= 8).

`mlp_block(o, residual, norm_weight, eps, gate_up, down)` computes, for M <= 8 token rows,

    residual' = residual + o                      (stored in the model dtype, as the model keeps it)
    h = RMSNorm(residual') * norm_weight          (bf16)
    y = down(silu(gate(h)) * up(h))               (bf16; gate_up an Nvfp4Tensor of [2F, D], down [D, F])

and returns (y, residual'): the post-attention norm and the MLP of a Llama layer, which otherwise
run as three launches (the add + norm kernel, the gate/up GEMM with SwiGLU in its epilogue, the
down GEMM). Numerics: as those three, up to the order of fp32 sums (the norm's reduction over 4
warps instead of 8, the split-K adds of down, which are unordered there too).

Why one kernel: at M <= 8 each GEMM streams its weight in a few microseconds and every launch
pays a ramp (the first loads' latency on every SM) and a tail (the last wave's programs). Here a
fixed grid of programs claims work items in order from a ticket counter:
- item 0: the add + norm, written to a scratch row block `h`;
- items 1 .. GU: the gate/up tiles (SwiGLU in the epilogue, into a scratch `g` [M, F]);
- the rest: the down tiles, split along K, reduced in the launch (engine/kernels/split_k.py).
A program that claims an item loads its first two K steps of weights, and only then waits for
the item's inputs (the norm, or every gate/up tile: counters in `sync`), so the weight stream of
the next phase starts while the last one drains, and no SM idles between the phases.
Items are claimed in order and an item only waits for items with smaller tickets, which were
claimed by programs already running: no deadlock, whatever number of programs is resident.
The last program to leave returns the counters to zero for the next launch (CUDA graphs).

The GEMM tiles are engine/kernels/nvfp4_gluon.py's (`stream_pointers`, `stream_steps`,
`store_rows`), with its decode configurations; weights row-major or tiled, K % 128 == 0.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from engine.kernels.nvfp4_gluon import (_cta_barrier, _mma_step, _times_tensor_scale, decode_config,
                                        mma_layout, store_rows, stream_pointers, stream_steps,
                                        swiglu_config)
from engine.kernels.platform import sm_count
from engine.kernels.split_k import split_k_buffers

MAX_M = 8
# Resident programs per SM the grid is sized for: the kernel's registers (the gate/up tile's, about
# 100 a thread at 4 warps) allow 4.
PROGRAMS_PER_SM = 4
# sync counters (int32): the next ticket, norm done, gate/up tiles done, programs gone.
TICKET, NORM_DONE, GATE_UP_DONE, EXITED = (gl.constexpr(i) for i in range(4))


@gluon.jit
def _add_rms_norm(o_ptr, res_ptr, w_ptr, res_out_ptr, h_ptr, M, stride_o, stride_r, eps,
                  D: gl.constexpr, BLOCK_D: gl.constexpr):
    """residual' = residual + o (rounded to the residual's dtype) and h = residual' * rstd * w,
    row by row, as engine/kernels/norms.py's kernel computes them."""
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_D // (32 * gl.num_warps())], [32], [gl.num_warps()], [0])
    cols = gl.arange(0, BLOCK_D, layout=layout)
    inside = cols < D
    w = gl.load(w_ptr + cols, mask=inside, other=0.0).to(gl.float32)
    for m in range(M):
        x = gl.load(o_ptr + m * stride_o + cols, mask=inside, other=0.0)
        r = gl.load(res_ptr + m * stride_r + cols, mask=inside, other=0.0)
        x = (x.to(gl.float32) + r.to(gl.float32)).to(res_out_ptr.dtype.element_ty)
        gl.store(res_out_ptr + m * D + cols, x, mask=inside)
        xf = x.to(gl.float32)
        rstd = gl.rsqrt(gl.sum(xf * xf, axis=0) / D + eps)
        gl.store(h_ptr + m * D + cols, (xf * rstd * w).to(h_ptr.dtype.element_ty), mask=inside)


@gluon.jit
def _finished(sync_ptr, counter: gl.constexpr):
    """Count a finished item: every thread's stores before the release (the barrier)."""
    _cta_barrier()
    gl.atomic_add(sync_ptr + counter, 1, sem="release")


@gluon.jit(do_not_specialize=["M"])
def nvfp4_mlp_kernel(
    o_ptr, res_ptr, norm_w_ptr, res_out_ptr, h_ptr, g_ptr, y_ptr,
    gu_words_ptr, gu_scale_ptr, gu_tensor_scale_ptr, dn_words_ptr, dn_scale_ptr, dn_tensor_scale_ptr,
    acc_ptr, count_ptr, sync_ptr,
    M, stride_o, stride_r, stride_y, eps,
    D: gl.constexpr, F: gl.constexpr, BLOCK_D: gl.constexpr, MP: gl.constexpr, TILED: gl.constexpr,
    GU_BLOCK_N: gl.constexpr, GU_WK: gl.constexpr, GU_WPT: gl.constexpr,
    DN_BLOCK_N: gl.constexpr, DN_WK: gl.constexpr, DN_WPT: gl.constexpr, DN_SPLIT: gl.constexpr,
    STRIDED: gl.constexpr = False,
):
    """The module docstring's block. h_ptr [M, D] and g_ptr [M, F] bf16 scratch; acc_ptr /
    count_ptr: split-K scratch (zero on entry and exit); sync_ptr: 4 int32 counters, zero on entry
    and exit."""
    GU_TILES: gl.constexpr = 2 * F // GU_BLOCK_N
    DN_TILES: gl.constexpr = (D + DN_BLOCK_N - 1) // DN_BLOCK_N
    ITEMS: gl.constexpr = 1 + GU_TILES + DN_TILES * DN_SPLIT
    GU_WN: gl.constexpr = gl.num_warps() // GU_WK
    DN_WN: gl.constexpr = gl.num_warps() // DN_WK
    GU_STEP_K: gl.constexpr = 32 * GU_WPT
    DN_STEP_K: gl.constexpr = 32 * DN_WPT
    ROWS_PER_STEP: gl.constexpr = 16 if TILED else 1
    DN_K: gl.constexpr = F // DN_SPLIT

    if STRIDED:
        item = gl.program_id(0)
    else:
        item = gl.atomic_add(sync_ptr + TICKET, 1, sem="relaxed")
    while item < ITEMS:
        if item == 0:
            _add_rms_norm(o_ptr, res_ptr, norm_w_ptr, res_out_ptr, h_ptr, M, stride_o, stride_r, eps,
                          D, BLOCK_D)
            _finished(sync_ptr, NORM_DONE)
        elif item <= GU_TILES:
            gu_tile = item - 1
            gu_n0 = gu_tile * GU_BLOCK_N
            gu_words_ptrs, gu_scale_ptrs, gu_x_ptrs = stream_pointers(
                gu_words_ptr, gu_scale_ptr, h_ptr, gu_n0, 0, M, 2 * F, D, D, GU_BLOCK_N, GU_WPT, MP,
                GU_WN, GU_WK, GU_STEP_K, TILED, True)
            gu_acc = gl.zeros([GU_WK, GU_BLOCK_N, MP], gl.float32, layout=mma_layout(GU_WN, GU_WK))
            gu_acc = stream_steps(_mma_step, gu_words_ptrs, gu_scale_ptrs, gu_x_ptrs, gu_acc, D // (GU_WK * GU_STEP_K),
                               GU_STEP_K, GU_WK, GU_BLOCK_N, GU_WPT, MP, S_STEP=4 * ROWS_PER_STEP,
                               W_STEP=4 * GU_WPT * ROWS_PER_STEP, wait_ptr=sync_ptr + NORM_DONE,
                               wait_target=1)
            store_rows(_times_tensor_scale, gu_acc, gu_tensor_scale_ptr, gu_n0, gu_tile, M, 2 * F, g_ptr, F,
                       acc_ptr, count_ptr, GU_BLOCK_N, MP, 1, GU_WN)
            _finished(sync_ptr, GATE_UP_DONE)
        else:
            piece = item - 1 - GU_TILES
            dn_tile = piece // DN_SPLIT
            dn_n0 = dn_tile * DN_BLOCK_N
            dn_words_ptrs, dn_scale_ptrs, dn_x_ptrs = stream_pointers(
                dn_words_ptr, dn_scale_ptr, g_ptr, dn_n0, (piece % DN_SPLIT) * DN_K, M, D, F, F, DN_BLOCK_N,
                DN_WPT, MP, DN_WN, DN_WK, DN_STEP_K, TILED, False)
            dn_acc = gl.zeros([DN_WK, DN_BLOCK_N, MP], gl.float32, layout=mma_layout(DN_WN, DN_WK))
            dn_acc = stream_steps(_mma_step, dn_words_ptrs, dn_scale_ptrs, dn_x_ptrs, dn_acc, DN_K // (DN_WK * DN_STEP_K),
                               DN_STEP_K, DN_WK, DN_BLOCK_N, DN_WPT, MP, S_STEP=4 * ROWS_PER_STEP,
                               W_STEP=4 * DN_WPT * ROWS_PER_STEP, wait_ptr=sync_ptr + GATE_UP_DONE,
                               wait_target=GU_TILES)
            store_rows(_times_tensor_scale, dn_acc, dn_tensor_scale_ptr, dn_n0, dn_tile, M, D, y_ptr, stride_y,
                       acc_ptr, count_ptr, DN_BLOCK_N, MP, DN_SPLIT)
        if STRIDED:
            item += gl.num_programs(0)
        else:
            item = gl.atomic_add(sync_ptr + TICKET, 1, sem="relaxed")
    # Every program claims one ticket past the last item before it leaves: the last to leave has
    # seen every other one go, and zeroes the counters.
    gone = gl.atomic_add(sync_ptr + EXITED, 1, sem="acq_rel")
    if gone == gl.num_programs(0) - 1:
        gl.store(sync_ptr + TICKET, 0)
        gl.store(sync_ptr + NORM_DONE, 0)
        gl.store(sync_ptr + GATE_UP_DONE, 0)
        gl.store(sync_ptr + EXITED, 0)


_SCRATCH: dict = {}
_RETIRED: list = []  # outgrown scratch, kept alive for graphs captured with it


def _scratch(device: torch.device, m: int, d: int, f: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h [m, d] bf16, g [m, f] bf16, sync int32[4] zeros), one set per device, grown, never freed
    (the engine runs its decode GEMMs on one stream, as split_k.py's buffers assume)."""
    h, g, sync = _SCRATCH.get(device, (None, None, None))
    if h is None or h.numel() < m * d or g.numel() < m * f:
        if h is not None:
            _RETIRED.append((h, g))
        h = torch.empty(MAX_M * d, device=device, dtype=torch.bfloat16)
        g = torch.empty(MAX_M * f, device=device, dtype=torch.bfloat16)
        sync = sync if sync is not None else torch.zeros(4, device=device, dtype=torch.int32)
        _SCRATCH[device] = (h, g, sync)
    return h[:m * d].view(m, d), g[:m * f].view(m, f), sync


def mlp_config(m: int, d: int, f: int, sms: int) -> dict:
    """The gate/up and down tilings of the separate decode kernels (nvfp4_gluon.py) at this shape,
    and the grid: PROGRAMS_PER_SM per SM."""
    gu = swiglu_config(m, 2 * f, d, sms)
    dn = decode_config(m, d, f, sms)
    if gu["num_warps"] != dn["num_warps"]:
        raise ValueError(f"gate/up and down tilings differ in warps ({gu['num_warps']}, {dn['num_warps']})")
    return {"GU_BLOCK_N": gu["BLOCK_N"], "GU_WK": gu["WK"], "GU_WPT": gu["WPT"],
            "DN_BLOCK_N": dn["BLOCK_N"], "DN_WK": dn["WK"], "DN_WPT": dn["WPT"], "DN_SPLIT": dn["SPLIT_K"],
            "num_warps": gu["num_warps"], "programs": PROGRAMS_PER_SM * sms}


def mlp_block(o: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up,
              down, y: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
              config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual'): the module docstring's block for o, residual bf16 [M, D] (unit column stride),
    M <= 8; gate_up an Nvfp4Tensor [2F, D] (gate rows then up rows), down [D, F]. y / residual_out:
    where the output and the new residual go ([M, D], contiguous; residual_out may alias residual)."""
    m, d = o.shape
    f = down.shape[1]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"o: {m} rows, the MLP block kernel takes 1 to {MAX_M}")
    if tuple(gate_up.shape) != (2 * f, d) or down.shape[0] != d:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not make an MLP "
                         f"of width {d}")
    if gate_up.tiled != down.tiled or d % 128 or f % 128:
        raise ValueError("gate_up, down: one storage order, and K % 128 == 0 for both")
    cfg = dict(config or mlp_config(m, d, f, sm_count(o.device)))
    programs = cfg.pop("programs")
    y = torch.empty(m, d, device=o.device, dtype=torch.bfloat16) if y is None else y
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    h, g, sync = _scratch(o.device, m, d, f)
    dn_tiles = triton.cdiv(d, cfg["DN_BLOCK_N"])
    acc, count = split_k_buffers(o.device, m * d, dn_tiles)
    nvfp4_mlp_kernel[(programs,)](
        o, residual, norm_weight, residual_out, h, g, y,
        gate_up.packed.view(torch.int32), gate_up.block_scale.view(torch.uint8), gate_up.tensor_scale,
        down.packed.view(torch.int32), down.block_scale.view(torch.uint8), down.tensor_scale,
        acc, count, sync, m, o.stride(0), residual.stride(0), y.stride(0), eps,
        D=d, F=f, BLOCK_D=triton.next_power_of_2(d), MP=8, TILED=gate_up.tiled, **cfg)
    return y, residual_out
