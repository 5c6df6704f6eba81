"""Multi-stream scheduling and stream-ordered memory, measured on one GPU through the engine itself.

    python benchmarks/bench_streams.py --out DIR          # all four parts, one process (+ children)

(a) Pipelined steps: llama-3.2-1b shapes, decode at batch 1 and 64 with CUDA graphs on, the engine
    built with EngineConfig(overlap=True) and again with overlap=False: time per step (wall clock
    over the timed steps) and the host's time per step (engine.stats["host_s"]: everything but the
    waits for the device).
(b) Layer offload: llama-3.1-8b shapes with gpu_memory_limit set to hold about half the decoder
    layers; decode tokens/sec at batch 1 against the ceiling set by the pinned H2D bandwidth measured
    in this run (ceiling = bandwidth / bytes streamed per token), with the prefetch (copies of the
    next streamed layer overlap the compute) and without it (LayerStreamer.prefetch = False: each
    layer is copied when the compute reaches it, and waits for it).
(c) A torch.profiler trace of a few of those offloaded decode steps, drawn as a timeline PNG (one
    row per stream: H2D copies, compute kernels, token readback), with the time both the copy and
    the compute stream were busy.
(d) Allocators, each in its own process (PYTORCH_ALLOC_CONF is read when torch loads): the native
    caching allocator vs cudaMallocAsync with release threshold dedicated / shared. Per-step time of
    an MLP whose batch size changes every step (every activation a fresh allocation of a new size,
    a host sync per step), and the engine (llama-3.2-1b shapes) on requests of random lengths, so
    the decode batch shrinks as requests finish, with CUDA graphs off and then on (whether capture
    works under each backend).
(e) Two engines sharing one GPU, per allocator and release threshold: a first engine (llama-3.1-8b
    shapes, a fixed 32k-token KV cache) prefills a burst of 8 x 2,048 tokens, synchronises and goes
    idle; then a second engine starts in another process beside it. Measured: the device memory
    the first holds once idle, what the second finds free and makes its KV cache of (85% of it),
    its load time, and its first two steps (a 512-token prefill each: the first pays for every
    allocation a step makes, the second finds them in its pool).

Ceilings measured in the same run: pinned H2D and D2H copy bandwidth (1 GiB), HBM copy (2 GiB).
It prints Markdown tables last and writes bench_streams.json and offload_timeline.png to --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def log(*a):
    print(*a, flush=True)


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def event_ms(fn, iters, stream=None, warmup=2):
    """Median milliseconds of fn() measured with CUDA events on `stream`."""
    stream = stream or torch.cuda.current_stream()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def engine_config(**kw):
    """An EngineConfig from these fields (tolerating an engine without `offload`)."""
    from engine.config import EngineConfig
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    if "offload" not in fields:
        kw.pop("offload", None)
    return EngineConfig(**kw)


# ----------------------------------------------------------------------------- ceilings

def ceilings(dev):
    out = _ceilings(dev)
    free_memory()
    return out


def _ceilings(dev):
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    h2d = event_ms(lambda: d.copy_(host, non_blocking=True), 10)
    d2h = event_ms(lambda: host.copy_(d, non_blocking=True), 10)
    big = torch.randint(0, 255, (2 * n,), dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)
    hbm = event_ms(lambda: big2.copy_(big), 10)
    return {"h2d_pinned_GBps": n / h2d / 1e6, "d2h_pinned_GBps": n / d2h / 1e6,
            "hbm_copy_GBps": 2 * 2 * n / hbm / 1e6}


# ----------------------------------------------------------------------------- (a) pipelined steps

def bench_overlap(results, steps, repeats, model="llama-3.2-1b", device="cuda"):
    from bench import bench_decode
    from engine.engine import Engine
    rows = []
    for overlap in (True, False):
        engine = Engine(engine_config(model=model, device=device, seed=0, overlap=overlap,
                                      cuda_graphs=True, max_num_seqs=64, kv_cache_tokens=64 * 1024))
        vocab = min(engine.model_config.vocab_size, 49152)
        rng = random.Random(0)
        for batch in (1, 64):
            runs = [bench_decode(engine, rng, vocab, batch, 256, steps) for _ in range(repeats)]
            row = {"overlap": overlap, "batch": batch, "graphs": engine.graphs is not None,
                   "step_ms": statistics.median(r[1] * 1e3 for r in runs),
                   "step_ms_runs": [r[1] * 1e3 for r in runs],
                   "host_ms": statistics.median(r[2] * 1e3 for r in runs),
                   "tok_s": statistics.median(r[0] for r in runs)}
            rows.append(row)
            log(f"[overlap] overlap={overlap!s:5s} batch {batch:2d}: {row['step_ms']:.3f} ms/step "
                f"(runs {', '.join(f'{x:.3f}' for x in row['step_ms_runs'])}), host {row['host_ms']:.3f} "
                f"ms/step, {row['tok_s']:.0f} tok/s, graphs {row['graphs']}")
        results["pipelined_engine"] = hasattr(engine, "in_flight")   # the lead's overlap code is in
        del engine
        free_memory()
    results["overlap"] = rows


# ----------------------------------------------------------------------------- (b) offload, (c) trace

def offload_limit_bytes(preset, fields, resident_layers, dtype):
    """A gpu_memory_limit that holds `resident_layers` decoder layers, by the engine's own plan:
    non-layer weights + KV cache + activation reserve + resident layers + two streaming buffers,
    plus half a layer of slack for alignment."""
    import types

    from engine.engine import Engine
    from engine.memory.kv_cache import KVCache
    c = preset
    cfg = types.SimpleNamespace(**fields)
    fake = types.SimpleNamespace(config=cfg, model_config=c, dtype=dtype)
    reserve = Engine._activation_reserve(fake)
    kv = fields["kv_cache_tokens"] * KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dtype)
    h, hd, elt = c.hidden_size, c.head_dim, torch.empty(0, dtype=dtype).element_size()
    layer = elt * (h * hd * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * h * c.intermediate_size + 2 * h)
    non_layer = elt * (c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + h)
    return non_layer + kv + reserve + (resident_layers + 2.5) * layer


def bench_offload(results, ceil, out_dir, steps, repeats, name="llama-3.1-8b", device="cuda"):
    from bench import bench_decode
    from engine.engine import Engine
    from models.presets import SHAPE_PRESETS
    cuda = device == "cuda"
    preset = SHAPE_PRESETS[name]
    fields = {"max_num_batched_tokens": 2048, "max_num_seqs": 16, "kv_cache_tokens": 4096}
    resident = preset.num_layers // 2 if preset.num_layers >= 8 else 1   # two buffers cost 2 layers
    limit = offload_limit_bytes(preset, fields, resident,
                                torch.bfloat16 if cuda else torch.float32)
    engine = Engine(engine_config(model=name, device=device, seed=0, offload=True,
                                  gpu_memory_limit=limit / 2**30, **fields))
    st = engine.streamer
    assert st is not None, "nothing was offloaded"
    per_token = sum(st.blobs[i].nbytes for i in st.order)     # every streamed layer, once per step
    h2d = ceil["h2d_pinned_GBps"] * 1e9
    ceiling_tok_s = h2d / per_token
    res = {"model": name, "gpu_memory_limit_GiB": limit / 2**30, "streamed_layers": len(st.order),
           "num_layers": preset.num_layers, "layer_bytes": st.buffer_bytes, "bytes_per_token": per_token,
           "h2d_GBps": ceil["h2d_pinned_GBps"], "ceiling_tok_s": ceiling_tok_s,
           "peak_allocated_GB": None, "rows": []}
    log(f"[offload] {name}: {len(st.order)} of {preset.num_layers} layers streamed "
        f"({per_token / 1e9:.2f} GB per token), limit {limit / 2**30:.2f} GiB; ceiling "
        f"{ceiling_tok_s:.2f} tok/s at {ceil['h2d_pinned_GBps']:.1f} GB/s")
    vocab = min(engine.model_config.vocab_size, 49152)
    rng = random.Random(0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for prefetch in (True, False):
        st.prefetch = prefetch
        runs = []
        for _ in range(repeats):
            before = st.copied_bytes
            steps_before = engine.stats["steps"]
            tok_s, step_s, host_s = bench_decode(engine, rng, vocab, 1, 128, steps)
            copied = (st.copied_bytes - before) / max(engine.stats["steps"] - steps_before, 1)
            runs.append((tok_s, step_s, host_s, copied))
        tok_s = statistics.median(r[0] for r in runs)
        row = {"prefetch": prefetch, "tok_s": tok_s, "tok_s_runs": [r[0] for r in runs],
               "step_ms": statistics.median(r[1] * 1e3 for r in runs),
               "host_ms": statistics.median(r[2] * 1e3 for r in runs),
               "copied_bytes_per_step": statistics.median(r[3] for r in runs),
               "pct_of_ceiling": 100 * tok_s / ceiling_tok_s,
               "achieved_h2d_GBps": tok_s * per_token / 1e9}
        res["rows"].append(row)
        log(f"[offload] prefetch={prefetch!s:5s}: {tok_s:.2f} tok/s ({row['pct_of_ceiling']:.0f}% of the "
            f"H2D ceiling), {row['step_ms']:.1f} ms/step, streams {row['achieved_h2d_GBps']:.1f} GB/s, "
            f"copied {row['copied_bytes_per_step'] / 1e9:.2f} GB/step")
    res["peak_allocated_GB"] = torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan")
    st.prefetch = True
    results["offload"] = res
    try:
        results["trace"] = trace_offload(engine, rng, vocab, out_dir, cuda)
    except Exception as e:     # noqa: BLE001  (the picture must not cost the numbers)
        log(f"[trace] failed: {type(e).__name__}: {e}")
        results["trace"] = {"error": f"{type(e).__name__}: {e}"}
    for rid in list(engine.requests):
        engine.abort(rid)
    del engine, st
    free_memory()


def trace_offload(engine, rng, vocab, out_dir, cuda=True, num_steps=3):
    """Profile `num_steps` offloaded decode steps at batch 1 and draw the streams' timeline."""
    from torch.profiler import ProfilerActivity, profile

    from bench import random_prompt
    from engine.sampling import SamplingParams
    params = SamplingParams(max_tokens=num_steps + 8, temperature=0, ignore_eos=True, detokenize=False)
    engine.add_request("trace", random_prompt(rng, 128, vocab), params, lambda c: None)
    for _ in range(3):                 # prefill and two decode steps: the pipeline is full
        engine.step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            engine.step()
        sync()
    engine.abort("trace")
    path = os.path.join(out_dir, "offload_trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.remove(path)
    keep = [{k: e.get(k) for k in ("ph", "cat", "name", "ts", "dur")} | {"args": {"stream": e.get("args", {}).get("stream")}}
            for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    for e in keep:
        e["name"] = e["name"][:60]
    with gzip.open(os.path.join(out_dir, "offload_trace_gpu.json.gz"), "wt") as f:
        json.dump(keep, f)                  # redraw with timeline_png without the GPU
    info = timeline_png(events, os.path.join(out_dir, "offload_timeline.png"),
                        f"{num_steps} decode steps, llama-3.1-8b shapes, half the layers streamed "
                        "from pinned host memory (batch 1)")
    log(f"[trace] {info}")
    return info


def _busy(intervals):
    """Merged [start, end) intervals."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(x, y):
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline_png(events, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        raise RuntimeError("the trace holds no GPU events")
    t0 = min(e["ts"] for e in gpu)

    def kind(e):
        n = e["name"]
        if "HtoD" in n:
            return "H2D copy"
        if "DtoH" in n:
            return "D2H copy"
        return "kernel" if e["cat"] == "kernel" else "other copy/memset"

    streams: dict = {}
    for e in gpu:
        streams.setdefault(e.get("args", {}).get("stream", -1), []).append(e)
    rows = []
    for sid, evs in streams.items():
        kinds = [kind(e) for e in evs]
        main = max(set(kinds), key=kinds.count)
        busy = _busy([(e["ts"] - t0, e["ts"] - t0 + e["dur"]) for e in evs])
        rows.append((sid, evs, kinds, main, busy))
    order = {"H2D copy": 0, "kernel": 1, "D2H copy": 2}
    rows.sort(key=lambda r: (order.get(r[3], 3), -len(r[1])))
    names = {"H2D copy": "copy stream (H2D)", "kernel": "compute stream", "D2H copy": "readback (D2H)"}
    colors = {"kernel": "tab:blue", "H2D copy": "tab:orange", "D2H copy": "tab:green",
              "other copy/memset": "tab:gray"}
    span = max(e["ts"] + e["dur"] for e in gpu) - t0
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.55 * len(rows)))
    labels = []
    for y, (sid, evs, kinds, main, busy) in enumerate(rows):
        busy_ms = sum(b - a for a, b in busy) / 1e3
        labels.append(f"{names.get(main, main)} ({sid})\nbusy {busy_ms:.0f} of {span / 1e3:.0f} ms")
        for k, color in colors.items():
            bars = [((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, span / 1e3 / 2000))
                    for e, kk in zip(evs, kinds) if kk == k]
            if bars:
                ax.broken_barh(bars, (y - 0.38, 0.76), facecolor=color, label=k, edgecolor="white",
                               linewidth=0.4 if k == "H2D copy" else 0)
    handles, names_ = ax.get_legend_handles_labels()
    uniq = dict(zip(names_, handles))
    ax.legend(uniq.values(), uniq.keys(), loc="lower right", fontsize=7, ncol=len(uniq), framealpha=0.9)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylim(len(rows) - 0.2 + (0.5 if len(rows) < 3 else 0), -0.5)
    ax.set_xlabel("ms", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(title, fontsize=8, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    copy = next((r[4] for r in rows if r[3] == "H2D copy"), [])
    compute = next((r[4] for r in rows if r[3] == "kernel"), [])
    compute_ms = sum(b - a for a, b in compute) / 1e3
    return {"png": os.path.basename(path), "png_bytes": os.path.getsize(path), "span_ms": span / 1e3,
            "copy_busy_ms": sum(b - a for a, b in copy) / 1e3, "compute_busy_ms": compute_ms,
            "both_busy_ms": _overlap(copy, compute) / 1e3, "streams": len(rows)}


# ----------------------------------------------------------------------------- (d) allocators

def alloc_child(backend, release):
    """Runs in its own process, started with PYTORCH_ALLOC_CONF=backend:<backend>; prints RESULT lines
    one part at a time, so a crash late in the process keeps what came before."""
    from engine.memory import allocator
    allocator.configure_allocator(backend, release)
    dev = torch.device("cuda")
    allocator.apply_release(dev)
    assert allocator.allocator_backend() == backend
    print("RESULT " + json.dumps(alloc_mlp(backend, release, dev)), flush=True)
    free_memory()
    for graphs in (False, True):
        print("RESULT " + json.dumps(alloc_engine(backend, release, graphs)), flush=True)


def alloc_mlp(backend, release, dev):
    out = {"part": "mlp", "backend": backend, "release": release}
    hidden, inter = 2048, 8192
    torch.manual_seed(0)
    wgu = [torch.randn(2 * inter, hidden, device=dev, dtype=torch.bfloat16) / hidden ** 0.5 for _ in range(2)]
    wd = [torch.randn(hidden, inter, device=dev, dtype=torch.bfloat16) / inter ** 0.5 for _ in range(2)]
    src = torch.randn(8192, hidden, device=dev, dtype=torch.bfloat16)
    done = torch.cuda.Event()

    def step(m):
        x = src[:m] * 1.0
        for a, b in zip(wgu, wd):
            g, u = (x @ a.t()).chunk(2, dim=-1)
            scratch = torch.empty(m * 4096, dtype=torch.float32, device=dev)   # per-batch scratch
            scratch[: m].fill_(1.0)
            x = (torch.nn.functional.silu(g) * u) @ b.t() + x
        done.record()
        done.synchronize()           # the engine reads its sampled tokens once per step

    gen = torch.Generator().manual_seed(1)
    growing = sorted(torch.randint(1, 8193, (64,), generator=gen).tolist())
    varying = torch.randint(1, 8193, (200,), generator=gen).tolist()
    step(1)
    for phase, sizes in (("growing", growing), ("varying", varying)):
        times = []
        for m in sizes:
            t = time.perf_counter()
            step(m)
            times.append((time.perf_counter() - t) * 1e3)
        out[phase] = {"median_ms": statistics.median(times), "mean_ms": statistics.mean(times),
                      "max_ms": max(times), "total_ms": sum(times)}
    out["reserved_GB"] = torch.cuda.memory_reserved() / 1e9 if backend == "native" else _pool_reserved(dev)
    return out


def alloc_engine(backend, release, graphs):
    """The engine on 64 requests of random lengths submitted at once: the decode batch shrinks as
    they finish, so step shapes change all the time."""
    from bench import random_prompt, run_to_completion
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    out = {"part": "engine", "backend": backend, "release": release, "cuda_graphs": graphs}
    engine = None
    try:
        engine = Engine(engine_config(model="llama-3.2-1b", device="cuda", seed=0, cuda_graphs=graphs,
                                      max_num_seqs=64, kv_cache_tokens=64 * 512))
        out["graphs_captured"] = engine.graphs is not None
        rng = random.Random(3)
        vocab = min(engine.model_config.vocab_size, 49152)

        shapes = [(rng.randint(32, 256), rng.randint(16, 160)) for _ in range(64)]

        def requests(tag):      # fresh prompt tokens each time: no prefix-cache hits
            return [(f"{tag}{i}", random_prompt(rng, n_in, vocab), SamplingParams(
                max_tokens=n_out, temperature=0, ignore_eos=True, detokenize=False))
                for i, (n_in, n_out) in enumerate(shapes)]
        # Warm-up on the very same shapes: Triton compiles (and caches on disk, where the next
        # process finds them) and autotunes per shape, which must not land in one backend's time.
        run_to_completion(engine, requests("w"))
        reqs = requests("r")
        torch.cuda.synchronize()
        steps = engine.stats["steps"]
        t = time.perf_counter()
        outs = run_to_completion(engine, reqs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        out["tokens"] = sum(len(o) for o in outs)
        out["tok_s"] = out["tokens"] / elapsed
        out["steps"] = engine.stats["steps"] - steps
        out["step_ms"] = elapsed / out["steps"] * 1e3
        out["peak_reserved_GB"] = (torch.cuda.max_memory_reserved() / 1e9 if backend == "native"
                                   else _pool_reserved(torch.device("cuda")))
    except Exception as e:       # noqa: BLE001  (reported, not raised: the next part still runs)
        import traceback
        out["error"] = f"{type(e).__name__}: {e}"[:600]
        out["traceback"] = traceback.format_exc()[-2500:]
    finally:
        del engine
        free_memory()
    return out


def _pool_reserved(dev):
    from cuda.bindings import runtime as cudart
    _err, pool = cudart.cudaDeviceGetDefaultMemPool(dev.index or 0)
    _err, value = cudart.cudaMemPoolGetAttribute(pool, cudart.cudaMemPoolAttr.cudaMemPoolAttrReservedMemCurrent)
    return int(value) / 1e9


ALLOCATORS = (("native", "dedicated"), ("cudaMallocAsync", "dedicated"), ("cudaMallocAsync", "shared"))


def child_env(backend):
    """The environment of a child process on `backend`: torch reads the variable when it loads."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    env["PYTORCH_ALLOC_CONF"] = f"backend:{backend}"
    return env


def bench_allocators(results, timeout):
    rows = []
    for backend, release in ALLOCATORS:
        env = child_env(backend)
        t = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--alloc-child", backend, release],
                               capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout, check=False)
            stdout, stderr, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            stdout, stderr, rc = (e.stdout or b"").decode(), (e.stderr or b"").decode(), "timeout"
        parts = [json.loads(ln[7:]) for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        row = {"backend": backend, "release": release, "exit": rc, "seconds": time.perf_counter() - t,
               "parts": parts}
        row["stderr_tail"] = stderr[-2500:]
        keys = ("Error", "error", "Warning:", "uncaptured", "terminate", "what()")
        row["stderr_errors"] = [ln[:400] for ln in stderr.splitlines() if any(k in ln for k in keys)][:12]
        if rc != 0 or len(parts) < 3:
            shown = "\n".join(row["stderr_errors"]) or stderr[-1500:]
            log(f"[alloc] {backend} {release}: exit {rc}, {len(parts)} of 3 parts; stderr:\n{shown}")
        for part in parts:
            if part["part"] == "mlp":
                g, v = part["growing"], part["varying"]
                log(f"[alloc] {backend:15s} {release:9s} MLP growing: median {g['median_ms']:.3f} max "
                    f"{g['max_ms']:.2f} ms | varying: median {v['median_ms']:.3f} mean {v['mean_ms']:.3f} "
                    f"max {v['max_ms']:.2f} ms | reserved {part['reserved_GB']:.2f} GB")
            elif "error" in part:
                log(f"[alloc] {backend:15s} {release:9s} engine graphs={part['cuda_graphs']}: {part['error']}")
            else:
                log(f"[alloc] {backend:15s} {release:9s} engine graphs={part['cuda_graphs']} (captured "
                    f"{part['graphs_captured']}): {part['tok_s']:.0f} tok/s, {part['step_ms']:.3f} ms/step "
                    f"over {part['steps']} steps")
        rows.append(row)
    results["allocators"] = rows


# ----------------------------------------------------------------------------- (e) two engines, one GPU

def share_child(role, backend, release):
    """One of the two engines of part (e), in a process started with PYTORCH_ALLOC_CONF set. 'first'
    prints READY once idle and waits for its stdin to close; 'second' prints RESULT and exits."""
    t_start = time.perf_counter()
    from bench import random_prompt, run_to_completion
    from engine.engine import Engine
    from engine.memory import allocator
    from engine.sampling import SamplingParams
    allocator.configure_allocator(backend, release)
    dev = torch.device("cuda")
    allocator.apply_release(dev)
    rng = random.Random(5 if role == "first" else 6)
    free_at_start, total = torch.cuda.mem_get_info()
    t = time.perf_counter()
    engine = Engine(engine_config(model="llama-3.1-8b", device="cuda", seed=0, max_num_seqs=64,
                                  kv_cache_tokens=32 * 1024 if role == "first" else None))
    out = {"role": role, "backend": backend, "release": release, "load_s": time.perf_counter() - t,
           "free_at_start_GB": free_at_start / 1e9, "total_GB": total / 1e9,
           "kv_GB": 2 * engine.kv_cache.k.numel() * engine.kv_cache.k.element_size() / 1e9}
    vocab = min(engine.model_config.vocab_size, 49152)

    def serve(n, length, tag):
        reqs = [(f"{tag}{i}", random_prompt(rng, length, vocab), SamplingParams(
            max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)) for i in range(n)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        run_to_completion(engine, reqs)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3
    if role == "first":
        serve(8, 2048, "burst")
        torch.cuda.synchronize()        # a shared pool gives back what it does not hold here
        free, _ = torch.cuda.mem_get_info()
        out["device_used_idle_GB"] = (total - free) / 1e9
        out["reserved_idle_GB"] = (torch.cuda.memory_reserved() / 1e9 if backend == "native"
                                   else _pool_reserved(dev))
        print("READY " + json.dumps(out), flush=True)
        sys.stdin.read()                # idle until part (e) has measured the second engine
        return
    out["first_step_ms"] = serve(1, 512, "a")
    out["second_step_ms"] = serve(1, 512, "b")
    out["process_s"] = time.perf_counter() - t_start
    print("RESULT " + json.dumps(out), flush=True)


def bench_sharing(results, timeout):
    rows = []
    for backend, release in ALLOCATORS:
        env = child_env(backend)
        cmd = [sys.executable, os.path.abspath(__file__), "--share-child"]
        row = {"backend": backend, "release": release}
        errors = tempfile.TemporaryFile("w+")     # a file, not a pipe: its log must never block it
        first = subprocess.Popen(cmd + ["first", backend, release], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=errors, text=True, env=env, cwd=ROOT)
        try:
            for line in first.stdout:          # the first engine is idle once it says READY
                if line.startswith("READY "):
                    row["first"] = json.loads(line[6:])
                    break
            if "first" in row:
                p = subprocess.run(cmd + ["second", backend, release], capture_output=True, text=True, env=env,
                                   cwd=ROOT, timeout=timeout, check=False)
                got = [json.loads(ln[7:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                row["second"] = got[0] if got else {"error": p.stderr[-2000:]}
            else:
                errors.seek(0)
                row["first"] = {"error": errors.read()[-2000:]}
        finally:
            first.stdin.close()
            first.wait(timeout=60)
        f, g = row["first"], row.get("second", {})
        if "error" in f or "error" in g:
            log(f"[share] {backend} {release}: {f.get('error') or g.get('error')}")
        else:
            log(f"[share] {backend:15s} {release:9s} first idle: device {f['device_used_idle_GB']:.2f} GB, "
                f"pool {f['reserved_idle_GB']:.2f} GB | second: free {g['free_at_start_GB']:.2f} GB, KV "
                f"{g['kv_GB']:.2f} GB, load {g['load_s']:.1f} s, steps {g['first_step_ms']:.1f} / "
                f"{g['second_step_ms']:.1f} ms")
        rows.append(row)
    results["sharing"] = rows


# ----------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_streams"))
    ap.add_argument("--alloc-child", nargs=2, metavar=("BACKEND", "RELEASE"))
    ap.add_argument("--share-child", nargs=3, metavar=("ROLE", "BACKEND", "RELEASE"))
    ap.add_argument("--skip", default="", help="comma list of parts to skip: overlap,offload,alloc,share")
    ap.add_argument("--steps", type=int, default=64, help="(a): timed decode steps per run")
    ap.add_argument("--offload-steps", type=int, default=12, help="(b): timed decode steps per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per (a) point; (b) takes 2")
    ap.add_argument("--child-timeout", type=int, default=150, help="(d): seconds per allocator process")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU dry run of (a)-(c) on llama-tiny with made-up ceilings: proves the script, "
                         "measures nothing")
    args = ap.parse_args()
    if args.alloc_child:
        alloc_child(*args.alloc_child)
        return
    if args.share_child:
        share_child(*args.share_child)
        return
    os.makedirs(args.out, exist_ok=True)
    skip = set(args.skip.split(","))
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "commit": os.environ.get("BENCH_COMMIT", "unknown")}
    t_all = time.perf_counter()
    if "alloc" not in skip and not args.smoke:     # first: the children need the GPU to themselves
        bench_allocators(results, args.child_timeout)
    if "share" not in skip and not args.smoke:
        bench_sharing(results, args.child_timeout)
    device, big, small = ("cpu", "llama-tiny", "llama-tiny") if args.smoke else ("cuda", "llama-3.1-8b", "llama-3.2-1b")
    results["device"] = "cpu (smoke run)" if args.smoke else torch.cuda.get_device_name(0)
    results["torch"] = torch.__version__
    results["ceilings"] = ceil = ({"h2d_pinned_GBps": 10.0, "d2h_pinned_GBps": 10.0, "hbm_copy_GBps": 50.0}
                                  if args.smoke else ceilings(torch.device("cuda")))
    log(f"[ceil] {results['device']}: " + ", ".join(f"{k} {v:.1f}" for k, v in ceil.items()))
    def save():
        with open(os.path.join(args.out, "bench_streams.json"), "w") as f:
            json.dump(results, f, indent=1)
    save()
    for part, fn in (("offload", lambda: bench_offload(results, ceil, args.out, args.offload_steps, 2, big, device)),
                     ("overlap", lambda: bench_overlap(results, args.steps, args.repeats, small, device))):
        if part in skip:
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:      # noqa: BLE001  (one part failing must not lose the others)
            import traceback
            traceback.print_exc()
            results[part] = {"error": f"{type(e).__name__}: {e}"}
            free_memory()
        results.setdefault("seconds", {})[part] = time.perf_counter() - t
        save()
    results.setdefault("seconds", {})["total"] = time.perf_counter() - t_all
    save()
    summary(results)


def summary(r):
    log(f"\n## {r['device']}, torch {r['torch']}, {r['date']}, commit {r['commit']}")
    c = r["ceilings"]
    log(f"ceilings: pinned H2D {c['h2d_pinned_GBps']:.1f} GB/s, pinned D2H {c['d2h_pinned_GBps']:.1f} GB/s, "
        f"HBM copy {c['hbm_copy_GBps']:.0f} GB/s")
    ov = r.get("overlap")
    if isinstance(ov, list):
        log(f"\n(a) llama-3.2-1b decode, CUDA graphs on (pipelined engine code present: {r.get('pipelined_engine')})")
        log("| batch | overlap | ms / step | host ms / step | tok/s | runs (ms / step) |")
        log("| ---: | --- | ---: | ---: | ---: | --- |")
        for x in sorted(ov, key=lambda x: (x["batch"], not x["overlap"])):
            log(f"| {x['batch']} | {'on' if x['overlap'] else 'off'} | {x['step_ms']:.3f} | {x['host_ms']:.3f} | "
                f"{x['tok_s']:.0f} | {', '.join(f'{v:.3f}' for v in x['step_ms_runs'])} |")
    elif ov:
        log(f"\n(a) failed: {ov}")
    off = r.get("offload")
    if off and "rows" in off:
        log(f"\n(b) {off['model']} offload: {off['streamed_layers']} of {off['num_layers']} layers streamed, "
            f"{off['bytes_per_token'] / 1e9:.2f} GB per token; ceiling {off['ceiling_tok_s']:.2f} tok/s at "
            f"{off['h2d_GBps']:.1f} GB/s pinned H2D; peak allocated {off['peak_allocated_GB']:.1f} GB")
        log("| prefetch | tok/s (batch 1) | % of H2D ceiling | ms / step | streamed GB/s | runs (tok/s) |")
        log("| --- | ---: | ---: | ---: | ---: | --- |")
        for x in off["rows"]:
            log(f"| {'on' if x['prefetch'] else 'off'} | {x['tok_s']:.2f} | {x['pct_of_ceiling']:.0f}% | "
                f"{x['step_ms']:.1f} | {x['achieved_h2d_GBps']:.1f} | {', '.join(f'{v:.2f}' for v in x['tok_s_runs'])} |")
    elif off:
        log(f"\n(b) failed: {off}")
    tr = r.get("trace")
    if tr:
        log(f"\n(c) trace: {tr}")
    if r.get("allocators"):
        log("\n(d) allocators")
        log("| allocator | release | MLP varying: median / mean / max ms | growing: median / max ms | "
            "engine graphs off: tok/s, ms/step | engine graphs on |")
        log("| --- | --- | --- | --- | --- | --- |")
        for x in r["allocators"]:
            parts = {p["part"] + ("" if p["part"] == "mlp" else str(p["cuda_graphs"])): p for p in x["parts"]}
            m = parts.get("mlp")
            mlp = (f"{m['varying']['median_ms']:.3f} / {m['varying']['mean_ms']:.3f} / {m['varying']['max_ms']:.2f}"
                   if m else "–")
            grow = f"{m['growing']['median_ms']:.3f} / {m['growing']['max_ms']:.2f}" if m else "–"

            def eng(p, x=x):
                if p is None:
                    return f"missing (exit {x['exit']})"
                if "error" in p:
                    return p["error"][:120]
                return (f"{p['tok_s']:.0f}, {p['step_ms']:.3f}" +
                        ("" if p["graphs_captured"] == p["cuda_graphs"] else " (capture failed: eager)"))
            log(f"| {x['backend']} | {x['release']} | {mlp} | {grow} | {eng(parts.get('engineFalse'))} | "
                f"{eng(parts.get('engineTrue'))} |")
    if r.get("sharing"):
        log("\n(e) two engines on one GPU (llama-3.1-8b shapes each)")
        log("| allocator | release | first engine idle: device used / pool GB | second: free at start GB | "
            "its KV cache GB | load s | first / second step ms |")
        log("| --- | --- | --- | ---: | ---: | ---: | --- |")
        for x in r["sharing"]:
            f, g = x["first"], x.get("second", {})
            if "error" in f or "error" in g or not g:
                log(f"| {x['backend']} | {x['release']} | failed | | | | |")
                continue
            log(f"| {x['backend']} | {x['release']} | {f['device_used_idle_GB']:.2f} / {f['reserved_idle_GB']:.2f} | "
                f"{g['free_at_start_GB']:.2f} | {g['kv_GB']:.2f} | {g['load_s']:.1f} | "
                f"{g['first_step_ms']:.1f} / {g['second_step_ms']:.1f} |")
    log(f"\nseconds: {r.get('seconds')}")


if __name__ == "__main__":
    main()
