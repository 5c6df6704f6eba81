"""Probe: the 32 decode GEMMs of 8 Llama-3.1-8B layers (bf16, M = 1) as one persistent, warp-
specialised Gluon kernel. A one-warp producer claims 16-KB units (64 rows x 128 K) one at a time
from one global counter over all GEMMs and copies each by TMA into an S-slot ring (two 64 x 64
boxes, 128-byte swizzle); four consumer warps wait on the slot, on the unit's GEMM inputs (a
counter per GEMM), multiply (mma.sync, x through L1) and add the partial sums into an fp32 y by
atomics. A claim's round trip only delays the producer, which runs S units ahead.
Run from the repository root on a GPU: python benchmarks/persistent_probe/ws_gemms.py"""
import sys
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, ".")

BN = gl.constexpr(64)
BK = gl.constexpr(128)
HALF = gl.constexpr(64)
NT = gl.constexpr(4)            # consumer warps: lane 0 of each adds the warp's count to a GEMM's counter

_CLAIM_ASM = gl.constexpr(
    "{ .reg .pred p; .reg .b32 r, l; mov.b32 r, 0; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; "
    "@p atom.relaxed.gpu.global.add.u32 r, [$1], 1; shfl.sync.idx.b32 $0, r, 0, 0x1f, 0xffffffff; }")
_RELEASE_ASM = gl.constexpr(
    "{ .reg .pred p; .reg .b32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; bar.warp.sync 0xffffffff; "
    "@p red.release.gpu.global.add.u32 [$1], $2; mov.b32 $0, 0; }")
# PER_WARP False: every consumer thread polls and adds its count (128 a CTA), as first measured
_RELEASE_THREAD_ASM = gl.constexpr("{ red.release.gpu.global.add.u32 [$1], $2; mov.b32 $0, 0; }")
_POLL_THREAD_ASM = gl.constexpr("{ ld.relaxed.gpu.global.u32 $0, [$1]; }")
_POLL_ASM = gl.constexpr(
    "{ .reg .pred p; .reg .b32 l, r; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; mov.b32 r, 0; "
    "@p ld.relaxed.gpu.global.u32 r, [$1]; shfl.sync.idx.b32 $0, r, 0, 0x1f, 0xffffffff; }")
_ACQUIRE_ASM = gl.constexpr("{ fence.acq_rel.gpu; mov.b32 $0, 0; }")


@gluon.jit
def _claim(claim_ptr):
    """One unit claimed by lane 0 of the (one-warp) producer, handed to its lanes by a shuffle."""
    return gl.inline_asm_elementwise(_CLAIM_ASM, "=r,l", [claim_ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def producer(w_desc, claim_ptr, total, ring_lo, ring_hi, ids, ready, empty, S: gl.constexpr):
    id_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    i = 0
    u = 0
    while u < total:
        slot = i % S
        mbarrier.wait(empty.index(slot), ((i // S) & 1) ^ 1)
        u = _claim(claim_ptr)
        ids.index(slot).store(gl.full([1], 0, gl.int32, layout=id_l) + u)
        if u < total:
            mbarrier.expect(ready.index(slot), 2 * BN * HALF * 2)
            tma.async_copy_global_to_shared(w_desc, [u * 2 * BN, 0], ready.index(slot), ring_lo.index(slot))
            tma.async_copy_global_to_shared(w_desc, [u * 2 * BN + BN, 0], ready.index(slot), ring_hi.index(slot))
        else:
            mbarrier.arrive(ready.index(slot))      # the end: no copy, the id says so
        i += 1


@gluon.jit
def _add_count(ptr, n, PER_WARP: gl.constexpr):
    if PER_WARP:
        return gl.inline_asm_elementwise(_RELEASE_ASM, "=r,l,r", [ptr, n], dtype=gl.int32, is_pure=False, pack=1)
    return gl.inline_asm_elementwise(_RELEASE_THREAD_ASM, "=r,l,r", [ptr, n], dtype=gl.int32, is_pure=False,
                                     pack=1)


@gluon.jit
def _poll(ptr, PER_WARP: gl.constexpr):
    if PER_WARP:
        return gl.inline_asm_elementwise(_POLL_ASM, "=r,l", [ptr], dtype=gl.int32, is_pure=False, pack=1)
    return gl.inline_asm_elementwise(_POLL_THREAD_ASM, "=r,l", [ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def consumer(y_ptr, meta_ptr, bounds_ptr, done_ptr, M, total, ring_lo, ring_hi, ids, ready, empty,
             S: gl.constexpr, WAIT: gl.constexpr, PER_WARP: gl.constexpr):
    W: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    b_l: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    id_l: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    kk = gl.arange(0, HALF, layout=gl.SliceLayout(1, b_l))
    nb = gl.arange(0, 8, layout=gl.SliceLayout(0, b_l))
    ro = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    no = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    j = 0
    g = 0
    count = 0
    ready_g = 0
    end = gl.load(bounds_ptr + 1)
    u = 0
    while u < total:
        slot = j % S
        mbarrier.wait(ready.index(slot), (j // S) & 1)
        u = gl.max(ids.index(slot).load(id_l), axis=0)
        if u < total:
            while u >= end:                  # past a GEMM: hand over this CTA's count of its units
                if WAIT:
                    _add_count(done_ptr + g, count, PER_WARP)
                count = 0
                g += 1
                end = gl.load(bounds_ptr + g + 1)
            if WAIT:
                if g > ready_g:
                    need = (gl.load(bounds_ptr + g) - gl.load(bounds_ptr + g - 1)) * (NT if PER_WARP else NT * 32)
                    v = _poll(done_ptr + g - 1, PER_WARP)
                    while v < need:
                        v = _poll(done_ptr + g - 1, PER_WARP)
                    gl.inline_asm_elementwise(_ACQUIRE_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
                    ready_g = g
            N = gl.load(meta_ptr + g * 6 + 1).to(gl.int32)
            K = gl.load(meta_ptr + g * 6 + 2).to(gl.int32)
            y_off = gl.load(meta_ptr + g * 6 + 3)
            x_off = gl.load(meta_ptr + g * 6 + 4)
            x_stride = gl.load(meta_ptr + g * 6 + 5)
            local = u - gl.load(bounds_ptr + g)
            KS = K // BK
            t = local // KS
            k = local % KS
            xp = y_ptr + x_off + nb[None, :] * x_stride + k * BK + kk[:, None]
            xm = (nb < M)[None, :]
            x_lo = gl.load(xp, mask=xm, other=0.0).to(gl.bfloat16)
            x_hi = gl.load(xp + HALF, mask=xm, other=0.0).to(gl.bfloat16)
            a_lo = ring_lo.index(slot).load(a_l)
            a_hi = ring_hi.index(slot).load(a_l)
            fence_async_shared()
            mbarrier.arrive(empty.index(slot))
            acc = mma_v2(a_lo, x_lo, gl.zeros([BN, 8], gl.float32, layout=mma))
            acc = mma_v2(a_hi, x_hi, acc)
            gl.atomic_add(y_ptr + y_off + no[None, :] * N + t * BN + ro[:, None], acc, mask=(no < M)[None, :],
                          sem="relaxed")
            count += 1
        j += 1
    if WAIT:
        _add_count(done_ptr + g, count, PER_WARP)


@gluon.jit
def ws_gemms(w_desc, y_ptr, meta_ptr, bounds_ptr, done_ptr, claim_ptr, M, total, WAIT: gl.constexpr,
             S: gl.constexpr, PER_WARP: gl.constexpr = True):
    ring_lo = gl.allocate_shared_memory(gl.bfloat16, [S, BN, HALF], w_desc.layout)
    ring_hi = gl.allocate_shared_memory(gl.bfloat16, [S, BN, HALF], w_desc.layout)
    ids = gl.allocate_shared_memory(gl.int32, [S, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (consumer, (y_ptr, meta_ptr, bounds_ptr, done_ptr, M, total, ring_lo, ring_hi, ids, ready, empty, S, WAIT,
                   PER_WARP)),
        (producer, (w_desc, claim_ptr, total, ring_lo, ring_hi, ids, ready, empty, S)),
    ], [1], [40])


def tiled_halves(w):
    """[N, K] -> units (64 rows x 128 K, row tile major) of two contiguous 64 x 64 halves."""
    n, k = w.shape
    return w.view(n // 64, 64, k // 128, 2, 64).permute(0, 2, 3, 1, 4).contiguous().view(-1, 64)


def bench(fn, reps=10):
    g = torch.cuda.CUDAGraph()
    fn(); torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps + 1):
        s.record(); g.replay(); e.record(); torch.cuda.synchronize()
        if i:
            times.append(s.elapsed_time(e) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    from engine.kernels.stream_triton import stream_matmul
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] * 8
    ws = [(torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16) for n, k in shapes]
    w2d = torch.cat([tiled_halves(w) for w in ws])
    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    desc = TensorDescriptor(w2d, list(w2d.shape), list(w2d.stride()), [64, 64], layout)
    units = [n // 64 * (k // 128) for n, k in shapes]
    bounds = torch.tensor([0] + list(torch.tensor(units).cumsum(0)) + [1 << 30], dtype=torch.int32, device=dev)
    total = sum(units)
    M = 1
    offs, o = [], M * 4096
    for n, k in shapes:
        offs.append(o); o += M * n
    y = torch.zeros(o, device=dev, dtype=torch.float32)
    meta, prev_off, prev_stride = [], 0, 4096
    for (n, k), yo in zip(shapes, offs):
        meta.append([0, n, k, yo, prev_off, prev_stride])
        prev_off, prev_stride = yo, n
    meta = torch.tensor(meta, dtype=torch.int64, device=dev)
    done = torch.zeros(len(shapes), dtype=torch.int32, device=dev)
    claim = torch.zeros(1, dtype=torch.int32, device=dev)
    x0 = torch.randn(M, 4096, device=dev).to(torch.bfloat16).float()
    xr = x0
    for w, (n, k) in zip(ws, shapes):
        xr = xr[:, :k].to(torch.bfloat16).float() @ w.float().t()
    outs = [torch.empty(M, n, device=dev, dtype=torch.bfloat16) for n, _ in shapes]
    xb = x0.to(torch.bfloat16)

    def engine_chain():
        x = xb
        for w, out, (n, k) in zip(ws, outs, shapes):
            stream_matmul(x[:, :k], w, out)
            x = out
    t = bench(engine_chain)
    print(f"M=1 engine streaming kernel, 32 launches {t:8.1f} us  {t / 8:6.1f} us a layer", flush=True)
    for per_sm, S, wait, per_warp in ((2, 6, True, True), (2, 6, False, True), (2, 3, True, True),
                                      (2, 6, True, False), (2, 4, True, False), (1, 8, True, False)):
        nprog = nsm * per_sm
        def run():
            y.zero_(); done.zero_(); claim.zero_()
            y[:M * 4096].copy_(x0.view(-1))
            ws_gemms[(nprog,)](desc, y, meta, bounds, done, claim, M, total, WAIT=wait, S=S, PER_WARP=per_warp,
                               num_warps=4, maxnreg=128)
        run(); torch.cuda.synchronize()
        last = y[offs[-1]:offs[-1] + M * shapes[-1][0]].view(M, -1)
        err = ((last - xr).norm() / xr.norm()).item() if wait else float("nan")
        t = bench(run)
        print(f"M=1 warp-specialised, claimed one unit at a time, {per_sm}/SM, {S} slots, "
              f"{'a wait each GEMM' if wait else 'no waits (wrong)':17s} {'per warp' if per_warp else 'per thread'} {t:8.1f} us  {t / 8:6.1f} us a layer  "
              f"rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
