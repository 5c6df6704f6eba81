"""Probe: the 32 decode GEMMs of 8 Llama-3.1-8B layers (bf16, M <= 8) as one persistent Gluon kernel
whose CTAs claim 16-KB units (a 64-row x 128-K weight tile) from one global counter, in order over
all GEMMs, four claims ahead of their use: each claimed unit's tile is copied by cp.async into a
5-slot shared ring as soon as it is claimed, so the copies run on across a GEMM boundary while the
unit that crosses it waits for the GEMM before. Partial sums go to an fp32 y by atomics; a counter
per GEMM counts its consumed units (each CTA adds its count, with release, when it moves past the
GEMM). Units are claimed B at a time (one atomic, whose result the CTA waits for, one batch ahead).
Against the engine's streaming kernel launched per GEMM, in CUDA graphs.
Run from the repository root on a GPU: python benchmarks/persistent_probe/dyn_gemms.py [--diagnose]"""
import sys
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp_async
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

sys.path.insert(0, ".")

_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_copy_to_shared = getattr(cp_async, "async_load", None) or cp_async.async_copy_global_to_shared

BN = gl.constexpr(64)
BK = gl.constexpr(128)
S = gl.constexpr(5)                                # ring slots: S - 1 units in flight
W_SMEM = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))


@gluon.jit
def _issue(slot, w_ptr, u, total, tile, BN: gl.constexpr, BK: gl.constexpr):
    """cp.async of unit u's tile (16 KB, contiguous) into `slot`, as one group; nothing past total."""
    _copy_to_shared(slot, w_ptr + u.to(gl.int64) * (BN * BK) + tile, mask=(tile >= 0) & (u < total))
    cp_async.commit_group()


@gluon.jit
def _claim(claim_ptr, B: gl.constexpr):
    return gl.atomic_add(claim_ptr, B, sem="relaxed", scope="gpu")


@gluon.jit
def _advance(nxt_u, batch_end, pending, claim_ptr, B: gl.constexpr, CLAIM: gl.constexpr, share_end):
    """The unit after nxt_u: the next of its batch, or the first of the pending batch (and a new
    batch claimed). CLAIM False: the CTA's own contiguous share, no atomics (past it: share_end + big)."""
    nxt_u += 1
    if nxt_u == batch_end:
        nxt_u = pending
        batch_end = pending + B
        if CLAIM:
            pending = _claim(claim_ptr, B)
        else:
            pending = pending + B
            pending = gl.where(pending >= share_end, pending + (1 << 28), pending)
    return nxt_u, batch_end, pending


@gluon.jit
def dyn_gemms(w_ptr, y_ptr, meta_ptr, bounds_ptr, done_ptr, claim_ptr, M, total, WAIT: gl.constexpr,
              B: gl.constexpr, CLAIM: gl.constexpr = True, MATH: gl.constexpr = 7):
    """meta [G, 6] int64: (unused, N, K, y offset, x offset, x row stride) per GEMM; bounds [G + 1]
    int32: each GEMM's first global unit; units are numbered GEMM by GEMM, row tile major, and
    stored in that order (unit u's tile at w_ptr + u * BN * BK)."""
    W: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    b_l: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [W, 1], [1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [S, BN, BK], W_SMEM)
    rr = gl.arange(0, BN, layout=gl.SliceLayout(1, cp_l))
    cc = gl.arange(0, BK, layout=gl.SliceLayout(0, cp_l))
    tile = rr[:, None] * BK + cc[None, :]
    kk = gl.arange(0, BK, layout=gl.SliceLayout(1, b_l))
    nb = gl.arange(0, 8, layout=gl.SliceLayout(0, b_l))
    ro = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    no = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))

    # units are claimed B at a time (one atomic, whose result the CTA waits for), one batch ahead
    share = gl.cdiv(gl.cdiv(total, gl.num_programs(0)), B) * B
    share_end = gl.minimum((gl.program_id(0) + 1) * share, total)
    if CLAIM:
        nxt_u = _claim(claim_ptr, B)
        pending = _claim(claim_ptr, B)
    else:
        nxt_u = gl.program_id(0) * share
        pending = nxt_u + B
    batch_end = nxt_u + B
    q0 = nxt_u
    _issue(ring.index(0), w_ptr, q0, total, tile, BN, BK)
    nxt_u, batch_end, pending = _advance(nxt_u, batch_end, pending, claim_ptr, B, CLAIM, share_end)
    q1 = nxt_u
    _issue(ring.index(1), w_ptr, q1, total, tile, BN, BK)
    nxt_u, batch_end, pending = _advance(nxt_u, batch_end, pending, claim_ptr, B, CLAIM, share_end)
    q2 = nxt_u
    _issue(ring.index(2), w_ptr, q2, total, tile, BN, BK)
    nxt_u, batch_end, pending = _advance(nxt_u, batch_end, pending, claim_ptr, B, CLAIM, share_end)
    q3 = nxt_u
    _issue(ring.index(3), w_ptr, q3, total, tile, BN, BK)
    nxt_u, batch_end, pending = _advance(nxt_u, batch_end, pending, claim_ptr, B, CLAIM, share_end)
    # q0's GEMM and x (x_ok: loaded); the first GEMM's x is the input, ready from the start
    g0 = _gemm_of(q0, q0 * 0, bounds_ptr, total)
    x0 = _x_for(q0, g0, y_ptr, meta_ptr, bounds_ptr, kk, nb, M, BK, MATH // 8 % 2 == 1)
    x_ok = g0 == 0
    count = 0
    ready = 0          # GEMMs up to this one have their inputs complete, as this CTA has seen
    j = 0
    while q0 < total:
        cp_async.wait_group(S - 2)     # unit q0's copy has landed
        _cta_barrier()                 # and every warp is past the slot the next copy reuses
        q4 = nxt_u
        _issue(ring.index((j + S - 1) % S), w_ptr, q4, total, tile, BN, BK)
        nxt_u, batch_end, pending = _advance(nxt_u, batch_end, pending, claim_ptr, B, CLAIM, share_end)
        if WAIT:
            if g0 > ready:
                need = gl.load(bounds_ptr + g0) - gl.load(bounds_ptr + g0 - 1)
                v = gl.atomic_add(done_ptr + g0 - 1, 0, sem="acquire", scope="gpu")
                while v < need:
                    v = gl.atomic_add(done_ptr + g0 - 1, 0, sem="acquire", scope="gpu")
                ready = g0
        if not x_ok:
            if MATH % 2 == 1:
                x0 = _x_for(q0, g0, y_ptr, meta_ptr, bounds_ptr, kk, nb, M, BK, MATH // 8 % 2 == 1)
        # the next unit's GEMM, and its x now if its inputs are known complete (loaded under this unit's math)
        g1 = _gemm_of(q1, g0, bounds_ptr, total)
        x1_ok = (g1 <= ready) | (not WAIT)
        x1 = x0
        if x1_ok:
            if MATH % 2 == 1:
                x1 = _x_for(q1, g1, y_ptr, meta_ptr, bounds_ptr, kk, nb, M, BK, MATH // 8 % 2 == 1)
        N = gl.load(meta_ptr + g0 * 6 + 1).to(gl.int32)
        K = gl.load(meta_ptr + g0 * 6 + 2).to(gl.int32)
        y_off = gl.load(meta_ptr + g0 * 6 + 3)
        t = (q0 - gl.load(bounds_ptr + g0)) // (K // BK)
        # MATH bits: 1 x loaded, 2 the MMA, 4 the atomics (else a store never taken keeps the rest alive)
        if MATH // 2 % 2 == 1:
            a = ring.index(j % S).load(a_l)
            acc = mma_v2(a, x0, gl.zeros([BN, 8], gl.float32, layout=mma))
        else:
            acc = gl.zeros([BN, 8], gl.float32, layout=mma) + gl.convert_layout(
                gl.sum(x0.to(gl.float32), axis=0), gl.SliceLayout(0, mma))[None, :]
        if MATH // 4 % 2 == 1:
            gl.atomic_add(y_ptr + y_off + no[None, :] * N + t * BN + ro[:, None], acc, mask=(no < M)[None, :],
                          sem="relaxed")
        else:
            if q0 == -7:
                gl.store(y_ptr + no[None, :] * N + ro[:, None], acc)
        count += 1
        if g1 != g0:                   # past g0: hand over this CTA's count of its units
            if WAIT:
                _cta_barrier()
                gl.atomic_add(done_ptr + g0, count, sem="release", scope="gpu")
            count = 0
        g0 = g1
        x0 = x1
        x_ok = x1_ok
        q0 = q1
        q1 = q2
        q2 = q3
        q3 = q4
        j += 1
    cp_async.wait_group(0)


@gluon.jit
def _gemm_of(u, g, bounds_ptr, total):
    """The GEMM of unit u, searching on from g (a CTA's units only grow); past the last, the count."""
    if u < total:
        while u >= gl.load(bounds_ptr + g + 1):
            g += 1
    else:
        g = u * 0 + (1 << 20)
    return g


@gluon.jit
def _x_for(u, g, y_ptr, meta_ptr, bounds_ptr, kk, nb, M, BK: gl.constexpr, X_L1: gl.constexpr = False):
    """Unit u's slice of x (its GEMM's input rows, K step u mod K / BK), as the MMA's B operand."""
    gg = gl.minimum(g, 31)
    K = gl.load(meta_ptr + gg * 6 + 2).to(gl.int32)
    x_off = gl.load(meta_ptr + gg * 6 + 4)
    x_stride = gl.load(meta_ptr + gg * 6 + 5)
    k = (u - gl.load(bounds_ptr + gg)) % (K // BK)
    ok = (nb < M) & (g < (1 << 20))
    ptrs = y_ptr + x_off + nb[None, :] * x_stride + k * BK + kk[:, None]
    if X_L1:    # after the acquire that saw its GEMM complete, L1 holds no stale line of it
        return gl.load(ptrs, mask=ok[None, :], other=0.0).to(gl.bfloat16)
    return gl.load(ptrs, mask=ok[None, :], other=0.0, cache_modifier=".cg").to(gl.bfloat16)


def tiled(w):
    n, k = w.shape
    bn, bk = BN.value, BK.value
    return w.view(n // bn, bn, k // bk, bk).permute(0, 2, 1, 3).contiguous().view(-1)


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
    wt = torch.cat([tiled(w) for w in ws])
    units = [n // BN.value * (k // BK.value) for n, k in shapes]
    bounds = torch.tensor([0] + list(torch.tensor(units).cumsum(0)), dtype=torch.int32, device=dev)
    total = int(bounds[-1])
    for M in (1, 8):
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
        ref = xr
        outs = [torch.empty(M, n, device=dev, dtype=torch.bfloat16) for n, _ in shapes]
        xb = x0.to(torch.bfloat16)

        def engine_chain():
            x = xb
            for w, out, (n, k) in zip(ws, outs, shapes):
                stream_matmul(x[:, :k], w, out)
                x = out
        t = bench(engine_chain)
        print(f"M={M} engine streaming kernel, 32 launches {t:8.1f} us  {t / 8:6.1f} us a layer", flush=True)
        for per_sm, B in ((2, 4), (2, 8), (2, 2), (3, 4)):
            nprog = nsm * per_sm
            for wait in (True, False):
                def run():
                    y.zero_(); done.zero_(); claim.zero_()
                    y[:M * 4096].copy_(x0.view(-1))
                    dyn_gemms[(nprog,)](wt, y, meta, bounds, done, claim, M, total, WAIT=wait, B=B, num_warps=4)
                run(); torch.cuda.synchronize()
                last = y[offs[-1]:offs[-1] + M * shapes[-1][0]].view(M, -1)
                err = ((last - ref).norm() / ref.norm()).item() if wait else float("nan")
                t = bench(run)
                print(f"M={M} claimed units {B} at a time, {per_sm}/SM, {'a wait each GEMM' if wait else 'no waits (wrong)':17s} "
                      f"{t:8.1f} us  {t / 8:6.1f} us a layer  rel err {err:.1e}", flush=True)


def diagnose():
    """No waits, M = 1: the stream with claims or a static share, with or without the math."""
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] * 8
    wt = torch.cat([tiled((torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)) for n, k in shapes])
    units = [n // BN.value * (k // BK.value) for n, k in shapes]
    bounds = torch.tensor([0] + list(torch.tensor(units).cumsum(0)), dtype=torch.int32, device=dev)
    total = int(bounds[-1])
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
    # (CTAs an SM, claimed or a static share, MATH bits: 1 x loaded, 2 the MMA, 4 the atomics, 8 x through L1)
    for per_sm, claim_on, math in ((2, True, 0), (2, False, 0), (4, False, 0), (2, True, 7), (2, False, 7),
                                   (2, True, 6), (2, True, 1), (2, True, 15), (2, True, 9)):
        nprog = per_sm * nsm
        def run():
            y.zero_(); done.zero_(); claim.zero_()
            dyn_gemms[(nprog,)](wt, y, meta, bounds, done, claim, M, total, WAIT=False, B=8, CLAIM=claim_on,
                                MATH=math, num_warps=4)
        t = bench(run)
        print(f"{per_sm}/SM B=8 {'claimed' if claim_on else 'static share'}, no waits, math bits {math} "
              f"(1 x, 2 MMA, 4 atomics, 8 x through L1): {t:8.1f} us  {t / 8:6.1f} us a layer", flush=True)
    x0 = torch.randn(M, 4096, device=dev).to(torch.bfloat16).float()
    torch.manual_seed(0)
    ws = [(torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16) for n, k in shapes]
    xr = x0
    for w, (n, k) in zip(ws, shapes):
        xr = xr[:, :k].to(torch.bfloat16).float() @ w.float().t()
    for B in (8, 4):
        def runw():
            y.zero_(); done.zero_(); claim.zero_()
            y[:M * 4096].copy_(x0.view(-1))
            dyn_gemms[(2 * nsm,)](wt, y, meta, bounds, done, claim, M, total, WAIT=True, B=B, CLAIM=True,
                                  MATH=15, num_warps=4)
        runw(); torch.cuda.synchronize()
        last = y[offs[-1]:offs[-1] + M * shapes[-1][0]].view(M, -1)
        err = ((last - xr).norm() / xr.norm()).item()
        t = bench(runw)
        print(f"2/SM B={B} claimed, waits, x through L1: {t:8.1f} us  {t / 8:6.1f} us a layer  rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    if "--diagnose" in sys.argv:
        diagnose()
        sys.exit()
    main()
