"""Probe: 32 dependent segments (8 layers x the 4 decode GEMMs' weight bytes, bf16 Llama-3.1-8B),
streamed by one persistent grid of pure reads. Static equal shares with a wait at each boundary,
against chunks claimed from one global counter a step ahead (the next segment's first chunks
loaded before the wait); and the same loop launched once per segment, in a CUDA graph.
Run on a GPU: python benchmarks/persistent_probe/claim_pace.py"""
import torch, triton, triton.language as tl

@triton.jit
def _wait_at_least(ptr, need):
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while v < need:
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")

@triton.jit
def _seg_of(u, bounds_ptr, NSEG: tl.constexpr):
    s = 0
    for i in tl.static_range(1, NSEG):
        s += (u >= tl.load(bounds_ptr + i)).to(tl.int32)
    return s

@triton.jit
def static_kernel(src, out, bounds, done, NPROG, NSEG: tl.constexpr, CHUNK: tl.constexpr, U: tl.constexpr,
                  WAIT: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.int32)
    for s in range(NSEG):
        lo = tl.load(bounds + s)
        hi = tl.load(bounds + s + 1)
        n = (hi - lo) // U
        a = lo + (n * pid // NPROG) * U
        b = lo + (n * (pid + 1) // NPROG) * U
        first = True
        for c in range(a, b, U):
            vs = tl.zeros([CHUNK], tl.int32)
            for u in tl.static_range(U):
                vs ^= tl.load(src + (c + u).to(tl.int64) * CHUNK + offs)
            if WAIT and first and s > 0:
                _wait_at_least(done + s - 1, NPROG)
            first = False
            acc ^= vs
        if WAIT:
            tl.atomic_add(done + s, 1, sem="release", scope="gpu")
    tl.store(out + pid * CHUNK + offs, acc)

@triton.jit
def dynamic_kernel(src, out, bounds, done, claim, NSEG: tl.constexpr, CHUNK: tl.constexpr, U: tl.constexpr,
                   WAIT: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.int32)
    total = tl.load(bounds + NSEG)
    c = tl.atomic_add(claim, U, sem="relaxed", scope="gpu")
    waited = -1
    while c < total:
        vs = tl.zeros([CHUNK], tl.int32)
        for u in tl.static_range(U):
            vs ^= tl.load(src + (c + u).to(tl.int64) * CHUNK + offs)
        # the next claim, after the loads are issued: its round trip runs under theirs
        nxt = tl.atomic_add(claim, U, sem="relaxed", scope="gpu")
        s = _seg_of(c, bounds, NSEG)
        if WAIT and s > 0 and s > waited:
            _wait_at_least(done + s - 1, tl.load(bounds + s) - tl.load(bounds + s - 1))
            waited = s
        acc ^= vs
        if WAIT:
            tl.atomic_add(done + s, U, sem="release", scope="gpu")
        c = nxt
    tl.store(out + pid * CHUNK + offs, acc)

@triton.jit
def _load_unit(src, c, total, offs, CHUNK: tl.constexpr, U: tl.constexpr):
    vs = tl.zeros([CHUNK], tl.int32)
    for u in tl.static_range(U):
        vs ^= tl.load(src + (c + u).to(tl.int64) * CHUNK + offs, mask=(offs < CHUNK) & (c < total), other=0)
    return vs

@triton.jit
def dynamic2_kernel(src, out, bounds, done, claim, NSEG: tl.constexpr, CHUNK: tl.constexpr, U: tl.constexpr,
                    WAIT: tl.constexpr):
    """Two claimed units in flight: the next unit's loads are issued before the current one waits."""
    pid = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.int32)
    total = tl.load(bounds + NSEG)
    c = tl.atomic_add(claim, U, sem="relaxed", scope="gpu")
    vs = _load_unit(src, c, total, offs, CHUNK, U)
    nxt = tl.atomic_add(claim, U, sem="relaxed", scope="gpu")
    waited = -1
    while c < total:
        vs_next = _load_unit(src, nxt, total, offs, CHUNK, U)
        nxt2 = tl.atomic_add(claim, U, sem="relaxed", scope="gpu")
        s = _seg_of(c, bounds, NSEG)
        if WAIT and s > 0 and s > waited:
            _wait_at_least(done + s - 1, tl.load(bounds + s) - tl.load(bounds + s - 1))
            waited = s
        acc ^= vs
        if WAIT:
            tl.atomic_add(done + s, U, sem="release", scope="gpu")
        vs = vs_next
        c = nxt
        nxt = nxt2
    tl.store(out + pid * CHUNK + offs, acc)

@triton.jit
def static2d_kernel(src, out, bounds, done, NPROG, NSEG: tl.constexpr, CHUNK: tl.constexpr, U: tl.constexpr,
                    WAIT: tl.constexpr):
    """static_kernel over the same bytes read as a row-major [rows, 2048] int32 (4096 bf16) weight:
    unit u of a segment = row tile u // 32 (64 rows) x K step u % 32 (64 int32), 64 pieces of 256 B."""
    pid = tl.program_id(0)
    r = tl.arange(0, 64)[:, None]
    k = tl.arange(0, 64)[None, :]
    acc = tl.zeros([64, 64], tl.int32)
    for s in range(NSEG):
        lo = tl.load(bounds + s)
        hi = tl.load(bounds + s + 1)
        n = (hi - lo) // U
        a = (n * pid // NPROG) * U
        b = (n * (pid + 1) // NPROG) * U
        first = True
        seg = src + lo.to(tl.int64) * CHUNK
        for c in range(a, b, U):
            vs = tl.zeros([64, 64], tl.int32)
            for u in tl.static_range(U):
                t = (c + u) // 32
                kk = (c + u) % 32
                vs ^= tl.load(seg + (t * 64 + r).to(tl.int64) * 2048 + kk * 64 + k)
            if WAIT and first and s > 0:
                _wait_at_least(done + s - 1, NPROG)
            first = False
            acc ^= vs
        if WAIT:
            tl.atomic_add(done + s, 1, sem="release", scope="gpu")
    tl.store(out + pid * CHUNK + r * 64 + k, acc)

def xor_rows(t):
    t = t.clone()
    while t.shape[0] > 1:
        if t.shape[0] % 2:
            t[0] ^= t[-1]
            t = t[:-1]
        h = t.shape[0] // 2
        t = t[:h] ^ t[h:]
    return t[0]

def main():
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    CHUNK = 4096                                   # int32: 16 KB
    layer = [6144 * 4096, 4096 * 4096, 28672 * 4096, 4096 * 14336]   # bf16 elements
    sizes = [n * 2 // (CHUNK * 4) for n in layer] * 8
    bounds = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0)), dtype=torch.int32, device=dev)
    nseg = len(sizes)
    total = int(bounds[-1])
    src = torch.randint(-2**31, 2**31 - 1, (total * CHUNK,), dtype=torch.int32, device=dev)
    nbytes = src.numel() * 4
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev); b2 = torch.empty_like(a)
    for _ in range(3): b2.copy_(a)
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record(); [b2.copy_(a) for _ in range(10)]; e.record(); torch.cuda.synchronize()
    copy = 2 * a.numel() * 10 / (s.elapsed_time(e) * 1e-3)
    print(f"copy {copy / 1e9:.0f} GB/s; {nsm} SMs; {nbytes / 1e6:.0f} MB in {nseg} segments", flush=True)
    del a, b2
    done = torch.zeros(nseg, dtype=torch.int32, device=dev)
    claim = torch.zeros(1, dtype=torch.int32, device=dev)
    expect = xor_rows(src.view(-1, CHUNK))
    one = torch.tensor([0, 0], dtype=torch.int32, device=dev)
    seg_bounds = []
    for i in range(nseg):
        n = sizes[i]
        seg_bounds.append((int(bounds[i]), n, torch.tensor([0, n], dtype=torch.int32, device=dev)))
    for per_sm, nw, U, grid_kind in ((2, 8, 4, "2/SM"), (2, 8, 2, "2/SM"), (0, 8, 4, "a program per 64 KB"), (0, 8, 2, "a program per 32 KB"), (0, 4, 1, "a program per 16 KB")):
        outs = torch.empty(sizes[2] * CHUNK, dtype=torch.int32, device=dev)
        def launches():
            for lo, n, sb in seg_bounds:
                nprog = nsm * per_sm if per_sm else n // U
                static_kernel[(nprog,)](src[lo * CHUNK:], outs, sb, done, nprog, NSEG=1, CHUNK=CHUNK, U=U, WAIT=False, num_warps=nw)
        launches(); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            launches()
        times = []
        for r in range(7):
            s.record(); g.replay(); e.record(); torch.cuda.synchronize()
            if r:
                times.append(s.elapsed_time(e) * 1e3)
        t = sorted(times)[len(times) // 2]
        print(f"32 launches in a graph, {grid_kind}, {nw}w U={U}: {t:8.1f} us  {t / 8:6.1f} us a layer  "
              f"{nbytes / (t * 1e-6) / 1e9:5.0f} GB/s ({nbytes / (t * 1e-6) / copy:4.0%} of copy)", flush=True)
        del g
    for per_sm, nw, U in ((2, 8, 4), (1, 8, 4), (2, 8, 2)):
        if True:
            nprog = nsm * per_sm
            out = torch.empty(nprog * CHUNK, dtype=torch.int32, device=dev)
            variants = {
                "row-major 2D, static, no waits": lambda: static2d_kernel[(nprog,)](src, out, bounds, done, nprog, NSEG=nseg, CHUNK=CHUNK, U=U, WAIT=False, num_warps=nw),
                "row-major 2D, static, a wait each": lambda: static2d_kernel[(nprog,)](src, out, bounds, done, nprog, NSEG=nseg, CHUNK=CHUNK, U=U, WAIT=True, num_warps=nw),
                "static, no waits": lambda: static_kernel[(nprog,)](src, out, bounds, done, nprog, NSEG=nseg, CHUNK=CHUNK, U=U, WAIT=False, num_warps=nw),
                "static, a wait each boundary": lambda: static_kernel[(nprog,)](src, out, bounds, done, nprog, NSEG=nseg, CHUNK=CHUNK, U=U, WAIT=True, num_warps=nw),
                "claimed, no waits": lambda: dynamic_kernel[(nprog,)](src, out, bounds, done, claim, NSEG=nseg, CHUNK=CHUNK, U=U, WAIT=False, num_warps=nw),
                "claimed, a wait each boundary": lambda: dynamic_kernel[(nprog,)](src, out, bounds, done, claim, NSEG=nseg, CHUNK=CHUNK, U=U, WAIT=True, num_warps=nw),
            }
            for name, fn in variants.items():
                times = []
                for r in range(7):
                    done.zero_(); claim.zero_()
                    s.record(); fn(); e.record(); torch.cuda.synchronize()
                    if r:
                        times.append(s.elapsed_time(e) * 1e3)
                t = sorted(times)[len(times) // 2]
                ok = torch.equal(xor_rows(out.view(nprog, CHUNK)), expect)
                print(f"{per_sm}/SM {nw}w U={U} {name:32s} {t:8.1f} us  {t / 8:6.1f} us a layer  "
                      f"{nbytes / (t * 1e-6) / 1e9:5.0f} GB/s ({nbytes / (t * 1e-6) / copy:4.0%} of copy)  {'' if name.startswith('row-major') else 'ok' if ok else 'WRONG'}", flush=True)

if __name__ == "__main__":
    main()
