"""Dense (bf16) decode GEMMs at Llama-3.1-8B shapes: the Triton weight-streaming kernel against cuBLAS.

    python benchmarks/bench_dense.py [--m 1,16] [--sweep]

Per shape (q/k/v, o, gate/up with SwiGLU, down, the LM head) and M: cuBLAS (torch's GEMM; for gate/up
followed by the engine's SwiGLU kernel, what the dense format ran before) and the streaming kernel
(engine/kernels/stream_triton.py) with its rule's launch (`stream_config`), and with --sweep every
configuration the tuner times (`stream_configs`): the fastest in the main table, each one in a table
after it. Each is captured in a CUDA graph over rotating weight copies (together more than 400 MB,
so every call reads its weight from HBM) and the replay is timed with CUDA events, the median over
replays per call. Bytes are everything a call must move (weight, activations, output), against
the HBM copy bandwidth (read + write) measured in the same run. Every timed configuration's output
is checked against float64 first.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from benchmarks.bench_fp8 import measure_ceilings  # noqa: E402
from benchmarks.timing import time_graph  # noqa: E402
from engine.kernels import stream_triton  # noqa: E402
from engine.kernels.platform import sm_count  # noqa: E402
from engine.kernels.swiglu import swiglu  # noqa: E402

SHAPES = {"q/k/v": (6144, 4096, False), "o": (4096, 4096, False), "gate/up + SwiGLU": (28672, 4096, True),
          "down": (4096, 14336, False), "LM head": (128256, 4096, False)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,16", help="token counts M (at most 16), comma-separated")
    ap.add_argument("--sweep", action="store_true", help="also time every configuration the tuner times")
    args = ap.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    sms = sm_count(torch.device("cuda"))
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    copy_gbs = measure_ceilings()[0]
    print(f"HBM copy {copy_gbs:.0f} GB/s")
    print("\n| shape | M | MB | cuBLAS us | of copy | streaming us | of copy | config | × cuBLAS | best listed us | config |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|")
    swept = []    # (shape, M, config, seconds, fraction of copy) of every configuration timed
    for name, (n, k, sw) in SHAPES.items():
        copies = max(2, -(-400_000_000 // (2 * n * k)))
        ws = [(torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16) for _ in range(copies)]
        width = n // 2 if sw else n
        rule = stream_triton.stream_config(width, k, sms, swiglu=sw)
        listed = stream_triton.stream_configs(width, k, sms, sw) if args.sweep else []
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, width, device="cuda", dtype=torch.bfloat16)
            ref = stream_triton.stream_matmul_ref(x.double(), ws[0].double(), sw)
            nbytes = 2 * (n * k + m * k + m * width)

            def stream(i, cfg):
                return stream_triton.stream_matmul(x, ws[i], out, cfg, sw)
            timed = {}
            for cfg in [rule] + listed:
                out.fill_(float("nan"))
                stream(0, cfg)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                assert err < 4e-3, (name, m, cfg, err)
                timed[str(cfg)] = (time_graph(lambda i, c=cfg: stream(i, c), range(copies)), cfg)
            if sw:
                t_cublas = time_graph(lambda i: swiglu(F.linear(x, ws[i])), range(copies))
            else:
                t_cublas = time_graph(lambda i: F.linear(x, ws[i]), range(copies))
            t_rule = timed[str(rule)][0]
            best_t, best_cfg = min(timed.values(), key=lambda v: v[0])

            def frac(t):
                return nbytes / t / 1e9 / copy_gbs
            cfg_s = f"{rule['BLOCK_N']}x{rule['BLOCK_K']}, split {rule['SPLIT_K']}, {rule['num_stages']} stages"
            best_s = f"{best_t * 1e6:.1f} | {best_cfg}" if args.sweep else "- | -"
            swept += [(name, m, cfg, t, frac(t)) for t, cfg in timed.values()] if args.sweep else []
            print(f"| {name} | {m} | {nbytes / 1e6:.1f} | {t_cublas * 1e6:.1f} | {frac(t_cublas):.0%} | "
                  f"{t_rule * 1e6:.1f} | {frac(t_rule):.0%} | {cfg_s} | {t_cublas / t_rule:.2f} | {best_s} |", flush=True)
        ws.clear()      # this shape's weights, before the next shape's
        torch.cuda.empty_cache()
    if swept:
        print("\n| shape | M | BLOCK_N x BLOCK_K | split | stages | us | of copy |\n|---|---:|---|---:|---:|---:|---:|")
        for name, m, cfg, t, f in swept:
            c = stream_triton.as_config(cfg)
            print(f"| {name} | {m} | {c['BLOCK_N']}x{c['BLOCK_K']} | {c['SPLIT_K']} | {c['num_stages']} | "
                  f"{t * 1e6:.1f} | {f:.0%} |")


if __name__ == "__main__":
    main()
