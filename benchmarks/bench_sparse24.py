"""2:4-sparse FFN vs dense, at Llama-3.1-8B FFN shapes, on one GPU in one run.

Measures, in the same process: the HBM copy bandwidth and the bf16 / fp8 dense GEMM rates (the
ceilings); then for each M the FFN block (gate_up GEMM -> SwiGLU -> down GEMM) dense bf16 (cuBLAS)
vs 2:4 bf16 (as the model runs it: the SwiGLU in gate_up's epilogue where the tuner picked it; also
with the SwiGLU kernel after gate_up, for comparison), and FP8 dense (per-token x per-channel
torch._scaled_mm) vs 2:4+FP8, eager and as a replayed CUDA graph; then every GEMM on its own: the
kernel the format selects ("selected") and each kernel that can run the shape, called directly with
its first configuration, next to cuBLAS and torch's semi-structured sparse tensor.

The 2:4 weights (engine/formats/sparse24.py) are tuned first, as the engine does when it starts:
`tune()` with an enabled engine/kernels/tuner.py Tuner for every M measured, its cache a temporary
file unless --tune-cache names one (a cache that already holds entries for this device is reused,
nothing timed). The report lists each weight's `tuned` choices and the tuner's entries.

Each variant is checked against a float reference first. Times are medians over repetitions that
each start with L2 evicted by a read (benchmarks/timing.py `cold_ms`), so weights and activations
come from HBM each time; a last table times decode-sized blocks back to back in one CUDA graph.

    python benchmarks/bench_sparse24.py [--out results.json] [--ms 1,16,128,1024,8192] [--tune-cache PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

# The repository root, without replacing PYTHONPATH (which may carry packages such as torchao).
sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from engine.formats import sparse24 as s24  # noqa: E402
from engine.formats.fp8 import quantize_act_fp8, quantize_rows_fp8  # noqa: E402
from engine.kernels.platform import capture  # noqa: E402
from engine.kernels.select import runnable, select  # noqa: E402
from engine.kernels.swiglu import swiglu  # noqa: E402
from engine.kernels.tuner import Tuner  # noqa: E402
from timing import cold_ms, time_graph  # noqa: E402

HIDDEN, FFN = 4096, 14336
GEMMS = {"gate_up": (2 * FFN, HIDDEN), "down": (HIDDEN, FFN)}  # name: (N, K)
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def median_ms(fn, graph=False, rep=60):
    """Median ms of fn() (replayed from a CUDA graph if graph), each run after L2 is evicted."""
    fn()
    torch.cuda.synchronize()
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with capture(g):      # (Triton kernels under either allocator)
            fn()
        fn = g.replay
    return cold_ms(fn, rep)


def try_ms(fn, graph=False):
    try:
        return median_ms(fn, graph)
    except Exception as e:  # report the failing path and go on: the table says n/a
        log(f"  failed ({'graph' if graph else 'eager'}): {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        torch.cuda.synchronize()
        return None


def ceilings():
    n = 1 << 28  # 512 MiB of bf16
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy_ms = median_ms(lambda: b.copy_(a))
    copy_bw = 2 * a.numel() * 2 / copy_ms * 1e-9  # TB/s, bytes read + written
    s = 8192
    x = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: x @ y)
    x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    mm8_ms = median_ms(lambda: torch._scaled_mm(x8, y8, one, one, out_dtype=torch.bfloat16))
    return {"copy_TBps": copy_bw, "bf16_TFLOPs": 2 * s ** 3 / mm_ms * 1e-9, "fp8_TFLOPs": 2 * s ** 3 / mm8_ms * 1e-9}


def rel(out, ref):
    out = out.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()


class Weights:
    """One GEMM's weight in every format the benchmark compares; the 2:4 ones tuned for `ms`
    (swiglu: a fused gate/up projection, whose SwiGLU epilogue is tuned too)."""

    def __init__(self, n, k, gen, tuner, ms, swiglu=False):
        self.n, self.k = n, k
        self.dense = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        self.pruned = s24.prune_24(self.dense)
        self.q8, self.s8 = quantize_rows_fp8(self.dense)
        self.sp = s24.Sparse24Weight.from_dense(self.pruned)
        self.sp8 = s24.Sparse24Fp8Weight.from_dense(self.pruned)
        self.sp.tune(tuner, ms, swiglu=swiglu)
        self.sp8.tune(tuner, ms)
        self.q8t = self.q8.t()
        try:
            from torch.sparse import to_sparse_semi_structured
            self.torch_sparse = to_sparse_semi_structured(self.pruned)
        except Exception as e:
            log(f"to_sparse_semi_structured: {type(e).__name__}: {e}")
            self.torch_sparse = None

    def fp8_dense(self, x, x_scale=None):
        q, s = (x, x_scale) if x_scale is not None else quantize_act_fp8(x)
        return torch._scaled_mm(q, self.q8t, s[:, None], self.s8[None, :], out_dtype=torch.bfloat16)

    def variants(self, x):
        """name -> (fn, reference weight for the check, tolerance), for activations shaped like x:
        the kernel each 2:4 format selects, then every kernel that can run x's M (first config)."""
        v = {"dense bf16 (cuBLAS)": (lambda x: F.linear(x, self.dense), self.dense, 8e-3)}
        v.update(kernel_variants("2:4", self.sp, x, self.pruned))
        if self.torch_sparse is not None:
            v["2:4 torch semi_structured"] = (lambda x: F.linear(x, self.torch_sparse), self.pruned, 8e-3)
        v["fp8 dense (_scaled_mm)"] = (self.fp8_dense, (self.q8.float() * self.s8[:, None]), 6e-2)
        v.update(kernel_variants("2:4+fp8", self.sp8, x, self.sp8.dequantize()))
        return v


def kernel_variants(label, weight, x, wref):
    """`weight`'s selected kernel (weight.forward, its tuned choice) and each runnable kernel on its
    own, all on bf16 x. The kernels that multiply e4m3 activations (input_quant "fp8": the 2:4+fp8
    sparse-MMA kernel, torchao's) quantise x per token first (a few percent of error, and a launch
    in their time); the others take it in bf16."""
    problem = weight._problem(weight.op, x)
    chosen = select(weight.table, problem, weight.tuned.get(weight.op))

    def tol(kernel):
        return 6e-2 if kernel.input_quant == "fp8" else 8e-3
    v = {f"{label} selected ({chosen.kernel.name})": (weight.forward, wref, tol(chosen.kernel))}
    first = {}
    for kernel, config in runnable(weight.table, problem):
        first.setdefault(kernel.name, (kernel, config))
    for name, (kernel, config) in first.items():
        v[f"{label} {name}"] = (lambda x, k=kernel, c=config: k.run(x, weight, config=c), wref, tol(kernel))
    return v


def ffn_blocks(w):
    """As the model runs them (models/llama.py LlamaMLP): where the down projection takes e4m3
    activations (input_quant), the SwiGLU kernel writes them, quantised per token in the same pass.
    The block's input x is bf16 on every side (the FP8 paths quantise it inside gate_up; in the model
    the fused RMSNorm would write it as e4m3, which this leaves out)."""
    gu, dn = w["gate_up"], w["down"]

    def feed(forward, h):
        return forward(*h) if isinstance(h, tuple) else forward(h)

    def sparse_swiglu(x):  # as Linear.swiglu: the GEMM's SwiGLU epilogue where it runs (decode)
        h = gu.sp.swiglu_forward(x)
        return swiglu(gu.sp.forward(x)) if h is None else h
    return {
        "dense bf16": lambda x: F.linear(swiglu(F.linear(x, gu.dense)), dn.dense),
        "2:4 bf16": lambda x: dn.sp.forward(sparse_swiglu(x)),
        "2:4 bf16, SwiGLU kernel": lambda x: dn.sp.forward(swiglu(gu.sp.forward(x))),
        "fp8 dense": lambda x: dn.fp8_dense(*swiglu(gu.fp8_dense(x), "fp8")),
        "2:4+fp8": lambda x: feed(dn.sp8.forward, swiglu(gu.sp8.forward(x), dn.sp8.input_quant(x.shape[0]))),
    }


def main():
    ap = argparse.ArgumentParser(description="2:4-sparse FFN vs dense at Llama-3.1-8B shapes")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--ms", default="1,16,128,1024,8192", help="token counts M, comma-separated")
    ap.add_argument("--tune-cache", default=None,
                    help="the tuner's cache file (default: a fresh temporary file, so every run tunes)")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    res = {"device": props.name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    log(res)
    res["ceilings"] = cl = ceilings()
    log("ceilings", {k: round(v, 2) for k, v in cl.items()})

    gen = torch.Generator(device="cuda").manual_seed(0)
    tmp = None if args.tune_cache else tempfile.TemporaryDirectory()
    tuner = Tuner(args.tune_cache or os.path.join(tmp.name, "tuning.json"), enabled=True)
    w = {name: Weights(n, k, gen, tuner, ms, swiglu=name == "gate_up") for name, (n, k) in GEMMS.items()}
    tuner.save()
    log(f"tuned: {tuner.timed} candidate timings, {len(tuner.entries)} cache entries ({tuner.path})")
    res["tuned"] = {f"{name} {fmt_name}": {op: {str(b): list(pick) for b, pick in by_m.items()}
                                            for op, by_m in getattr(wt, attr).tuned.items()}
                    for name, wt in w.items() for fmt_name, attr in (("2:4", "sp"), ("2:4+fp8", "sp8"))}
    res["tuner_entries"] = [e for e in (dict(json.loads(key), **entry) for key, entry in tuner.entries.items())
                            if e["op"].startswith("sparse24")]
    for name, wt in w.items():
        sp, sp8 = wt.sp, wt.sp8
        log(f"{name}: cuSPARSELt bf16 {'yes' if sp.packed is not None else 'NO'}, values shared with it: "
            f"{sp.packed is not None and sp.values.data_ptr() == sp.packed.data_ptr()}; torchao fp8: "
            f"{sp8.packed is not None}, values shared: {sp8.packed is not None and sp8.values.data_ptr() == sp8.packed.data_ptr()}; "
            f"weight bytes dense {wt.dense.numel() * 2 / 1e6:.1f} MB, 2:4 {sp.weight_bytes() / 1e6:.1f} MB, "
            f"2:4+fp8 {sp8.weight_bytes() / 1e6:.1f} MB")

    # Correctness of every variant at every M, fresh inputs, before any timing.
    res["check"] = checks = {}
    for m in ms:
        for name, wt in w.items():
            x = torch.randn(m, wt.k, device="cuda", dtype=torch.bfloat16)
            for vname, (fn, wref, tol) in wt.variants(x).items():
                try:
                    err = rel(fn(x), x.float() @ wref.float().t())
                except Exception as e:
                    log(f"check {name} M={m} {vname}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    err = None
                checks[f"{name}|{m}|{vname}"] = err
                if err is None or not err < tol:
                    log(f"CHECK FAIL {name} M={m} {vname}: rel err {err} (tol {tol})")
    blocks = ffn_blocks(w)
    for m in ms:  # the fused SwiGLU epilogue against the GEMM + SwiGLU kernel
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        key = f"ffn|{m}|2:4 bf16 vs SwiGLU kernel"
        checks[key] = err = rel(blocks["2:4 bf16"](x), blocks["2:4 bf16, SwiGLU kernel"](x).float())
        if not err < 8e-3:
            log(f"CHECK FAIL {key}: rel err {err}")
    bad = [k for k, e in checks.items() if e is not None and not e < 6e-2]
    log(f"checks: {len(checks)} run, {sum(e is None for e in checks.values())} unavailable, {len(bad)} over tolerance")

    # Eager first, CUDA graphs second: a path that cannot be captured must not cost the eager numbers.
    res["ffn"] = ffn = {}
    res["gemm"] = gemm = {}
    for mode in ("eager", "graph"):
        graph = mode == "graph"
        for m in ms:
            x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
            for bname, fn in ffn_blocks(w).items():
                ffn.setdefault(f"{m}|{bname}", {})[mode] = try_ms(lambda: fn(x), graph)
            log(f"FFN {mode} M={m}: " + ", ".join(f"{b} {fmt(ffn[f'{m}|{b}'][mode])}" for b in ffn_blocks(w)))
        for m in ms:
            for name, wt in w.items():
                x = torch.randn(m, wt.k, device="cuda", dtype=torch.bfloat16)
                for vname, (fn, _, _) in wt.variants(x).items():
                    gemm.setdefault(f"{name}|{m}|{vname}", {"eager": None, "graph": None})[mode] = try_ms(
                        lambda: fn(x), graph)
            log(f"GEMMs {mode} M={m} done")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        report(res, w, ms)
    steady(res, w, gen, tuner, [m for m in ms if m <= 128])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def steady(res, w, gen, tuner, ms):
    """The FFN block as a decode step runs it: many blocks back to back in one CUDA graph, each on
    its own weights (3 copies, rotated, beyond L2), so no launch gap or L2 flush is counted per
    block (`time_graph`); the table above times one block per replay after an L2 flush."""
    # The copies share the shapes, so the tuner's cache gives them the same choices without timing.
    copies = [w] + [{name: Weights(n, k, gen, tuner, ms, swiglu=name == "gate_up") for name, (n, k) in GEMMS.items()}
                    for _ in range(2)]
    blocks = [ffn_blocks(c) for c in copies]
    res["steady"] = out = {}
    print("\nFFN block in steady state (graph of blocks over 3 weight copies), median us:\n")
    print("| M | dense bf16 | 2:4 bf16 | x | 2:4 bf16, SwiGLU kernel | fp8 dense | 2:4+fp8 | x vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for m in ms:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        t = {b: time_graph(lambda i: blocks[i][b](x), [0, 1, 2]) * 1e6 for b in blocks[0]}
        out[m] = t
        print(f"| {m} | {t['dense bf16']:.1f} | {t['2:4 bf16']:.1f} | {t['dense bf16'] / t['2:4 bf16']:.2f} | "
              f"{t['2:4 bf16, SwiGLU kernel']:.1f} | {t['fp8 dense']:.1f} | {t['2:4+fp8']:.1f} | {t['dense bf16'] / t['2:4+fp8']:.2f} |", flush=True)


def fmt(t):
    return "n/a" if t is None else f"{t * 1e3:.1f}"


def report(res, w, ms):
    cl = res["ceilings"]
    print(f"\n## 2:4-sparse FFN, Llama-3.1-8B shapes — {res['device']}, torch {res['torch']}, {res['date']}\n")
    print(f"Ceilings measured in this run: HBM copy {cl['copy_TBps']:.2f} TB/s (read+write), "
          f"bf16 GEMM {cl['bf16_TFLOPs']:.0f} TFLOP/s, fp8 GEMM {cl['fp8_TFLOPs']:.0f} TFLOP/s (8192^3).\n")
    print("FFN block (gate_up -> SwiGLU -> down), median us, eager / CUDA graph; speedups from the graph"
          " times (eager where no graph):\n")
    print("| M | dense bf16 | 2:4 bf16 | x | fp8 dense | x | 2:4+fp8 | x vs bf16 | x vs fp8 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in ms:
        r = {b: res["ffn"][f"{m}|{b}"] for b in ("dense bf16", "2:4 bf16", "fp8 dense", "2:4+fp8")}

        def sx(a, b):
            ta, tb = r[a].get("graph") or r[a].get("eager"), r[b].get("graph") or r[b].get("eager")
            return "n/a" if ta is None or tb is None else f"{ta / tb:.2f}"
        cells = [f"{fmt(v.get('eager'))} / {fmt(v.get('graph'))}" for v in r.values()]
        print(f"| {m} | {cells[0]} | {cells[1]} | {sx('dense bf16', '2:4 bf16')} | {cells[2]} | "
              f"{sx('dense bf16', 'fp8 dense')} | {cells[3]} | {sx('dense bf16', '2:4+fp8')} | {sx('fp8 dense', '2:4+fp8')} |")
    print("\n2:4 bf16 with the SwiGLU kernel after gate_up instead of the GEMM's SwiGLU epilogue, graph us: "
          + ", ".join(f"M={m} {fmt(res['ffn'][f'{m}|2:4 bf16, SwiGLU kernel'].get('graph'))}" for m in ms))
    print("\nTuned choices per weight and op, {M bucket: [kernel, config]}:")
    for weight, ops in res["tuned"].items():
        print(f"  {weight}: {ops}")
    print("Tuner entries (the winner of each op, N, K, M bucket, with its time):")
    for e in sorted(res["tuner_entries"], key=lambda e: (e["op"], e["n"], e["k"], e["m_bucket"])):
        print(f"  {e['op']} N={e['n']} K={e['k']} M<={e['m_bucket']}: {e['kernel']} {e['config']} "
              f"{e['ms'] * 1e3:.1f} us")
    print("\nPer GEMM, median us (eager and CUDA graph), dense-equivalent TFLOP/s and bytes moved (weight +"
          " activations) per second, from the faster of the two, as fractions of the measured ceilings:\n")
    print("| GEMM | M | variant | us eager | us graph | TFLOP/s | %bf16 peak | weight+act GB/s | %HBM | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, t in res["gemm"].items():
        name, m, vname = key.split("|")
        m = int(m)
        wt = w[name]
        best = min([v for v in (t["eager"], t["graph"]) if v is not None], default=None)
        if best is None:
            print(f"| {name} | {m} | {vname} | n/a | n/a | | | | | |")
            continue
        flops = 2 * m * wt.n * wt.k
        wbytes = (wt.dense.numel() * 2 if vname.startswith("dense") else wt.dense.numel() if vname.startswith("fp8 dense")
                  else wt.sp8.weight_bytes() if "fp8" in vname else wt.sp.weight_bytes())
        act_bytes = m * (wt.k + wt.n) * 2
        gbs = (wbytes + act_bytes) / best * 1e-6
        err = res["check"].get(key)
        print(f"| {name} | {m} | {vname} | {fmt(t['eager'])} | {fmt(t['graph'])} | {flops / best * 1e-9:.0f} | "
              f"{100 * flops / best * 1e-9 / res['ceilings']['bf16_TFLOPs']:.0f}% | {gbs:.0f} | "
              f"{100 * gbs / 1e3 / res['ceilings']['copy_TBps']:.0f}% | {'n/a' if err is None else f'{err:.1e}'} |")


if __name__ == "__main__":
    main()
