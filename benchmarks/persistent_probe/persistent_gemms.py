"""Probe: the decoder GEMMs of 8 Llama-3.1-8B layers (q/k/v, o, gate/up, down; bf16; M tokens) as
one persistent Triton kernel against the engine's streaming kernel launched per GEMM (a CUDA graph
of each). Weights stored as contiguous 64 x 128 tiles in the order the kernel walks them (row tile
major, K steps within); every CTA takes an equal contiguous share of each GEMM's (tile, K step)
units; partial sums go to an fp32 y by atomics; a counter per GEMM, and each CTA loads its first
weights of a GEMM before it waits for the GEMM before (whose y is its x).

Run from the repository root on a GPU:
  python benchmarks/persistent_probe/persistent_gemms.py              variants against the engine's launches
  python benchmarks/persistent_probe/persistent_gemms.py --stamps     %globaltimer per CTA and GEMM: loop,
                                                                      end spread, release, wake; pace by SM
  python benchmarks/persistent_probe/persistent_gemms.py --weighted   shares sized per SM (%smid) and GEMM
                                                                      kind to the measured pace
  python benchmarks/persistent_probe/persistent_gemms.py --alternate  the engine and the kernel, alternately
  python benchmarks/persistent_probe/persistent_gemms.py --prefetch   0-16 next units prefetched to L2
  python benchmarks/persistent_probe/persistent_gemms.py --gemv       M = 1 on the CUDA cores, weights in
                                                                      registers"""
import sys, torch, triton, triton.language as tl

sys.path.insert(0, ".")
from engine.kernels.stream_triton import stream_matmul, stream_config

BN, BK = 64, 128


@triton.jit
def _nap(ns: tl.constexpr):
    return tl.inline_asm_elementwise(f"nanosleep.u32 {ns}; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _wait_at_least(ptr, need, SLEEP: tl.constexpr = 0):
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while v < need:
        if SLEEP > 0:
            _nap(SLEEP)
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _flush(acc, y_ptr, y_off, N, t, r, m, M, BN: tl.constexpr):
    tl.atomic_add(y_ptr + y_off + m[None, :] * N + (t * BN + r)[:, None], acc, mask=(m < M)[None, :], sem="relaxed")


@triton.jit
def _x_tile(y_ptr, x_off, x_stride, k, m, kk, M, BK: tl.constexpr, X_L1: tl.constexpr):
    ptrs = y_ptr + x_off + m[:, None] * x_stride + k * BK + kk[None, :]
    if X_L1:    # safe: no CTA reads a y before its GEMM's counter is complete
        return tl.load(ptrs, mask=(m < M)[:, None], other=0.0).to(tl.bfloat16)
    return tl.load(ptrs, mask=(m < M)[:, None], other=0.0, cache_modifier=".cg").to(tl.bfloat16)


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1).to(tl.int64)


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def persistent_gemms(w_ptr, y_ptr, meta_ptr, done_ptr, M, NPROG, NG: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, U: tl.constexpr, WAIT: tl.constexpr, PIPE: tl.constexpr,
                     PREFETCH: tl.constexpr, stamps_ptr=None, STAMPS: tl.constexpr = False,
                     X_L1: tl.constexpr = False, WORK: tl.constexpr = 0, cum_ptr=None, tickets_ptr=None,
                     WEIGHTED: tl.constexpr = False, PER_SM: tl.constexpr = 2, xp_ptr=None,
                     SLEEP: tl.constexpr = 0):
    """U = 2: two units' weights in registers a step, the wait after the first step's loads.
    PIPE (U = 1): Triton's cp.async pipeline over the units; the wait before the loop, after an
    L2 prefetch of the first PREFETCH units."""
    pid = tl.program_id(0)
    if WEIGHTED:    # this CTA's share by its SM: slot = SM x PER_SM + its arrival order there
        sm = _smid().to(tl.int32)
        slot = sm * PER_SM + tl.atomic_add(tickets_ptr + sm, 1)
        lo_frac = 0.0
        hi_frac = 1.0
    else:
        slot = pid
    r = tl.arange(0, BN)
    kk = tl.arange(0, BK)
    m = tl.arange(0, 16)
    tile = r[:, None] * BK + kk[None, :]
    for g in range(NG):
        w_off = tl.multiple_of(tl.load(meta_ptr + g * 6 + 0), 16)
        N = tl.multiple_of(tl.load(meta_ptr + g * 6 + 1), 16)
        K = tl.multiple_of(tl.load(meta_ptr + g * 6 + 2), 16)
        y_off = tl.multiple_of(tl.load(meta_ptr + g * 6 + 3), 16)
        x_off = tl.multiple_of(tl.load(meta_ptr + g * 6 + 4), 16)
        x_stride = tl.multiple_of(tl.load(meta_ptr + g * 6 + 5), 16)
        KS = K // BK
        n_units = (N // BN) * KS
        if WEIGHTED:    # a table per GEMM kind (g % 4): [4, NPROG + 1] cumulative shares by slot
            lo_frac = tl.load(cum_ptr + (g % 4) * (NPROG + 1) + slot)
            hi_frac = tl.load(cum_ptr + (g % 4) * (NPROG + 1) + slot + 1)
            a = (n_units.to(tl.float32) * lo_frac).to(tl.int32)
            b = (n_units.to(tl.float32) * hi_frac).to(tl.int32)
        else:
            a = n_units * pid // NPROG
            b = n_units * (pid + 1) // NPROG
        acc = tl.zeros([BN, 16], tl.float32)
        cur = a // KS
        first = True
        if STAMPS:
            tl.store(stamps_ptr + (pid * NG + g) * 4 + 0, _now())
            if g == 0:
                tl.store(stamps_ptr + NPROG * NG * 4 + pid, slot.to(tl.int64) if WEIGHTED else _smid())
        if PIPE:
            lines = tl.arange(0, BN * BK // 64)
            for p in tl.static_range(PREFETCH):
                _prefetch_l2(w_ptr + w_off + (tl.minimum(a + p, b - 1)).to(tl.int64) * (BN * BK) + lines * 64)
            if WAIT and g > 0:
                _wait_at_least(done_ptr + g - 1, NPROG, SLEEP)
        if STAMPS:
            tl.store(stamps_ptr + (pid * NG + g) * 4 + 1, _now())
        for u in range(a, b, U):
            w0 = tl.load(w_ptr + w_off + u.to(tl.int64) * (BN * BK) + tile)
            if U == 2:
                w1 = tl.load(w_ptr + w_off + (u + 1).to(tl.int64) * (BN * BK) + tile, mask=u + 1 < b, other=0.0)
            if WAIT and first and g > 0 and not PIPE:
                _wait_at_least(done_ptr + g - 1, NPROG)
            first = False
            if WORK == 2:
                x0 = 0
            elif WORK == 3:    # a private copy of a fixed x per CTA: no line read by every CTA
                x0 = _x_tile(xp_ptr, pid * 14336 * M, 14336, u % KS, m, kk, M, BK, X_L1)
            elif WORK == 1:
                x0 = _x_tile(y_ptr, 0, 4096, u % 32, m, kk, M, BK, X_L1)
            else:
                x0 = _x_tile(y_ptr, x_off, x_stride, u % KS, m, kk, M, BK, X_L1)
            if U == 2:
                x1 = _x_tile(y_ptr, x_off, x_stride, (u + 1) % KS, m, kk, M, BK, X_L1)
            if u // KS != cur:
                _flush(acc, y_ptr, y_off, N, cur, r, m, M, BN)
                acc = tl.zeros([BN, 16], tl.float32)
                cur = u // KS
            if WORK == 2:
                acc = tl.dot(w0, tl.zeros([BK, 16], tl.bfloat16) + (u % 3).to(tl.bfloat16), acc)
            else:
                acc = tl.dot(w0, tl.trans(x0), acc)
            if U == 2:
                if u + 1 < b:
                    if (u + 1) // KS != cur:
                        _flush(acc, y_ptr, y_off, N, cur, r, m, M, BN)
                        acc = tl.zeros([BN, 16], tl.float32)
                        cur = (u + 1) // KS
                    acc = tl.dot(w1, tl.trans(x1), acc)
        if STAMPS:
            tl.store(stamps_ptr + (pid * NG + g) * 4 + 2, _now())
        if b > a:
            _flush(acc, y_ptr, y_off, N, cur, r, m, M, BN)
        if WAIT:
            tl.debug_barrier()
            tl.atomic_add(done_ptr + g, 1, sem="release", scope="gpu")
        if STAMPS:
            tl.store(stamps_ptr + (pid * NG + g) * 4 + 3, _now())


def tiled(w):
    n, k = w.shape
    return w.view(n // BN, BN, k // BK, BK).permute(0, 2, 1, 3).contiguous().view(-1)


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
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] * 8
    ws = [(torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16) for n, k in shapes]
    nbytes = sum(w.numel() * 2 for w in ws)
    wt = torch.cat([tiled(w) for w in ws])
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev); b2 = torch.empty_like(a)
    for _ in range(3): b2.copy_(a)
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record(); [b2.copy_(a) for _ in range(10)]; e.record(); torch.cuda.synchronize()
    copy = 2 * a.numel() * 10 / (s.elapsed_time(e) * 1e-3)
    del a, b2
    print(f"copy {copy / 1e9:.0f} GB/s; {nsm} SMs; {nbytes / 1e6:.0f} MB of weights, 32 GEMMs", flush=True)
    for M in (1, 16):
        # y buffer: x0 [M, 4096] then each GEMM's y [M, N]
        offs, o = [], M * 4096
        for n, k in shapes:
            offs.append(o); o += M * n
        y = torch.zeros(o, device=dev, dtype=torch.float32)
        meta, w_off, prev_off, prev_stride = [], 0, 0, 4096
        for (n, k), yo in zip(shapes, offs):
            meta.append([w_off, n, k, yo, prev_off, prev_stride])
            w_off += n * k; prev_off, prev_stride = yo, n
        meta = torch.tensor(meta, dtype=torch.int64, device=dev)
        done = torch.zeros(len(shapes), dtype=torch.int32, device=dev)
        x0 = torch.randn(M, 4096, device=dev).to(torch.bfloat16).float()
        # reference chain: fp32 products of bf16 operands, x rounded to bf16 between GEMMs
        xr = x0
        refs = []
        for w, (n, k) in zip(ws, shapes):
            yr = xr[:, :k].to(torch.bfloat16).float() @ w.float().t()
            refs.append(yr); xr = yr
        # the engine's kernel, a launch per GEMM, chained the same way (bf16 between)
        outs = [torch.empty(M, n, device=dev, dtype=torch.bfloat16) for n, _ in shapes]
        xb = x0.to(torch.bfloat16)
        def engine_chain():
            x = xb
            for w, out, (n, k) in zip(ws, outs, shapes):
                stream_matmul(x[:, :k], w, out)
                x = out
        t_eng = bench(engine_chain)
        err = ((outs[-1].float() - refs[-1]).norm() / refs[-1].norm()).item()
        print(f"M={M:2d} engine streaming kernel, 32 launches   {t_eng:8.1f} us  {t_eng / 8:6.1f} us a layer  "
              f"{nbytes / (t_eng * 1e-6) / copy:4.0%} of copy  rel err {err:.1e}", flush=True)
        xp = torch.randn(2 * nsm * 14336 * M, device=dev)
        # (CTAs an SM, units a step (2: in registers, 1: Triton's cp.async pipeline), warps, stages,
        #  x through L1, x's source (0: the y before, 1: a fixed x, 3: a private copy per CTA), backoff ns)
        for per_sm, U, nw, stages, xl1, work, sleep in ((2, 1, 4, 4, False, 0, 0), (2, 1, 4, 4, True, 0, 0),
                                                        (2, 1, 4, 4, False, 1, 0), (2, 1, 4, 4, False, 3, 0),
                                                        (2, 1, 4, 4, False, 0, 100), (3, 1, 4, 3, False, 0, 0),
                                                        (1, 1, 4, 6, False, 0, 0), (2, 2, 8, 1, False, 0, 0)):
            nprog = nsm * per_sm
            k = persistent_gemms.warmup(wt, y, meta, done, M, nprog, NG=len(shapes), BN=BN, BK=BK, U=U, WAIT=True,
                                        PIPE=stages > 1, PREFETCH=4, X_L1=xl1, WORK=work, xp_ptr=xp, SLEEP=sleep, num_warps=nw, num_stages=stages, grid=(1,))
            k._init_handles()
            fit = min(233472 // max(k.metadata.shared, 1), 65536 // (k.n_regs * 32 * nw))
            if fit < per_sm:
                print(f"M={M:2d} {per_sm}/SM U={U} {nw}w {stages}st: {fit} fit an SM ({k.n_regs} registers, "
                      f"{k.metadata.shared} B shared), skipped", flush=True)
                continue
            for wait in (True, False):
                def run():
                    y.zero_(); done.zero_()
                    y[:M * 4096].copy_(x0.view(-1))
                    persistent_gemms[(nprog,)](wt, y, meta, done, M, nprog, NG=len(shapes), BN=BN, BK=BK, U=U,
                                               WAIT=wait, PIPE=stages > 1, PREFETCH=4, X_L1=xl1, WORK=work, xp_ptr=xp, SLEEP=sleep, num_warps=nw, num_stages=stages)
                try:
                    t = bench(run)
                except Exception as ex:
                    print(f"M={M:2d} persistent {per_sm}/SM U={U} {nw}w: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
                    torch.cuda.synchronize()
                    break
                last = y[offs[-1]:offs[-1] + M * shapes[-1][0]].view(M, -1)
                err = ((last - refs[-1]).norm() / refs[-1].norm()).item() if wait and not work else float("nan")
                print(f"M={M:2d} persistent {per_sm}/SM {nw}w {stages}st {['x = y before', 'x fixed', 'no x', 'x private'][work]:12s} x in {'L1' if xl1 else 'L2'} sleep {sleep:4d} ns {'a wait each GEMM' if wait else 'no waits (wrong)':17s} {t:8.1f} us  "
                      f"{t / 8:6.1f} us a layer  {nbytes / (t * 1e-6) / copy:4.0%} of copy  rel err {err:.1e}", flush=True)


def stamp_report(M=1, per_sm=2, nw=4, stages=4, xl1=True, work=0, sleep=0):
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    torch.manual_seed(0)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] * 8
    wt = torch.cat([tiled((torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)) for n, k in shapes])
    offs, o = [], M * 4096
    for n, k in shapes:
        offs.append(o); o += M * n
    y = torch.zeros(o, device=dev, dtype=torch.float32)
    meta, w_off, prev_off, prev_stride = [], 0, 0, 4096
    for (n, k), yo in zip(shapes, offs):
        meta.append([w_off, n, k, yo, prev_off, prev_stride])
        w_off += n * k; prev_off, prev_stride = yo, n
    meta = torch.tensor(meta, dtype=torch.int64, device=dev)
    done = torch.zeros(len(shapes), dtype=torch.int32, device=dev)
    nprog = nsm * per_sm
    ng = len(shapes)
    stamps_all = torch.zeros(nprog * ng * 4 + nprog, dtype=torch.int64, device=dev)
    stamps = stamps_all[:nprog * ng * 4].view(nprog, ng, 4)
    smid = stamps_all[nprog * ng * 4:]
    xp = torch.randn(nprog * 14336 * M, device=dev)
    print(f"WORK={work} SLEEP={sleep}")
    for wait in (True,):
        rows = []
        for rep in range(4):
            y.zero_(); done.zero_(); torch.cuda.synchronize()
            persistent_gemms[(nprog,)](wt, y, meta, done, M, nprog, NG=ng, BN=BN, BK=BK, U=1, WAIT=wait, PIPE=True,
                                       PREFETCH=4, stamps_ptr=stamps_all, STAMPS=True, X_L1=xl1, WORK=work, xp_ptr=xp, SLEEP=sleep, num_warps=nw, num_stages=stages)
            torch.cuda.synchronize()
            st = (stamps - stamps[:, 0, 0].min()).double().cpu() / 1e3    # us
            rows.append(st)
            sms = smid.cpu().clone()
        st = rows[-1]
        print(f"stamps, M={M}, {per_sm}/SM {nw}w {stages}st, {'waits' if wait else 'no waits'}: total {st[:, -1, 3].max():.1f} us")
        names = ["qkv", "o", "gate/up", "down"]
        for g in range(8, 12):
            s0, s1, s2, s3 = (st[:, g, i] for i in range(4))
            last_release = s3.max()
            print(f"  {names[g % 4]:8s} loop {float((s2 - s1).median()):6.2f} us (spread of ends {float(s2.max() - s2.min()):5.2f}, "
                  f"std {float(s2.std()):4.2f}); flush+release {float((s3 - s2).median()):5.2f}; "
                  f"wake after last release: first {float(st[:, g + 1, 1].min() - last_release):5.2f}, "
                  f"median {float(st[:, g + 1, 1].median() - last_release):5.2f}, last {float(st[:, g + 1, 1].max() - last_release):5.2f}; "
                  f"median wait {float((st[:, g + 1, 1] - st[:, g + 1, 0]).median()):5.2f}")
        d1 = (rows[1][:, 8:12, 2] - rows[1][:, 8:12, 1]).sum(1)
        d2 = (rows[2][:, 8:12, 2] - rows[2][:, 8:12, 1]).sum(1)
        # which CTAs are slow: per layer (3..6), each CTA's summed loop time; SM-level or CTA-level?
        lt = (st[:, 8:24, 2] - st[:, 8:24, 1]).sum(1)
        order = torch.argsort(lt, descending=True)
        slow = order[:26].tolist()
        print("  slowest 10% of CTAs (pid:sm:us):", " ".join(f"{p}:{int(sms[p])}:{lt[p]:.0f}" for p in slow[:26]))
        print("  fastest 10%:", " ".join(f"{p}:{int(sms[p])}:{lt[p]:.0f}" for p in order[-26:].tolist()))
        by_sm = {}
        for p in range(nprog):
            by_sm.setdefault(int(sms[p]), []).append(float(lt[p]))
        pairs = torch.tensor([v for v in by_sm.values() if len(v) == 2])
        if len(pairs):
            print(f"  the two CTAs of one SM: correlation {torch.corrcoef(pairs.t())[0, 1]:.2f} over {len(pairs)} SMs")
        print(f"  pid vs time correlation {torch.corrcoef(torch.stack([torch.arange(nprog).double(), lt]))[0, 1]:.2f}")
        print(f"  per-CTA loop time over layer 3, correlation between two runs {torch.corrcoef(torch.stack([d1, d2]))[0, 1]:.2f}; "
              f"spread {float(d1.max() - d1.min()):.2f} us of {float(d1.median()):.2f}")


def setup(M, dev):
    torch.manual_seed(0)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] * 8
    ws = [(torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16) for n, k in shapes]
    wt = torch.cat([tiled(w) for w in ws])
    offs, o = [], M * 4096
    for n, k in shapes:
        offs.append(o); o += M * n
    y = torch.zeros(o, device=dev, dtype=torch.float32)
    meta, w_off, prev_off, prev_stride = [], 0, 0, 4096
    for (n, k), yo in zip(shapes, offs):
        meta.append([w_off, n, k, yo, prev_off, prev_stride])
        w_off += n * k; prev_off, prev_stride = yo, n
    meta = torch.tensor(meta, dtype=torch.int64, device=dev)
    return shapes, ws, wt, y, offs, meta


def weighted_report(per_sm=2, nw=4, stages=4):
    """Shares sized per SM (by %smid, not by program id) from the SMs' measured paces."""
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    nprog = nsm * per_sm
    cum = torch.linspace(0, 1, nprog + 1, device=dev, dtype=torch.float32).repeat(4)
    tickets = torch.zeros(nsm, dtype=torch.int32, device=dev)
    for M in (1, 16):
        shapes, ws, wt, y, offs, meta = setup(M, dev)
        ng = len(shapes)
        done = torch.zeros(ng, dtype=torch.int32, device=dev)
        x0 = torch.randn(M, 4096, device=dev).to(torch.bfloat16).float()
        xr = x0
        for w, (n, k) in zip(ws, shapes):
            xr = xr[:, :k].to(torch.bfloat16).float() @ w.float().t()
        ref = xr
        stamps_all = torch.zeros(nprog * ng * 4 + nprog, dtype=torch.int64, device=dev)
        def launch(c, stamps=False, wait=True):
            y.zero_(); done.zero_(); tickets.zero_()
            y[:M * 4096].copy_(x0.view(-1))
            persistent_gemms[(nprog,)](wt, y, meta, done, M, nprog, NG=ng, BN=BN, BK=BK, U=1, WAIT=wait, PIPE=True,
                                       PREFETCH=4, stamps_ptr=stamps_all, STAMPS=stamps, cum_ptr=c, tickets_ptr=tickets,
                                       WEIGHTED=True, PER_SM=per_sm, num_warps=nw, num_stages=stages)
        def err():
            last = y[offs[-1]:offs[-1] + M * shapes[-1][0]].view(M, -1)
            return ((last - ref).norm() / ref.norm()).item()
        if M == 1:   # calibrate per GEMM kind: each slot's loop time over layers 1..7 at its share -> its rate
            c = cum.clone()
            for rnd in range(3):
                times = torch.zeros(4, nprog, dtype=torch.float64)
                for rep in range(3):
                    launch(c, stamps=True); torch.cuda.synchronize()
                    st = stamps_all[:nprog * ng * 4].view(nprog, ng, 4).double().cpu()
                    slots = stamps_all[nprog * ng * 4:].cpu()
                    for kind in range(4):
                        t = (st[:, 4 + kind::4, 2] - st[:, 4 + kind::4, 1]).sum(1)
                        times[kind, slots] += t
                cc = c.view(4, nprog + 1).double().cpu()
                share = cc[:, 1:] - cc[:, :-1]
                rate = share / times
                spread = ((times.max(1).values - times.min(1).values) / times.mean(1)).tolist()
                print(f"  calibration round {rnd}: slot loop time spread by kind " +
                      " ".join(f"{x:.1%}" for x in spread) + f"; err {err():.1e}", flush=True)
                newc = torch.cat([torch.zeros(4, 1, dtype=torch.float64), (rate / rate.sum(1, keepdim=True)).cumsum(1)], 1)
                newc[:, -1] = 1.0
                c = newc.to(dev, torch.float32).reshape(-1).contiguous()
            weighted = c
            for name, cc in (("equal", cum), ("by pace", weighted)):
                launch(cc, stamps=True); torch.cuda.synchronize()
                st = stamps_all[:nprog * ng * 4].view(nprog, ng, 4).double().cpu() / 1e3
                ends = [float(st[:, g, 2].max() - st[:, g, 2].min()) for g in range(8, 12)]
                waits = [float((st[:, g + 1, 1] - st[:, g + 1, 0]).median()) for g in range(8, 12)]
                print(f"  layer 3 with shares {name}: spread of ends " + " / ".join(f"{x:.2f}" for x in ends) +
                      " us; median wait " + " / ".join(f"{x:.2f}" for x in waits), flush=True)
        for name, c in (("equal shares", cum), ("shares by SM pace", weighted)):
            launch(c); torch.cuda.synchronize()
            e = err()
            t = bench(lambda: launch(c))
            print(f"M={M:2d} persistent, {name:18s} {t:8.1f} us  {t / 8:6.1f} us a layer  rel err {e:.1e}", flush=True)
        outs = [torch.empty(M, n, device=dev, dtype=torch.bfloat16) for n, _ in shapes]
        xb = x0.to(torch.bfloat16)
        def engine_chain():
            x = xb
            for w, out, (n, k) in zip(ws, outs, shapes):
                stream_matmul(x[:, :k], w, out)
                x = out
        t = bench(engine_chain)
        print(f"M={M:2d} engine streaming kernel, 32 launches {t:8.1f} us  {t / 8:6.1f} us a layer", flush=True)
        del wt, ws


def alternate(reps=8):
    """The engine's 32 launches and the persistent kernel, alternately, M = 1: does either drift?"""
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    M, nprog = 1, 2 * nsm
    shapes, ws, wt, y, offs, meta = setup(M, dev)
    done = torch.zeros(len(shapes), dtype=torch.int32, device=dev)
    x0 = torch.randn(M, 4096, device=dev).to(torch.bfloat16).float()
    outs = [torch.empty(M, n, device=dev, dtype=torch.bfloat16) for n, _ in shapes]
    xb = x0.to(torch.bfloat16)
    def engine_chain():
        x = xb
        for w, out, (n, k) in zip(ws, outs, shapes):
            stream_matmul(x[:, :k], w, out)
            x = out
    def persistent():
        y.zero_(); done.zero_()
        y[:M * 4096].copy_(x0.view(-1))
        persistent_gemms[(nprog,)](wt, y, meta, done, M, nprog, NG=len(shapes), BN=BN, BK=BK, U=1, WAIT=True, PIPE=True,
                                   PREFETCH=4, num_warps=4, num_stages=4)
    import time
    for i in range(reps):
        te, tp = bench(engine_chain, 20) / 8, bench(persistent, 20) / 8
        print(f"{time.time() % 1000:7.1f}s  engine {te:6.1f}  persistent {tp:6.1f} us a layer", flush=True)
        for _ in range(200):     # load between samples, as a benchmark would
            engine_chain()
        torch.cuda.synchronize()


@triton.jit
def _gemv_unit(acc, w, cur, u, b, KS, y_ptr, y_off, N, x_off, kk, r, BN: tl.constexpr, BK: tl.constexpr):
    """One (tile, K step) unit at M = 1 on the CUDA cores: acc[BN, BK] += w * x, reduced over K only
    when the tile changes."""
    if u < b:
        t = u // KS
        if t != cur:
            tl.atomic_add(y_ptr + y_off + cur * BN + r, tl.sum(acc, axis=1), sem="relaxed")
            acc = tl.zeros([BN, BK], tl.float32)
            cur = t
        x = tl.load(y_ptr + x_off + (u % KS) * BK + kk, cache_modifier=".cg").to(tl.bfloat16).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    return acc, cur


@triton.jit
def gemv_persistent(w_ptr, y_ptr, meta_ptr, done_ptr, NPROG, NG: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, U: tl.constexpr, WAIT: tl.constexpr):
    """M = 1: U units' weights loaded into registers a step (the next GEMM's first step before its
    wait), multiplied on the CUDA cores into a [BN, BK] fp32 accumulator."""
    pid = tl.program_id(0)
    r = tl.arange(0, BN)
    kk = tl.arange(0, BK)
    tile = r[:, None] * BK + kk[None, :]
    for g in range(NG):
        w_off = tl.multiple_of(tl.load(meta_ptr + g * 6 + 0), 16)
        N = tl.multiple_of(tl.load(meta_ptr + g * 6 + 1), 16)
        K = tl.multiple_of(tl.load(meta_ptr + g * 6 + 2), 16)
        y_off = tl.multiple_of(tl.load(meta_ptr + g * 6 + 3), 16)
        x_off = tl.multiple_of(tl.load(meta_ptr + g * 6 + 4), 16)
        KS = K // BK
        n_units = (N // BN) * KS
        a = n_units * pid // NPROG
        b = n_units * (pid + 1) // NPROG
        acc = tl.zeros([BN, BK], tl.float32)
        cur = a // KS
        first = True
        for u in range(a, b, U):
            base = w_ptr + w_off + u.to(tl.int64) * (BN * BK) + tile
            w0 = tl.load(base)
            w1 = tl.load(base + BN * BK, mask=u + 1 < b, other=0.0)
            if U == 4:
                w2 = tl.load(base + 2 * BN * BK, mask=u + 2 < b, other=0.0)
                w3 = tl.load(base + 3 * BN * BK, mask=u + 3 < b, other=0.0)
            if WAIT and first and g > 0:
                _wait_at_least(done_ptr + g - 1, NPROG)
            first = False
            acc, cur = _gemv_unit(acc, w0, cur, u, b, KS, y_ptr, y_off, N, x_off, kk, r, BN, BK)
            acc, cur = _gemv_unit(acc, w1, cur, u + 1, b, KS, y_ptr, y_off, N, x_off, kk, r, BN, BK)
            if U == 4:
                acc, cur = _gemv_unit(acc, w2, cur, u + 2, b, KS, y_ptr, y_off, N, x_off, kk, r, BN, BK)
                acc, cur = _gemv_unit(acc, w3, cur, u + 3, b, KS, y_ptr, y_off, N, x_off, kk, r, BN, BK)
        if b > a:
            tl.atomic_add(y_ptr + y_off + cur * BN + r, tl.sum(acc, axis=1), sem="relaxed")
        if WAIT:
            tl.debug_barrier()
            tl.atomic_add(done_ptr + g, 1, sem="release", scope="gpu")


def gemv_report():
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    M = 1
    shapes, ws, wt, y, offs, meta = setup(M, dev)
    done = torch.zeros(len(shapes), dtype=torch.int32, device=dev)
    x0 = torch.randn(M, 4096, device=dev).to(torch.bfloat16).float()
    xr = x0
    for w, (n, k) in zip(ws, shapes):
        xr = xr[:, :k].to(torch.bfloat16).float() @ w.float().t()
    ref = xr
    nbytes = sum(w.numel() * 2 for w in ws)
    outs = [torch.empty(M, n, device=dev, dtype=torch.bfloat16) for n, _ in shapes]
    xb = x0.to(torch.bfloat16)
    def engine_chain():
        x = xb
        for w, out, (n, k) in zip(ws, outs, shapes):
            stream_matmul(x[:, :k], w, out)
            x = out
    t = bench(engine_chain)
    print(f"M=1 engine streaming kernel, 32 launches {t:8.1f} us  {t / 8:6.1f} us a layer", flush=True)
    for per_sm, U, nw in ((2, 4, 8), (2, 2, 8), (1, 4, 8), (2, 4, 4), (3, 2, 4), (4, 2, 4)):
        nprog = nsm * per_sm
        k = gemv_persistent.warmup(wt, y, meta, done, nprog, NG=len(shapes), BN=BN, BK=BK, U=U, WAIT=True,
                                   num_warps=nw, num_stages=1, grid=(1,))
        k._init_handles()
        fit = min(233472 // max(k.metadata.shared, 1), 65536 // (k.n_regs * 32 * nw))
        if fit < per_sm:
            print(f"  {per_sm}/SM U={U} {nw}w: {fit} fit ({k.n_regs} registers), skipped", flush=True)
            continue
        for wait in (True, False):
            def run():
                y.zero_(); done.zero_()
                y[:M * 4096].copy_(x0.view(-1))
                gemv_persistent[(nprog,)](wt, y, meta, done, nprog, NG=len(shapes), BN=BN, BK=BK, U=U, WAIT=wait,
                                          num_warps=nw, num_stages=1)
            t = bench(run)
            last = y[offs[-1]:offs[-1] + M * shapes[-1][0]].view(M, -1)
            err = ((last - ref).norm() / ref.norm()).item() if wait else float("nan")
            print(f"M=1 GEMV persistent {per_sm}/SM U={U} {nw}w ({k.n_regs} regs) {'a wait each GEMM' if wait else 'no waits (wrong)':17s} "
                  f"{t:8.1f} us  {t / 8:6.1f} us a layer  rel err {err:.1e}", flush=True)


def prefetch_report():
    """The cp.async kernel with 0 to 16 of the next GEMM's units prefetched into L2 before each wait."""
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    for M in (1, 16):
        shapes, ws, wt, y, offs, meta = setup(M, dev)
        done = torch.zeros(len(shapes), dtype=torch.int32, device=dev)
        x0 = torch.randn(M, 4096, device=dev).to(torch.bfloat16).float()
        nprog = 2 * nsm
        for pf in (0, 4, 8, 16):
            def run():
                y.zero_(); done.zero_()
                y[:M * 4096].copy_(x0.view(-1))
                persistent_gemms[(nprog,)](wt, y, meta, done, M, nprog, NG=len(shapes), BN=BN, BK=BK, U=1, WAIT=True,
                                           PIPE=True, PREFETCH=pf, num_warps=4, num_stages=4)
            t = bench(run)
            print(f"M={M:2d} persistent 2/SM 4w 4st, {pf:2d} units prefetched to L2 before each wait: {t:8.1f} us  "
                  f"{t / 8:6.1f} us a layer", flush=True)
        del wt, ws


if __name__ == "__main__":
    if "--prefetch" in sys.argv:
        prefetch_report()
        sys.exit()
    if "--gemv" in sys.argv:
        gemv_report()
        sys.exit()
    if "--alternate" in sys.argv:
        alternate()
        sys.exit()
    if "--weighted" in sys.argv:
        weighted_report()
        sys.exit()
    if "--stamps" in sys.argv:
        stamp_report()
        sys.exit()
    main()
