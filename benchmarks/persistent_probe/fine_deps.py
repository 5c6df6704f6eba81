"""Probe: the decoder GEMMs of 8 Llama-3.1-8B layers (q/k/v, o, gate/up, down; bf16; M tokens) as
one persistent Triton kernel, with each GEMM's units waiting either for the whole GEMM before
(coarse: one counter per GEMM, as 082a22a's probe) or only for the row tiles of the GEMM before
that their x slice comes from (fine: a counter per producer row tile, counting its K steps
flushed). Units are walked tile-major (a CTA's share: few row tiles, many K steps, so its x slices
come from many producer tiles) or K-major (a share: few K steps across many row tiles, so its x
slices come from 2-4 producer tiles); the weights are stored in the walk's order.

Hypothesis: a coarse wait costs the spread of all CTAs' ends (2.5-3 µs a boundary, four a layer);
a fine wait costs the spread of the few CTAs that produced its slice.

On a GPU, from the repository root:  python benchmarks/persistent_probe/fine_deps.py [--orders 0,1,2] [--m 1,16]
On the CPU (numerics and counters only, each GEMM its own launch):  TRITON_INTERPRET=1 python benchmarks/persistent_probe/fine_deps.py --cpu
"""
import sys
import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")

BN, BK = 64, 128
DEPS_LIST = (1, 2, 3, 0)
ORDERS = ("tile-major", "K-major   ", "alternate ")


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _unit(u, n_tiles, KS, kmajor):
    """(row tile, K step) of unit u."""
    return tl.where(kmajor, u % n_tiles, u // KS), tl.where(kmajor, u // n_tiles, u % KS)


@triton.jit
def _wait_fine(cnt_ptr, err_ptr, prev_cnt_off, prev_ks, a, b, n_tiles, KS, kmajor, BN: tl.constexpr,
               BK: tl.constexpr, CHUNK: tl.constexpr, MAX_SPINS: tl.constexpr):
    """Until every producer row tile that an x slice of units [a, b) reads has all its K steps."""
    R: tl.constexpr = BK // BN
    j = tl.arange(0, CHUNK * R)
    for c in range(a, b, CHUNK):
        u = c + j // R
        t, k = _unit(u, n_tiles, KS, kmajor)
        ptrs = cnt_ptr + prev_cnt_off + k * R + j % R
        live = u < b
        waiting = prev_ks >= 0     # a scalar loop variable: a tensor one breaks Triton 3.6's layout pass
        spins = 0
        while waiting:
            have = tl.atomic_add(ptrs, 0, mask=live, sem="acquire", scope="gpu")
            waiting = tl.min(tl.where(live, have, prev_ks)) < prev_ks
            spins += 1
            if spins > MAX_SPINS:    # a wrong dependency: give up and say so rather than hang
                tl.atomic_add(err_ptr, 1)
                waiting = spins < 0


@triton.jit
def _fence_acquire():
    tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_fine_volatile(cnt_ptr, err_ptr, prev_cnt_off, prev_ks, a, b, n_tiles, KS, kmajor, BN: tl.constexpr,
                        BK: tl.constexpr, CHUNK: tl.constexpr, MAX_SPINS: tl.constexpr, FENCE: tl.constexpr):
    """As _wait_fine, polling by volatile (relaxed) loads, then one acquire fence."""
    R: tl.constexpr = BK // BN
    j = tl.arange(0, CHUNK * R)
    for c in range(a, b, CHUNK):
        u = c + j // R
        t, k = _unit(u, n_tiles, KS, kmajor)
        ptrs = cnt_ptr + prev_cnt_off + k * R + j % R
        live = u < b
        waiting = prev_ks >= 0
        spins = 0
        while waiting:
            have = tl.load(ptrs, mask=live, other=0, volatile=True)
            waiting = tl.min(tl.where(live, have, prev_ks)) < prev_ks
            spins += 1
            if spins > MAX_SPINS:
                tl.atomic_add(err_ptr, 1)
                waiting = spins < 0
    if FENCE:
        _fence_acquire()


@triton.jit
def _publish_runs(cnt_ptr, cnt_off, a, b, n_tiles, KS, kmajor, CHUNK: tl.constexpr):
    """As _publish, one atomic per distinct row tile of [a, b), adding how many of its K steps the
    share holds (tile-major: the share's few tiles; K-major: at most n_tiles distinct ones)."""
    j = tl.arange(0, CHUNK)
    if kmajor:
        hi = tl.minimum(b, a + n_tiles)
        for c in range(a, hi, CHUNK):
            u = c + j
            t = u % n_tiles
            n_b = tl.maximum(b - t + n_tiles - 1, 0) // n_tiles
            n_a = tl.maximum(a - t + n_tiles - 1, 0) // n_tiles
            tl.atomic_add(cnt_ptr + cnt_off + t, n_b - n_a, mask=u < hi, sem="release", scope="gpu")
    else:
        t0 = a // KS
        t1 = tl.where(b > a, (b - 1) // KS + 1, t0)
        for c in range(t0, t1, CHUNK):
            t = c + j
            n = tl.minimum(b, (t + 1) * KS) - tl.maximum(a, t * KS)
            tl.atomic_add(cnt_ptr + cnt_off + t, n, mask=t < t1, sem="release", scope="gpu")


@triton.jit
def _publish(cnt_ptr, cnt_off, a, b, n_tiles, KS, kmajor, CHUNK: tl.constexpr):
    """One K step done for each unit of [a, b): its row tile's counter."""
    j = tl.arange(0, CHUNK)
    for c in range(a, b, CHUNK):
        u = c + j
        t, k = _unit(u, n_tiles, KS, kmajor)
        tl.atomic_add(cnt_ptr + cnt_off + t, 1, mask=u < b, sem="release", scope="gpu")


@triton.jit
def layer_stream(w_ptr, y_ptr, meta_ptr, cnt_ptr, done_ptr, err_ptr, M, NPROG, G0, G1,
                 BN: tl.constexpr, BK: tl.constexpr, ORDER: tl.constexpr, DEPS: tl.constexpr,
                 PREFETCH: tl.constexpr, CHUNK: tl.constexpr, MAX_SPINS: tl.constexpr = 1 << 18,
                 FENCE: tl.constexpr = True):
    """GEMMs [G0, G1) of meta (per GEMM: weight offset, N, K, y offset, x offset, x row stride,
    counter offset). ORDER 0: every GEMM's units tile-major, 1: K-major, 2: K-major in the odd GEMMs
    (o, down: the ones after attention and SwiGLU, which a real layer could start per slice).
    DEPS 0: no wait (wrong results; the stream alone), 1: the whole GEMM before, 2: the producer
    tiles of the unit's x slice, 3: as 2, published once per distinct tile and polled by relaxed loads. A wait that spins MAX_SPINS polls gives up and counts itself in
    err (a probe that hangs tells nothing)."""
    pid = tl.program_id(0)
    r = tl.arange(0, BN)
    kk = tl.arange(0, BK)
    m = tl.arange(0, 16)
    tile = r[:, None] * BK + kk[None, :]
    for g in range(G0, G1):
        w_off = tl.multiple_of(tl.load(meta_ptr + g * 7 + 0), 16)
        N = tl.multiple_of(tl.load(meta_ptr + g * 7 + 1), 16)
        K = tl.multiple_of(tl.load(meta_ptr + g * 7 + 2), 16)
        y_off = tl.multiple_of(tl.load(meta_ptr + g * 7 + 3), 16)
        x_off = tl.multiple_of(tl.load(meta_ptr + g * 7 + 4), 16)
        x_stride = tl.multiple_of(tl.load(meta_ptr + g * 7 + 5), 16)
        cnt_off = tl.load(meta_ptr + g * 7 + 6)
        prev_cnt_off = tl.load(meta_ptr + tl.maximum(g - 1, 0) * 7 + 6)
        prev_ks = tl.load(meta_ptr + tl.maximum(g - 1, 0) * 7 + 2) // BK
        KS = K // BK
        n_tiles = N // BN
        km = (ORDER == 1) | ((ORDER == 2) & (g % 2 == 1))
        n_units = n_tiles * KS
        a = n_units * pid // NPROG
        b = n_units * (pid + 1) // NPROG
        if PREFETCH > 0:
            lines = tl.arange(0, BN * BK // 64)
            for p in tl.static_range(PREFETCH):
                _prefetch_l2(w_ptr + w_off + tl.minimum(a + p, b - 1) * (BN * BK) + lines * 64)
        if g > G0:
            if DEPS == 1:
                v = tl.atomic_add(done_ptr + g - 1, 0, sem="acquire", scope="gpu")
                spins = 0
                while v < NPROG:
                    v = tl.atomic_add(done_ptr + g - 1, 0, sem="acquire", scope="gpu")
                    spins += 1
                    if spins > MAX_SPINS:
                        tl.atomic_add(err_ptr, 1)
                        v = NPROG
            if DEPS == 2:
                _wait_fine(cnt_ptr, err_ptr, prev_cnt_off, prev_ks, a, b, n_tiles, KS, km, BN, BK, CHUNK,
                           MAX_SPINS)
            if DEPS == 3:
                _wait_fine_volatile(cnt_ptr, err_ptr, prev_cnt_off, prev_ks, a, b, n_tiles, KS, km, BN, BK, CHUNK,
                                    MAX_SPINS, FENCE)
            tl.debug_barrier()      # the threads that load x after the threads that acquired
        acc = tl.zeros([BN, 16], tl.float32)
        cur = _unit(a, n_tiles, KS, km)[0]
        for u in range(a, b):
            t, k = _unit(u, n_tiles, KS, km)
            w = tl.load(w_ptr + w_off + u * (BN * BK) + tile)
            x = tl.load(y_ptr + x_off + m[:, None] * x_stride + k * BK + kk[None, :], mask=(m < M)[:, None],
                        other=0.0, cache_modifier=".cg").to(w_ptr.dtype.element_ty)
            if t != cur:
                tl.atomic_add(y_ptr + y_off + m[None, :] * N + (cur * BN + r)[:, None], acc,
                              mask=(m < M)[None, :], sem="relaxed")
                acc = tl.zeros([BN, 16], tl.float32)
                cur = t
            acc = tl.dot(w, tl.trans(x), acc)
        if b > a:
            tl.atomic_add(y_ptr + y_off + m[None, :] * N + (cur * BN + r)[:, None], acc,
                          mask=(m < M)[None, :], sem="relaxed")
        tl.debug_barrier()
        if DEPS == 1:
            tl.atomic_add(done_ptr + g, 1, sem="release", scope="gpu")
        if DEPS == 2:
            _publish(cnt_ptr, cnt_off, a, b, n_tiles, KS, km, CHUNK)
        if DEPS == 3:
            _publish_runs(cnt_ptr, cnt_off, a, b, n_tiles, KS, km, CHUNK)


def stored(w, kmajor):
    """w [N, K] as BN x BK tiles in the kernel's walk order."""
    n, k = w.shape
    t = w.view(n // BN, BN, k // BK, BK)
    return (t.permute(2, 0, 1, 3) if kmajor else t.permute(0, 2, 1, 3)).contiguous().view(-1)


def problem(shapes, M, dev, dtype=torch.bfloat16):
    """y buffer (x0 [M, K0] then each GEMM's y [M, N]), meta, counters, and the float64 reference
    chain (x rounded to the weights' dtype before each GEMM, as the kernel reads it)."""
    torch.manual_seed(0)
    ws = [(torch.randn(n, k, device=dev) / k ** 0.5).to(dtype) for n, k in shapes]
    offs, o = [], M * shapes[0][1]
    for n, _ in shapes:
        offs.append(o)
        o += M * n
    meta, w_off, prev_off, prev_stride, c_off = [], 0, 0, shapes[0][1], 0
    for (n, k), yo in zip(shapes, offs):
        meta.append([w_off, n, k, yo, prev_off, prev_stride, c_off])
        w_off += n * k
        prev_off, prev_stride = yo, n
        c_off += n // BN
    x0 = torch.randn(M, shapes[0][1], device=dev).to(dtype)
    xr, refs = x0.double(), []
    for w, (n, k) in zip(ws, shapes):
        yr = xr[:, :k] @ w.double().t()
        refs.append(yr)
        xr = yr.to(dtype).double()
    return ws, torch.tensor(meta, dtype=torch.int64, device=dev), o, c_off, offs, x0, refs


def kmajor_of(order, g):
    return order == 1 or (order == 2 and g % 2 == 1)


def weights_stored(ws, order):
    return torch.cat([stored(w, kmajor_of(order, g)) for g, w in enumerate(ws)])


def run_kernel(wt, y, meta, cnt, done, x0, M, nprog, ng, order, deps, per_gemm=False, **launch):
    y.zero_()
    y[:x0.numel()].copy_(x0.float().view(-1))
    cnt.zero_()
    done.zero_()
    spans = [(g, g + 1) for g in range(ng)] if per_gemm else [(0, ng)]
    for g0, g1 in spans:
        layer_stream[(nprog,)](wt, y, meta, cnt, done, done[ng:], M, nprog, g0, g1, BN=BN, BK=BK, ORDER=order, DEPS=deps,
                               CHUNK=32, **launch)


def rel_err(y, offs, shapes, refs, M):
    n = shapes[-1][0]
    got = y[offs[-1]:offs[-1] + M * n].view(M, n).double()
    return ((got - refs[-1]).norm() / refs[-1].norm()).item()


def cpu_check():
    """Small shapes, each GEMM its own launch (the interpreter runs programs one after another, so a
    wait on a later program would never end): numerics of both walks and every tile's counter."""
    shapes = [(384, 256), (256, 256), (1024, 256), (256, 512)] * 2
    for M in (1, 5):
        # fp16: the interpreter's bf16 dot is wrong (numpy has no bf16)
        ws, meta, ylen, ncnt, offs, x0, refs = problem(shapes, M, "cpu", torch.float16)
        for order in (0, 1, 2):
            wt = weights_stored(ws, order)
            for deps in (1, 2, 3):
                y = torch.full((ylen,), float("nan"))
                cnt = torch.zeros(ncnt, dtype=torch.int32)
                done = torch.zeros(len(shapes) + 1, dtype=torch.int32)
                run_kernel(wt, y, meta, cnt, done, x0, M, 5, len(shapes), order, deps, per_gemm=True,
                           PREFETCH=0, FENCE=False)
                err = rel_err(y, offs, shapes, refs, M)
                want = torch.cat([torch.full((n // BN,), k // BK, dtype=torch.int32) for n, k in shapes])
                counted = torch.equal(cnt, want) if deps >= 2 else torch.equal(done[:-1], torch.full_like(done[:-1], 5))
                print(f"M={M} order={order} deps={deps}: rel err {err:.1e}, counters {'ok' if counted else 'WRONG'}")
                assert err < 1e-2 and counted
                # one program through all GEMMs: every wait runs, and must find its counters complete
                run_kernel(wt, y, meta, cnt, done, x0, M, 1, len(shapes), order, deps, PREFETCH=0, FENCE=False)
                assert rel_err(y, offs, shapes, refs, M) < 1e-2


def bench(fn, reps=20):
    g = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps + 1):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        if i:
            times.append(s.elapsed_time(e) * 1e3)
    return sorted(times)[len(times) // 2]


def gpu(orders, ms):
    from engine.kernels.stream_triton import stream_matmul
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] * 8
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b2 = torch.empty_like(a)
    for _ in range(3):
        b2.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b2.copy_(a)
    e.record()
    torch.cuda.synchronize()
    copy = 2 * a.numel() * 10 / (s.elapsed_time(e) * 1e-3)
    del a, b2
    nbytes = sum(n * k * 2 for n, k in shapes)
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e9:.0f} GB/s; {nsm} SMs; {nbytes / 1e6:.0f} MB of "
          f"weights, 32 GEMMs; µs a layer (8 layers a graph replay, median of 20)", flush=True)
    for M in ms:
        ws, meta, ylen, ncnt, offs, x0, refs = problem(shapes, M, dev)
        outs = [torch.empty(M, n, device=dev, dtype=torch.bfloat16) for n, _ in shapes]

        def engine_chain():
            x = x0
            for w, out, (n, k) in zip(ws, outs, shapes):
                stream_matmul(x[:, :k], w, out)
                x = out
        t_eng = bench(engine_chain)
        err = ((outs[-1].double() - refs[-1]).norm() / refs[-1].norm()).item()
        print(f"M={M:2d} engine streaming kernel, 32 launches: {t_eng / 8:6.1f}  "
              f"{nbytes / (t_eng * 1e-6) / copy:4.0%} of copy  rel err {err:.1e}", flush=True)
        y = torch.zeros(ylen, device=dev)
        cnt = torch.zeros(ncnt, dtype=torch.int32, device=dev)
        done = torch.zeros(len(shapes) + 1, dtype=torch.int32, device=dev)

        def zeroing():    # what every persistent variant's graph does before its kernel
            y.zero_()
            y[:x0.numel()].copy_(x0.float().view(-1))
            cnt.zero_()
            done.zero_()
        t_zero = bench(zeroing)
        print(f"M={M:2d} the persistent variants' zeroing alone (in each figure below): {t_zero / 8:6.2f} a layer",
              flush=True)
        for order in orders:
            wt = weights_stored(ws, order)
            for per_sm, stages, prefetch in CONFIGS:
                nprog = nsm * per_sm
                for deps in DEPS_LIST:
                    k = layer_stream.warmup(wt, y, meta, cnt, done, done[len(shapes):], M, nprog, 0, len(shapes), BN=BN, BK=BK,
                                            ORDER=order, DEPS=deps, PREFETCH=prefetch, CHUNK=32, num_warps=4,
                                            num_stages=stages, grid=(1,))
                    k._init_handles()
                    props = torch.cuda.get_device_properties(dev)
                    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
                    fit = min(smem // max(k.metadata.shared, 1),
                              65536 // (k.n_regs * 32 * 4))
                    if fit < per_sm:    # the waits need every CTA resident: it would hang
                        print(f"M={M:2d} {per_sm}/SM {stages} stages deps={deps}: {fit} fit an SM "
                              f"({k.n_regs} registers, {k.metadata.shared} B shared), skipped", flush=True)
                        continue

                    def fn():
                        run_kernel(wt, y, meta, cnt, done, x0, M, nprog, len(shapes), order, deps,
                                   PREFETCH=prefetch, num_warps=4, num_stages=stages)
                    try:
                        t = bench(fn)
                    except Exception as ex:    # a config that does not fit: say so, go on
                        print(f"M={M:2d} order={order} {per_sm}/SM {stages} stages prefetch {prefetch} "
                              f"deps={deps}: {type(ex).__name__} {str(ex)[:120]}", flush=True)
                        torch.cuda.synchronize()
                        continue
                    err = rel_err(y, offs, shapes, refs, M)
                    print(f"M={M:2d} {ORDERS[order]} {per_sm}/SM {stages} stages "
                          f"prefetch {prefetch} deps={['none', 'coarse', 'fine', 'fine-agg'][deps]:8s}: {t / 8:6.1f}  "
                          f"{nbytes / (t * 1e-6) / copy:4.0%} of copy  rel err {err:.1e}"
                          f"{'  WAITS GAVE UP: %d' % int(done[-1]) if int(done[-1]) else ''}", flush=True)
        ws.clear()
        wt = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--orders", default="0,1,2")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--deps", default="1,2,3,0")
    ap.add_argument("--configs", default="2.4.4,2.4.0,3.3.4")
    args = ap.parse_args()
    DEPS_LIST = tuple(int(d) for d in args.deps.split(","))
    CONFIGS = tuple(tuple(int(v) for v in c.split(".")) for c in args.configs.split(","))
    if args.cpu:
        cpu_check()
    else:
        gpu([int(o) for o in args.orders.split(",")], [int(m) for m in args.m.split(",")])
