"""NVFP4 weights vs bf16 cuBLAS (and fp8 torch._scaled_mm) at Llama-3.1-8B linear shapes.

For every (N, K) and M: the time of the NVFP4 GEMM the format's list selects untuned
(engine/formats/nvfp4.py `nvfp4_linear`, named by the kernel it picks; up to 16 tokens the engine's
tuner may choose another of those below per weight) and of each candidate kernel called directly: the
Gluon decode kernels (M <= 16; weights loaded straight into registers, engine/kernels/nvfp4_gluon.py:
mma.sync with x from registers, `decode_matmul`, and wgmma with x from shared memory,
`wgmma_matmul`), the Triton decode kernel (M <= 128; WGMMA, engine/kernels/nvfp4_triton.py
`decode_gemm`), dequantise-to-bf16 + cuBLAS and, past 128 tokens,
dequantise-to-FP8 + the CuTe DSL FP8 GEMM (checked against its own reference,
`nvfp4_fp8_linear_reference`); next to bf16
cuBLAS and fp8 _scaled_mm. Reported: the bytes each must move (weights as stored, activations,
output), the achieved GB/s as a fraction of the HBM copy bandwidth measured in the same run, and
TFLOP/s next to bf16 cuBLAS at 8192^3, measured here too. Every result is checked against a
float64 reference before it is timed.

The weights are stored as the engine stores them on the device (`for_device`: 16-row x 128-K
tiles on Hopper where the shape allows); with --decode the Gluon decode kernel is also timed on
the row-major order ("Gluon decode, row-major").

Timing: each variant is captured in a CUDA graph that calls it once per weight copy, rotating over
enough copies to exceed 2x L2, so every call reads its weights from HBM and launch gaps vanish;
the median of 20 replays, divided by the calls per replay.

    python benchmarks/bench_nvfp4.py [--quick] [--decode] [--sweep] [--m 64,128]

--quick: one shape, M in {1, 1024}. --decode: M = 1, 4, 8 and 16 only (no dequant+cuBLAS), and
the fused gate/up projection with its SwiGLU epilogue against the GEMM + the SwiGLU kernel.
--sweep: also times other configurations of the decode kernels at M = 1 and 16, and of the
Triton decode kernel at M = 128 (where M is in the list).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from benchmarks.timing import time_graph  # noqa: E402
from engine.formats import nvfp4 as nv  # noqa: E402
from engine.kernels.platform import cute_available  # noqa: E402
from engine.kernels.swiglu import swiglu  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate+up, down of Llama-3.1-8B
MS = [1, 16, 128, 1024, 8192]


def graph_time_us(fn, calls: int, replays: int = 20) -> float:
    """Median µs of one call of fn(i) (i = 0..calls-1 selects the weight copy), via a graph."""
    return 1e6 * time_graph(fn, range(calls), replays=replays, min_calls=1)


def copy_bandwidth_gbs() -> tuple[float, float]:
    """HBM copy of 1 GiB (bytes read + written): eager cudaMemcpy-backed copy_ and, in a graph,
    an elementwise kernel; the first also warms the clocks up."""
    src = torch.randn(256 * 2**20, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(20):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    nbytes = 2 * src.numel() * 4
    eager = nbytes / statistics.median(times) / 1e3
    kernel = nbytes / graph_time_us(lambda i: torch.mul(src, 1.0, out=dst), calls=4) / 1e3
    return eager, kernel


def bf16_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = graph_time_us(lambda i: a @ b, calls=3)
    return 2 * 8192**3 / t / 1e6


def copies_for(nbytes: int, l2_bytes: int) -> int:
    return max(2, -(-2 * l2_bytes // nbytes))


def check(name, out, ref, tol=1e-2):
    """Relative error vs the float64 reference; bf16 output rounding alone is ~1e-3."""
    err = ((out.double() - ref).norm() / ref.norm()).item()
    if not (err < tol) or out.isnan().any():
        raise SystemExit(f"{name}: wrong result, relative error {err:.3g}")
    return err


def print_sweep(title: str, columns: list[str], rows: list[tuple]) -> None:
    """A sweep's table, if it ran: rows of (N, K, M, *configuration, us, fraction of copy BW)."""
    if not rows:
        return
    print(f"\n{title}")
    print("| " + " | ".join(["N", "K", "M", *columns, "us", "of copy BW"]) + " |")
    print("|" + "---|" * (len(columns) + 5))
    for *config, t, of_copy in rows:
        print("| " + " | ".join(str(v) for v in config) + f" | {t:.1f} | {of_copy:.0%} |")


SWEEP = [  # Triton decode kernel: (BLOCK_N, BLOCK_K, words per thread, num_warps, num_stages)
    (128, 256, 4, 4, 3), (128, 128, 4, 4, 4), (128, 256, 2, 4, 3), (64, 128, 2, 4, 6),
    (128, 128, 2, 8, 3), (256, 256, 4, 8, 3)]
SWEEP_128 = [  # the same at 128 tokens
    (128, 128, 4, 8, 4), (128, 128, 4, 8, 3), (256, 128, 4, 8, 3), (256, 128, 4, 8, 4)]
WGMMA_SWEEP = [(4, 64), (4, 128), (8, 128)]  # Gluon wgmma decode kernel: (num_warps, BLOCK_N)
GLUON_SWEEP = [  # Gluon decode kernel: (num_warps, BLOCK_N, warps along K, words per thread)
    (4, 16, 4, 4), (4, 32, 2, 4), (4, 64, 1, 4), (4, 32, 4, 4), (8, 16, 8, 4), (4, 16, 4, 8),
    (4, 32, 2, 8)]


def main():
    parser = argparse.ArgumentParser(description="NVFP4 GEMM kernels vs bf16 cuBLAS at Llama-3.1-8B shapes")
    parser.add_argument("--quick", action="store_true", help="one shape, M in {1, 1024}")
    parser.add_argument("--decode", action="store_true",
                        help="M in {1, 4, 8, 16}: NVFP4 kernels, cuBLAS and fp8 only, and the SwiGLU epilogue")
    parser.add_argument("--sweep", action="store_true", help="time other decode-kernel configs")
    parser.add_argument("--m", help="comma list of M to time instead of the default list")
    args = parser.parse_args()
    from engine.kernels import nvfp4_gluon as gdec
    from engine.kernels import nvfp4_triton as dec
    torch.manual_seed(0)
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    l2 = props.L2_cache_size
    copy_eager, copy_kernel = copy_bandwidth_gbs()
    copy_gbs = max(copy_eager, copy_kernel)
    peak_tflops = bf16_tflops()
    print(f"device: {props.name}, {sms} SMs, L2 {l2 >> 20} MiB; torch {torch.__version__}")
    print(f"HBM copy 1 GiB (read+write): copy_ {copy_eager:.0f} GB/s, elementwise kernel "
          f"{copy_kernel:.0f} GB/s; bf16 cuBLAS 8192^3 {peak_tflops:.0f} TFLOP/s")
    shapes, ms = (SHAPES[:1], [1, 1024]) if args.quick else (SHAPES, [1, 4, 8, 16] if args.decode else MS)
    if args.m:
        ms = [int(v) for v in args.m.split(",")]
    rows, sweep_rows, gluon_sweep_rows, wgmma_sweep_rows = [], [], [], []
    for n, k in shapes:
        w_dense = torch.randn(n, k, device="cuda") * 0.02
        w_q = nv.quantize(w_dense)
        w_bf16 = w_dense.bfloat16()
        del w_dense
        w_fp8_scale = w_bf16.float().abs().amax() / 448
        w_fp8 = (w_bf16.float() / w_fp8_scale).to(torch.float8_e4m3fn)
        copies_q = copies_for(w_q.nbytes, l2)
        copies_b = copies_for(w_bf16.numel() * 2, l2)
        rows_q = [nv.Nvfp4Tensor(w_q.packed.clone(), w_q.block_scale.clone(), w_q.tensor_scale.clone(),
                                 w_q.shape) for _ in range(copies_q)]
        qs = [nv.for_device(q, device) for q in rows_q]  # the engine's storage
        bs = [w_bf16.clone() for _ in range(copies_b)]
        fs = [w_fp8.clone() for _ in range(copies_b)]
        dq_ref = nv.dequantize(w_q).double()
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ dq_ref.t()
            ref_bf16 = x.double() @ w_bf16.double().t()
            act_out_bytes = m * k * 2 + m * n * 2
            flops = 2 * m * n * k

            def measure(variant, fn, calls, weight_bytes, reference, tol=1e-2, out_cols=n):
                err = check(variant, fn(0), reference, tol)
                t_us = graph_time_us(fn, calls)
                nbytes = weight_bytes + act_out_bytes - m * (n - out_cols) * 2
                gbs = nbytes / t_us / 1e3
                rows.append((n, k, m, variant, t_us, nbytes, gbs, gbs / copy_gbs,
                             flops / t_us / 1e6, err))

            choice = nv.nvfp4_kernel(m, qs[0], device, x.dtype)
            # The FP8 path rounds the weight once more and quantises x: its own reference.
            ref_fp8 = nv.nvfp4_fp8_linear_reference(x, qs[0], torch.float32).double() if m > dec.MAX_M else None
            measure(f"nvfp4 selected ({choice.kernel.name})", lambda i: nv.nvfp4_linear(x, qs[i]), copies_q,
                    w_q.nbytes, ref_fp8 if choice.kernel.input_quant == "fp8" else ref)
            if m <= 16:
                gluon_cfg = gdec.decode_config(m, n, k, sms)
                measure("nvfp4 Gluon decode", lambda i: gdec.decode_matmul(x, qs[i], out, gluon_cfg),
                        copies_q, w_q.nbytes, ref)
                measure("nvfp4 Gluon wgmma decode", lambda i: gdec.wgmma_matmul(x, qs[i], out),
                        copies_q, w_q.nbytes, ref)
                if args.decode:
                    measure("nvfp4 Gluon decode, row-major",
                            lambda i: gdec.decode_matmul(x, rows_q[i], out, gluon_cfg), copies_q,
                            w_q.nbytes, ref)
            if m <= dec.MAX_M:
                measure("nvfp4 Triton decode", lambda i: dec.decode_gemm(x, qs[i], out), copies_q,
                        w_q.nbytes, ref)
            if args.decode and n == 28672 and m <= 16:  # the fused gate/up projection: SwiGLU
                f = n // 2
                ref_h = F.silu(ref[:, :f]) * ref[:, f:]
                out_h = torch.empty(m, f, device="cuda", dtype=torch.bfloat16)
                backends = [nv.Nvfp4Weight(q, torch.bfloat16) for q in qs]
                fused = backends[0]._swiglu_choice(m, x.dtype).kernel.name
                measure(f"nvfp4 selected + SwiGLU ({fused})", lambda i: backends[i].swiglu_forward(x)
                        if fused != "separate" else swiglu(nv.nvfp4_linear(x, qs[i])), copies_q, w_q.nbytes, ref_h,
                        out_cols=f)
                measure("nvfp4 Gluon decode, SwiGLU epilogue",
                        lambda i: gdec.decode_matmul(x, qs[i], out_h, swiglu=True), copies_q, w_q.nbytes, ref_h,
                        out_cols=f)
                measure("nvfp4 Gluon wgmma decode, SwiGLU epilogue",
                        lambda i: gdec.wgmma_matmul(x, qs[i], out_h, swiglu=True), copies_q, w_q.nbytes, ref_h,
                        out_cols=f)
                measure("nvfp4 Triton decode + SwiGLU kernel",
                        lambda i: swiglu(dec.decode_gemm(x, qs[i], out)), copies_q, w_q.nbytes, ref_h, out_cols=f)
            if not args.decode:
                measure("nvfp4 dequant+cuBLAS",
                        lambda i: F.linear(x, dec.dequantize_bf16(qs[i])), copies_q,
                        w_q.nbytes + 2 * n * k * 2, ref)
                if ref_fp8 is not None and cute_available():
                    # + the FP8 weight written and read, x quantised (read, FP8 written and read)
                    measure("nvfp4 dequant to FP8 + CuTe DSL FP8 GEMM", lambda i: nv.fp8_linear(
                        x, *dec.dequantize_fp8(qs[i])), copies_q, w_q.nbytes + 2 * n * k + 4 * m * k, ref_fp8)
            measure("bf16 cuBLAS", lambda i: F.linear(x, bs[i]), copies_b, n * k * 2, ref_bf16)
            x_scale = x.float().abs().amax() / 448
            x_fp8 = (x.float() / x_scale).to(torch.float8_e4m3fn)
            try:
                # per-tensor e4m3 activations and weights: a few percent of error
                measure("fp8 _scaled_mm",
                        lambda i: torch._scaled_mm(x_fp8, fs[i].t(), scale_a=x_scale,
                                                   scale_b=w_fp8_scale, out_dtype=torch.bfloat16),
                        copies_b, n * k, ref_bf16, tol=0.1)
            except RuntimeError as e:  # cuBLASLt fp8 may want M % 16 == 0
                print(f"fp8 _scaled_mm N={n} K={k} M={m}: not run ({str(e).splitlines()[0][:80]})")
            if args.sweep and m in (1, 16, 128):
                def sweep_point(label, gemm, cfg):
                    """A decode configuration checked, then timed: (us, fraction of copy BW)."""
                    check(label, gemm(x, qs[0], out, cfg), ref)
                    t = graph_time_us(lambda i: gemm(x, qs[i], out, cfg), copies_q)
                    return t, (w_q.nbytes + act_out_bytes) / t / 1e3 / copy_gbs

                for block_n, block_k, wpt, warps, stages in SWEEP if m <= 16 else SWEEP_128:
                    for split in (1, 2, 4, 8):
                        steps = k // block_k
                        if steps % split or steps < 2 * split or (qs[0].tiled and block_k % 128):
                            continue
                        cfg = dec.small_m_config(m, n, k, sms, block_n=block_n, block_k=block_k,
                                                 words_per_thread=wpt, num_warps=warps,
                                                 num_stages=stages, split_k=split)
                        t, of_copy = sweep_point("sweep", dec.decode_gemm, cfg)
                        sweep_rows.append((n, k, m, block_n, block_k, wpt, warps, stages, split,
                                           t, of_copy))
                for warps, block_n in WGMMA_SWEEP if m <= 16 else []:
                    for split in (1, 2, 4, 8, 16):
                        if k % (split * 128) or k // (split * 128) < 2:
                            continue
                        cfg = gdec.wgmma_config(m, n, k, sms, num_warps=warps, block_n=block_n, split_k=split)
                        t, of_copy = sweep_point("wgmma sweep", gdec.wgmma_matmul, cfg)
                        wgmma_sweep_rows.append((n, k, m, warps, block_n, split, t, of_copy))
                for warps, block_n, warps_k, wpt in GLUON_SWEEP if m <= 16 else []:
                    for split in (1, 2, 4, 8):
                        k_warp = split * warps_k * 32 * wpt  # K one step covers over warps, splits
                        if k % k_warp or k // k_warp < 2 or (qs[0].tiled and wpt < 4):
                            continue
                        cfg = gdec.decode_config(m, n, k, sms, num_warps=warps, block_n=block_n,
                                                 warps_k=warps_k, split_k=split, words_per_thread=wpt)
                        t, of_copy = sweep_point("gluon sweep", gdec.decode_matmul, cfg)
                        gluon_sweep_rows.append((n, k, m, warps, block_n, warps_k, wpt, split, t,
                                                 of_copy))
        qs = rows_q = bs = fs = dq_ref = None  # free the copies before the next shape
        torch.cuda.empty_cache()

    print_sweep("NVFP4 Gluon wgmma decode kernel configurations",
                ["warps", "BLOCK_N", "SPLIT_K"], wgmma_sweep_rows)
    print_sweep("NVFP4 Gluon decode kernel configurations",
                ["warps", "BLOCK_N", "warps along K", "words/thread", "SPLIT_K"], gluon_sweep_rows)
    print_sweep("NVFP4 Triton decode kernel configurations",
                ["BLOCK_N", "BLOCK_K", "words/thread", "warps", "stages", "SPLIT_K"], sweep_rows)
    print(f"\nceilings: HBM copy {copy_gbs:.0f} GB/s (read+write), bf16 {peak_tflops:.0f} TFLOP/s; "
          "bytes = weights as stored + x + y (dequant+cuBLAS also counts its bf16 write and read)")
    print("| N | K | M | variant | us | MB moved | GB/s | of copy BW | TFLOP/s | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, k, m, variant, t, nbytes, gbs, frac, tflops, err in rows:
        print(f"| {n} | {k} | {m} | {variant} | {t:.1f} | {nbytes / 1e6:.1f} | {gbs:.0f} | "
              f"{frac:.0%} | {tflops:.1f} | {err:.1e} |")
    by_key = {(n, k, m, v): t for n, k, m, v, t, *_ in rows}
    selected = {(n, k, m): v for n, k, m, v in by_key if v.startswith("nvfp4 selected")}
    for variant in ("nvfp4 selected", "nvfp4 Gluon decode", "nvfp4 Gluon decode, row-major",
                    "nvfp4 Gluon wgmma decode", "nvfp4 Triton decode", "nvfp4 dequant+cuBLAS"):
        def key(n, k, m, variant=variant):
            return (n, k, m, selected.get((n, k, m))) if variant == "nvfp4 selected" else (n, k, m, variant)
        if not any(key(n, k, m) in by_key for n, k in shapes for m in ms):
            continue
        print(f"\nspeed-up of {variant} over bf16 cuBLAS")
        for n, k in shapes:
            print(f"N={n} K={k}: " + ", ".join(
                f"M={m} {by_key[(n, k, m, 'bf16 cuBLAS')] / by_key[key(n, k, m)]:.2f}x"
                for m in ms if key(n, k, m) in by_key))


if __name__ == "__main__":
    main()
