"""Where one engine step's GPU time goes: the top kernels of a profiled prefill or decode step.

    python benchmarks/profile_step.py --model llama-3.1-8b --weights fp8 --prefill 4x2048
    python benchmarks/profile_step.py --model llama-3.1-8b --decode 64
    python benchmarks/profile_step.py --model llama-3.1-8b --weights nvfp4 --graph 1,16
    python benchmarks/profile_step.py --model llama-3.1-8b --kv-cache-dtype fp8 --graph 256 --context 100..2048
    python benchmarks/profile_step.py --model llama-3.1-8b --sparse-ffn magnitude --prefill 4x2048 --host
    python benchmarks/profile_step.py --model llama-3.1-8b --prefill 1x32768 --step-tokens 8192
    python benchmarks/profile_step.py --model llama-3.1-8b --prefill 4x2048 --host --tensor-parallel-size 2

Builds the engine (random weights for presets), runs the step once to warm up (compilation,
autotuning), then profiles the same step again with torch.profiler and prints the CUDA kernels
that took the most time, with their share of the step.

--host: where the host's time of the same step goes instead: the step runs under cProfile (the GPU
work is queued, not waited for, except where the host itself waits), and the functions with the
most time of their own and the most time in all are printed, with the step's wall time and the
time the host spent waiting for the device (`Engine.stats`).

--tensor-parallel-size N: the prefill and decode modes with the model sharded over N GPUs; what is
profiled is rank 0 (the process that schedules, samples and sends each step to the other ranks).
With --host, cProfile does not see the time a CUDA-graph replay blocks until the device takes more
work, which at two GPUs is most of rank 0's host time in prefill (BENCHMARKS.md, "Two GPUs").

--graph B1,B2,..: the decode step as it runs in serving, a captured CUDA graph (engine/cuda_graphs.py)
at each batch size, every sequence at --context tokens (or at lengths drawn from a range), each on
its own pages of the KV cache. Prints the median replay time (CUDA events, no host in it), the
kernels' summed time and count (the difference is what kernel boundaries cost inside the graph),
and the kernels by total time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import run_to_completion  # noqa: E402
from benchmarks.timing import event_ms  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402


def run(engine: Engine, requests) -> None:
    run_to_completion(engine, requests)
    torch.cuda.synchronize()    # the last step's kernels inside the profile


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--sparse-ffn", default=None)
    ap.add_argument("--lm-head", default=None, help="the LM head's format (default: the engine's rule)")
    ap.add_argument("--prefill", default="4x2048", help="SEQSxLEN prompts, one prefill step")
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="--prefill: tokens per step (default: all the prompts in one step); fewer "
                         "prefill the prompts in chunks, each later chunk attending to its cached prefix")
    ap.add_argument("--decode", type=int, default=0, help="profile decode steps at this batch instead")
    ap.add_argument("--graph", default=None, help="profile the captured decode graph at these batch sizes")
    ap.add_argument("--context", default="512",
                    help="--graph: tokens in each sequence's KV cache, N or A..B (uniform, longest first)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype) or fp8")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--host", action="store_true", help="profile the host side of the step (cProfile)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                    help="shard the model over N GPUs and profile rank 0 (not with --graph)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_step.py profiles CUDA kernels: it needs a GPU")
    if args.graph:
        if args.tensor_parallel_size != 1:
            ap.error("--graph captures one process's decode graphs: it runs with --tensor-parallel-size 1")
        return profile_graphs(args, [int(b) for b in args.graph.split(",")])
    seqs, length = (int(v) for v in args.prefill.split("x"))
    engine = Engine(EngineConfig(model=args.model, weights=args.weights, sparse_ffn=args.sparse_ffn, lm_head=args.lm_head,
                                 kv_cache_dtype=args.kv_cache_dtype, kv_cache_tokens=max(65536, 2 * seqs * length),
                                 max_model_len=max(8192, length + 16),
                                 max_num_batched_tokens=args.step_tokens or max(8192, seqs * length),
                                 tensor_parallel_size=args.tensor_parallel_size))
    try:
        profile_steps(engine, args, seqs, length)
    finally:
        engine.close()      # with tensor parallelism: the other ranks leave and exit


def profile_steps(engine: Engine, args, seqs: int, length: int) -> None:
    g = torch.Generator().manual_seed(0)

    def requests(tag, n, max_tokens):
        return [(f"{tag}{i}", torch.randint(100, 30000, (length,), generator=g).tolist(),
                 SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False))
                for i in range(n)]
    if args.decode:
        what = f"{args.decode} decode steps of batch {args.decode}"
        todo = lambda tag: requests(tag, args.decode, 16)   # noqa: E731
    else:
        what = f"prefill of {seqs} x {length} tokens" + (f" in steps of {args.step_tokens}" if args.step_tokens else "")
        todo = lambda tag: requests(tag, seqs, 1)   # noqa: E731
    run(engine, todo("warm"))
    if args.host:
        return profile_host(engine, todo("prof"), what, args)
    # The same work once more without the profiler: its wall time against the kernels' sum says
    # whether the GPU was kept busy (the host queues ahead of it) or waited for the host.
    t0 = time.perf_counter()
    run(engine, todo("timed"))
    wall = (time.perf_counter() - t0) * 1e6
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(engine, todo("prof"))
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) or 1
    print(f"# {args.model} weights={args.weights} sparse_ffn={args.sparse_ffn}{_tp(args)}: {what}; "
          f"GPU time {total / 1e3:.1f} ms, wall {wall / 1e3:.1f} ms unprofiled "
          f"(kernels busy {100 * total / wall:.0f}% of it)")
    print("| kernel | calls | ms | share |\n|---|---:|---:|---:|")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]:
        print(f"| {e.key[:90]} | {e.count} | {e.self_device_time_total / 1e3:.2f} "
              f"| {100 * e.self_device_time_total / total:.1f}% |")


def _tp(args) -> str:
    return f", rank 0 of {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""


def profile_host(engine: Engine, requests, what: str, args) -> None:
    import cProfile
    import pstats
    steps0, host0 = engine.stats["steps"], engine.stats["host_s"]
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    run(engine, requests)
    profiler.disable()
    wall = time.perf_counter() - t0
    steps = engine.stats["steps"] - steps0
    print(f"# {args.model} weights={args.weights} sparse_ffn={args.sparse_ffn}{_tp(args)}: {what}; {steps} steps, "
          f"{wall * 1e3:.1f} ms wall under cProfile, host time per step (Engine.stats) "
          f"{(engine.stats['host_s'] - host0) / max(steps, 1) * 1e3:.1f} ms")
    stats = pstats.Stats(profiler)
    for key in ("tottime", "cumulative"):
        print(f"\n## by {key}")
        stats.sort_stats(key).print_stats(args.top)


def decode_contexts(spec: str, batch: int, seed: int = 0) -> list[int]:
    """--context: "N" gives every row N tokens; "A..B" draws each row's length uniformly in A..B, laid
    out longest first, as a serving step orders its decode rows."""
    if ".." not in spec:
        return [int(spec)] * batch
    lo, hi = (int(v) for v in spec.split(".."))
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randint(lo, hi + 1, (batch,), generator=g).tolist(), reverse=True)


def profile_graphs(args, batches: list[int]) -> None:
    from engine.cuda_graphs import DecodeGraphs
    contexts = {b: decode_contexts(args.context, b) for b in batches}
    bs = 16     # the engine's default block size, fixed here so that the pages can be counted first
    blocks = max(sum(-(-c // bs) for c in ctx) for ctx in contexts.values())
    engine = Engine(EngineConfig(model=args.model, weights=args.weights, sparse_ffn=args.sparse_ffn, lm_head=args.lm_head,
                                 kv_cache_dtype=args.kv_cache_dtype, block_size=bs,
                                 kv_cache_tokens=max(16384, (blocks + 1) * bs),
                                 cuda_graphs=False, max_num_seqs=max(batches)))
    graphs = DecodeGraphs(engine.model, engine.kv_cache, max(batches),
                          -(-engine.max_model_len // bs), engine.kv_cache.scratch_block)
    graphs.buckets = sorted(batches)
    graphs.context_lens.fill_(max(max(c) for c in contexts.values()))
    graphs.capture()

    def lay_out(ctx: list[int]) -> None:
        # Each row its own pages, as in serving: rows that shared pages would read them from L2.
        graphs.block_tables.fill_(graphs.scratch_block)
        graphs.context_lens.fill_(1)
        first = 0
        for r, c in enumerate(ctx):
            n = -(-c // bs)
            graphs.block_tables[r, :n] = torch.arange(first, first + n, dtype=torch.int32)
            graphs.context_lens[r] = c
            first += n
    for b in graphs.buckets:
        lay_out(contexts[b])
        step = event_ms(graphs.graphs[b].replay, rep=60, warmup=5)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graphs.graphs[b].replay()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_ms = sum(e.self_device_time_total for e in events) / 5 / 1e3
        calls = sum(e.count for e in events) / 5
        print(f"# {args.model} weights={args.weights} sparse_ffn={args.sparse_ffn}: decode graph, batch {b}, "
              f"context {args.context} ({sum(contexts[b]):,} tokens read): step {step:.3f} ms; {calls:.0f} kernels, "
              f"{kernel_ms:.3f} ms of kernel time ({(step - kernel_ms) / calls * 1e3:+.2f} us a kernel outside them)")
        print("| kernel | calls | ms | share |\n|---|---:|---:|---:|")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]:
            ms = e.self_device_time_total / 5 / 1e3
            print(f"| {e.key[:90]} | {e.count // 5} | {ms:.3f} | {100 * ms / step:.1f}% |")


if __name__ == "__main__":
    main()
