"""FP8 GEMM benchmark on Llama-3.1-8B shapes: our kernels vs cuBLAS FP8 (torch._scaled_mm) vs bf16 cuBLAS.

    python benchmarks/bench_fp8.py [--m 1,16,128,1024,8192] [--sweep] [--passes 7 [--swizzles 1,4,16] [--promotes 1,2,4]]

"ours" is the kernel the FP8 format selects for the shape (engine/formats/fp8.py FP8_GEMM through
engine/kernels/select.py; its name is in the "kernel" column): on sm_90 the Triton weight-streaming
kernel at M <= 16 (engine/kernels/fp8_triton.py) and the CuTe DSL WGMMA kernel above
(engine/kernels/cute/fp8_gemm_sm90.py). The accuracy table, --sweep and --passes call the sm90
kernel directly and run on sm_90 only.

--sweep also times every tile of the sm90 kernel in both accumulation modes at M = 1024 and 8192
(what the tile heuristic in fp8_gemm_sm90.choose_tile is checked against).

Each kernel is captured in a CUDA graph that runs it over several rotating operand sets (together
larger than L2, so every call reads its weight from HBM) and the replay is timed with CUDA events;
the median over replays is reported per call. Ceilings measured in the same run: HBM copy bandwidth
(read + write of a 2 GiB buffer), cuBLAS fp8 and bf16 TFLOP/s at 8192^3.

"ours" takes pre-quantised activations (qx, x_scale), as torch._scaled_mm does; "ours+q" adds the
per-token activation quantisation of a bf16 input (what fp8_linear does for a bf16 activation).
"fast" rows compare the accumulation mode that skips the per-k-tile fp32 promotion: ours with
fast_accum=True against torch._scaled_mm(use_fast_accum=True). The default modes of both promote.
An accuracy table (relative error vs float64 of the dequantised operands, M=1024) comes last.
GB/s counts the weight bytes only (fp8: N*K, bf16: 2*N*K), the traffic that bounds decode; for
M <= 16 a second table gives all the bytes each kernel must move (weight + activation + scales +
output) per second, as a fraction of the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from benchmarks.timing import time_graph  # noqa: E402
from engine.formats import fp8  # noqa: E402
from engine.kernels import fp8_triton  # noqa: E402
from engine.kernels.platform import capability, sm_count  # noqa: E402
from engine.kernels.select import Problem, select  # noqa: E402
from engine.kernels.stream_triton import stream_config  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv, o, gate+up, down
L2_BYTES = 50 * 2**20


def measure_ceilings():
    n = 2**30 // 2  # 1 GiB of bf16, copied: 2 GiB of traffic per call
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    # A captured copy_ is a memcpy node, which can run well below a kernel that reads and writes
    # the same bytes: take the faster of the two.
    t = min(time_graph(lambda s: b.copy_(a), [0], replays=10, min_calls=10),
            time_graph(lambda s: torch.mul(a, 1.0, out=b), [0], replays=10, min_calls=10))
    copy_gbs = 2 * a.numel() * 2 / t / 1e9
    t = time_graph(lambda s: torch.sum(a, dtype=torch.float32), [0], replays=10, min_calls=10)
    read_gbs = a.numel() * 2 / t / 1e9
    a = b = None  # free the 2 GiB before the GEMM ceilings
    size = 8192
    x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    t = time_graph(lambda s: torch.matmul(x, w.t()), [0], replays=10, min_calls=10)
    bf16_tflops = 2 * size**3 / t / 1e12
    qx, qw = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    t = time_graph(lambda s: torch._scaled_mm(qx, qw.t(), one, one, out_dtype=torch.bfloat16), [0],
                   replays=10, min_calls=10)
    fp8_tflops = 2 * size**3 / t / 1e12
    return copy_gbs, read_gbs, bf16_tflops, fp8_tflops


def scaled_mm_rowwise_supported():
    qx = torch.randn(32, 64, device="cuda").to(torch.float8_e4m3fn)
    qw = torch.randn(64, 64, device="cuda").to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(qx, qw.t(), torch.ones(32, 1, device="cuda"), torch.ones(1, 64, device="cuda"),
                         out_dtype=torch.bfloat16)
        return True
    except RuntimeError:
        return False


def make_sets(m, n, k, per_set_weight_bytes):
    count = max(2, min(8, math.ceil(3 * L2_BYTES / per_set_weight_bytes)))
    sets = []
    for _ in range(count):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qx, xs = fp8.quantize_act_fp8(x)
        qw, ws = fp8.quantize_rows_fp8(w)
        sets.append(dict(x=x, w=w, qx=qx, xs=xs, qw=qw, ws=ws))
    return sets


def cublas_fp8(s, fast_accum=False):
    """cuBLAS FP8 with rowwise scales (per token x per channel), as our kernels take them."""
    return torch._scaled_mm(s["qx"], s["qw"].t(), s["xs"][:, None], s["ws"][None, :], out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def selected(m, n, k):
    """The FP8 GEMM kernel (and config) the format selects for M x N x K on this GPU."""
    return select(fp8.FP8_GEMM, Problem("fp8_gemm", m, n, k, torch.device("cuda")))


def ours(s, fast_accum=False):
    """The selected kernel on pre-quantised operands; fast_accum: the sm90 kernel without promotion."""
    if fast_accum:
        from engine.kernels.cute.fp8_gemm_sm90 import fp8_gemm_sm90
        return fp8_gemm_sm90(s["qx"], s["xs"], s["qw"], s["ws"], fast_accum=True)
    (m, k), n = s["qx"].shape, s["qw"].shape[0]
    choice = selected(m, n, k)
    return choice.kernel.run(s["qx"], s["xs"], s["qw"], s["ws"], None, torch.bfloat16, config=choice.config)


def accuracy_table(rowwise, promotes=()):
    from engine.kernels.cute.fp8_gemm_sm90 import TILE_K, fp8_gemm_sm90
    print("\nsm90 kernel accuracy (relative error against float64)")
    print("| N x K | M | ours | ours fast_accum | cuBLAS fp8 | cuBLAS fp8 fast_accum | cuBLAS bf16 | "
          + "".join(f"ours, promote every {p} | " for p in promotes))
    print("|---|---|---|---|---|---|---|" + "---|" * len(promotes))
    for n, k in SHAPES:
        m = 1024
        s = make_sets(m, n, k, 10**12)[0]
        ref = (s["qx"].double() @ s["qw"].double().t()) * s["xs"].double()[:, None] * s["ws"].double()[None, :]
        ref_bf16 = s["x"].double() @ s["w"].double().t()
        sa, sb = (s["xs"][:, None], s["ws"][None, :]) if rowwise else (None, None)

        def err(out, r=ref):
            return ((out.double() - r).norm() / r.norm()).item()
        cells = [err(fp8_gemm_sm90(s["qx"], s["xs"], s["qw"], s["ws"])), err(ours(s, fast_accum=True))]
        if rowwise:
            cells += [err(torch._scaled_mm(s["qx"], s["qw"].t(), sa, sb, out_dtype=torch.bfloat16,
                                           use_fast_accum=fast)) for fast in (False, True)]
        else:
            cells += [float("nan"), float("nan")]
        cells.append(err(torch.matmul(s["x"], s["w"].t()), ref_bf16))
        cells += [err(fp8_gemm_sm90(s["qx"], s["xs"], s["qw"], s["ws"], promote_every=p))
                  if math.ceil(k / TILE_K) % p == 0 else float("nan") for p in promotes]
        print(f"| {n} x {k} | {m} | " + " | ".join(f"{c:.2e}" for c in cells) + " |")


def tile_sweep():
    from engine.kernels.cute.fp8_gemm_sm90 import PRECISE_TILES, TILES, choose_tile, fp8_gemm_sm90
    print("\nsm90 tile sweep (TFLOP/s per tile; '-' = tile not available in that mode), with cuBLAS fp8 in the "
          "same accumulation mode timed at the same moment")
    print("| N x K | M | accumulation | " + " | ".join(f"{a}x{b}" for a, b in TILES) + " | chosen | cuBLAS |")
    print("|---|---|---|" + "---|" * (len(TILES) + 2))
    for n, k in SHAPES:
        for m in (1024, 8192):
            sets = make_sets(m, n, k, n * k)
            for fast in (False, True):
                cells = []
                for tile in TILES:
                    if tile not in (TILES if fast else PRECISE_TILES) or n % tile[1]:
                        cells.append("-")
                        continue
                    sec = time_graph(lambda s: fp8_gemm_sm90(s["qx"], s["xs"], s["qw"], s["ws"], tile_mn=tile,
                                                             fast_accum=fast), sets, replays=7)
                    cells.append(f"{2 * m * n * k / sec / 1e12:.0f}")
                chosen = choose_tile(m, n, sm_count(torch.device("cuda")), fast)
                sec = time_graph(lambda s: cublas_fp8(s, fast), sets, replays=7)
                print(f"| {n} x {k} | {m} | {'fast' if fast else 'promoted'} | " + " | ".join(cells)
                      + f" | {chosen[0]}x{chosen[1]} | {2 * m * n * k / sec / 1e12:.0f} |", flush=True)
            del sets
            torch.cuda.empty_cache()


def alternating_passes(ms, passes, swizzles, promotes):
    """cuBLAS's time for the same GEMM moved by up to 18% between two passes of one run (clocks,
    heuristics), so one pass cannot show a ratio to a few percent. Here cuBLAS fp8 and ours (the
    default, each tile order in `swizzles` and each promotion interval in `promotes`) run back to
    back over the same operands, `passes` times, and each variant's time ratio to the cuBLAS time of
    the same pass is kept."""
    from engine.kernels.cute.fp8_gemm_sm90 import (TILE_K, choose_promote_every, choose_swizzle, choose_tile,
                                                   fp8_gemm_sm90)
    print(f"\nours vs cuBLAS fp8 (default accumulation), {passes} alternating passes; ratio = cuBLAS time / "
          "ours (>1 = ours faster), median and min over the passes")
    print("| N x K | M | tile | variant | ours TFLOP/s median (min-max) | cuBLAS TFLOP/s median (min-max) "
          "| median ratio | min ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for n, k in SHAPES:
        for m in ms:
            sets = make_sets(m, n, k, n * k)
            flops = 2 * m * n * k
            tile = choose_tile(m, n, sm_count(torch.device("cuda")))
            n_tiles = n // tile[1]
            k_tiles = math.ceil(k / TILE_K)
            variants = {f"default (swizzle {choose_swizzle(n_tiles)}, promote every {choose_promote_every(k)})": {}}
            variants.update({f"swizzle {sw}": dict(swizzle=sw) for sw in swizzles if n_tiles % sw == 0})
            variants.update({f"promote every {p}": dict(promote_every=p) for p in promotes if k_tiles % p == 0})
            tf = {v: [] for v in variants}
            cub = []
            for _ in range(passes):
                cub.append(flops / time_graph(cublas_fp8, sets, replays=5) / 1e12)
                for label, kw in variants.items():
                    sec = time_graph(lambda s, kw=kw: fp8_gemm_sm90(s["qx"], s["xs"], s["qw"], s["ws"], **kw),
                                     sets, replays=5)
                    tf[label].append(flops / sec / 1e12)
            for label in variants:
                ratios = sorted(o / c for o, c in zip(tf[label], cub))
                print(f"| {n} x {k} | {m} | {tile[0]}x{tile[1]} | {label} | {statistics.median(tf[label]):.0f} "
                      f"({min(tf[label]):.0f}-{max(tf[label]):.0f}) | {statistics.median(cub):.0f} "
                      f"({min(cub):.0f}-{max(cub):.0f}) | {statistics.median(ratios):.2f} | {ratios[0]:.2f} |",
                      flush=True)
            del sets
            torch.cuda.empty_cache()


def ints(csv: str) -> list[int]:
    return [int(v) for v in csv.split(",") if v]


def main():
    ap = argparse.ArgumentParser(description="FP8 GEMM kernels vs cuBLAS fp8 / bf16 at Llama-3.1-8B shapes")
    ap.add_argument("--m", default="1,16,128,1024,8192", help="token counts M, comma-separated")
    ap.add_argument("--sweep", action="store_true", help="time every sm90 tile in both accumulation modes")
    ap.add_argument("--passes", type=int, default=0,
                    help="then time ours and cuBLAS fp8 alternately this many times at M >= 1024")
    ap.add_argument("--swizzles", default="",
                    help="tile orders (N tiles per group) that --passes times beside the default, e.g. 1,4,16")
    ap.add_argument("--promotes", default="",
                    help="promotion intervals (k-tiles) that --passes times and the accuracy table checks, e.g. 1,2,4")
    args = ap.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    copy_gbs, read_gbs, bf16_peak, fp8_peak = measure_ceilings()
    print(f"ceilings: HBM copy {copy_gbs:.0f} GB/s (read+write), read {read_gbs:.0f} GB/s, cuBLAS bf16 {bf16_peak:.0f} TFLOP/s, "
          f"cuBLAS fp8 {fp8_peak:.0f} TFLOP/s (8192^3)")
    rowwise = scaled_mm_rowwise_supported()
    sm90 = capability(torch.device("cuda"))[0] == 9
    print(f"torch._scaled_mm scales: {'rowwise (per token x per channel)' if rowwise else 'tensorwise'}")

    rows = []
    for n, k in SHAPES:
        for m in ms:
            sets = make_sets(m, n, k, n * k)
            cublas = cublas_fp8
            if not rowwise:
                one = torch.ones((), device="cuda")

                def cublas(s):
                    return torch._scaled_mm(s["qx"], s["qw"].t(), one, one, out_dtype=torch.bfloat16)
            variants = {
                "ours": ours,
                "ours+q": lambda s: fp8.fp8_linear(s["x"], s["qw"], s["ws"]),
                "cublas_fp8": cublas,
                "cublas_bf16": lambda s: torch.matmul(s["x"], s["w"].t()),
            }
            kernel = selected(m, n, k).kernel.name
            if kernel == "cute_wgmma_sm90" and rowwise:
                variants["ours_fast"] = lambda s: ours(s, fast_accum=True)
                variants["cublas_fp8_fast"] = lambda s: cublas_fp8(s, fast_accum=True)
            flops = 2 * m * n * k
            t = {name: time_graph(fn, sets) for name, fn in variants.items()}
            row = dict(n=n, k=k, m=m, kernel=kernel)
            for name, sec in t.items():
                wbytes = n * k * (2 if name == "cublas_bf16" else 1)
                row[name] = (sec * 1e6, flops / sec / 1e12, wbytes / sec / 1e9)
            rows.append(row)
            print(f"N={n} K={k} M={m}: " + ", ".join(
                f"{name} {v[0]:.1f} us {v[1]:.0f} TF/s {v[2]:.0f} GB/s" for name, v in row.items()
                if isinstance(v, tuple)), flush=True)
            del sets
            torch.cuda.empty_cache()

    print()
    print("| N x K | M | ours (kernel) | us | TFLOP/s | weight GB/s | ours+quant us | cuBLAS fp8 us | TFLOP/s "
          "| cuBLAS bf16 us | TFLOP/s | GB/s | vs fp8 | vs bf16 | fast: ours us | TFLOP/s | cuBLAS us | TFLOP/s | vs fp8 fast |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        o, q, f, b = r["ours"], r["ours+q"], r["cublas_fp8"], r["cublas_bf16"]
        line = (f"| {r['n']} x {r['k']} | {r['m']} | {r['kernel']} | {o[0]:.1f} | {o[1]:.0f} | {o[2]:.0f} | "
                f"{q[0]:.1f} | {f[0]:.1f} | {f[1]:.0f} | {b[0]:.1f} | {b[1]:.0f} | {b[2]:.0f} | "
                f"{f[0] / o[0]:.2f}x | {b[0] / o[0]:.2f}x |")
        if "ours_fast" in r:
            of, ff = r["ours_fast"], r["cublas_fp8_fast"]
            line += f" {of[0]:.1f} | {of[1]:.0f} | {ff[0]:.1f} | {ff[1]:.0f} | {ff[0] / of[0]:.2f}x |"
        else:
            line += " - | - | - | - | - |"
        print(line)
    print(f"\nceilings: HBM copy {copy_gbs:.0f} GB/s (read+write), read {read_gbs:.0f} GB/s; bf16 {bf16_peak:.0f} TFLOP/s; "
          f"fp8 {fp8_peak:.0f} TFLOP/s. 'vs' columns are speedups (time ratio, >1 = ours faster)")
    small = [r for r in rows if r["kernel"] == "triton_stream"]
    if small:
        print("\nTriton weight-streaming kernel (M <= 16): bytes moved (weight + activation + scales + output) "
              "per second, against the copy bandwidth of this run\n")
        print("| N x K | M | kernel config | MB | ours us | GB/s | of copy | cuBLAS fp8 us | GB/s | of copy "
              "| cuBLAS bf16 us | GB/s | of copy | vs fp8 | vs bf16 |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in small:
            n, k, m = r["n"], r["k"], r["m"]
            cfg = stream_config(n, k, sm_count(torch.device("cuda")), weight_bytes=1)
            fp8_bytes = n * k + m * k + 4 * (m + n) + 2 * m * n
            bf16_bytes = 2 * n * k + 2 * m * k + 2 * m * n
            cells = []
            for name, nbytes in (("ours", fp8_bytes), ("cublas_fp8", fp8_bytes), ("cublas_bf16", bf16_bytes)):
                us = r[name][0]
                cells += [f"{us:.1f}", f"{nbytes / us / 1e3:.0f}", f"{nbytes / us / 1e3 / copy_gbs:.0%}"]
            print(f"| {n} x {k} | {m} | {cfg['BLOCK_N']}x{cfg['BLOCK_K']}, split {cfg['SPLIT_K']}, "
                  f"{cfg['num_stages']} stages | {fp8_bytes / 1e6:.1f} | " + " | ".join(cells)
                  + f" | {r['cublas_fp8'][0] / r['ours'][0]:.2f}x | {r['cublas_bf16'][0] / r['ours'][0]:.2f}x |")
    if not sm90:
        if args.sweep or args.passes:
            print("\n--sweep and --passes time the sm90 kernel: not run on this GPU")
        return
    if any(m > fp8_triton.SMALL_M for m in ms):  # the sm90 kernel's accuracy (M = 1024)
        accuracy_table(rowwise, ints(args.promotes))
    if args.sweep:
        tile_sweep()
    if args.passes and rowwise:
        alternating_passes([m for m in ms if m >= 1024], args.passes, ints(args.swizzles), ints(args.promotes))


if __name__ == "__main__":
    main()
