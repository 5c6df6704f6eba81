"""Multi-stream scheduling and stream-ordered memory, measured on one GPU.

    python benchmarks/bench_streams.py --out DIR

1. Layer-weight streaming, Llama-3.1-8B decoder stack (32 layers, bf16, random weights), half the
   layers offloaded to pinned host memory: time per forward with the prefetch overlapped (copy of the
   next streamed layer on the H2D stream while the current layers compute) vs serialised (the same
   copies queued on the compute stream), at 16 decode tokens and at one 8192-token prefill; the
   H2D bytes per forward over that time, as a fraction of the pinned H2D ceiling measured here.
2. Step-input upload, Llama-3.2-1B decoder stack + LM head + argmax, decode at batch 1 and 64 over a
   paged KV cache: time per step with the inputs uploaded from pageable memory (blocking), the way
   engine/batch.py does now (pinned temporaries, copies on the compute stream), from the pinned
   ring on the H2D stream, and the ring with the sampled tokens read back one step late
   (TokenReadback; the next decode's token ids come from the device). All four must produce the
   same tokens.
3. Allocators: the native caching allocator vs cudaMallocAsync (release threshold dedicated /
   shared), each in its own process: per-step host time of an MLP whose batch grows, then varies,
   every step (every activation is a fresh allocation of a new size), with a host sync per step as
   the engine's token read does.
4. torch.profiler traces of (1) and (2), turned into timeline PNGs (one row per stream).

Ceilings measured in the same run: pinned H2D and D2H copy bandwidth (1 GiB), HBM copy (2 GiB).
"""
from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = __file__.rsplit("/benchmarks/", 1)[0]
sys.path.insert(0, ROOT)


def log(*a):
    print(*a, flush=True)


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


# ----------------------------------------------------------------------------- ceilings

def ceilings(dev):
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


# ----------------------------------------------------------------------------- batches

def decode_batch(num_seqs, ctx, kv, dev, ids=None):
    from engine.batch import Batch
    bs = kv.block_size
    per_seq = (ctx + bs - 1) // bs
    tables = torch.arange(num_seqs * per_seq, dtype=torch.int32).view(num_seqs, per_seq)
    slots = tables[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs
    ids = torch.randint(0, 1000, (num_seqs,)) if ids is None else ids
    ctx_t = torch.full((num_seqs,), ctx, dtype=torch.int32)
    return Batch(input_ids=ids.to(dev), positions=torch.full((num_seqs,), ctx - 1, device=dev),
                 slot_mapping=slots.to(dev), kv_cache=kv, num_prefills=0, num_prefill_tokens=0,
                 prefill_offsets=torch.zeros(1, dtype=torch.int64, device=dev),
                 prefill_context_lens=ctx_t[:0].to(dev), prefill_block_tables=tables[:0].to(dev),
                 prefill_has_prefix=False, num_decodes=num_seqs, decode_context_lens=ctx_t.to(dev),
                 decode_block_tables=tables.to(dev), logits_indices=torch.arange(num_seqs, device=dev),
                 sampled=[])


def make_layers(cfg, dev, seed):
    from torch import nn

    from models.llama import LlamaDecoderLayer
    torch.manual_seed(seed)
    layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, dev, torch.bfloat16) for i in range(cfg.num_layers))
    with torch.no_grad():
        for name, p in layers.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, p.shape[1] ** -0.5)
    return layers


def kv_cache(cfg, num_tokens, dev):
    from engine.memory.kv_cache import KVCache
    kv = KVCache(cfg.num_layers, num_tokens // 16, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, dev)
    kv.k.normal_()
    kv.v.normal_()
    return kv


def run_stack(layers, x, batch, inv_freq):
    residual = None
    for layer in layers:
        x, residual = layer(x, residual, batch.positions, batch, inv_freq)
    return x + residual


# ----------------------------------------------------------------------------- 1. weight streaming

def bench_offload(dev, ceil, out_dir, results):
    from engine.batch import build_prefill_only
    from engine.kernels.rope import rope_inv_freq
    from engine.streams import LayerStreamer, StepStreams, layer_stream_bytes, plan_offload
    from models.presets import SHAPE_PRESETS
    cfg = SHAPE_PRESETS["llama-3.1-8b"]
    layers = make_layers(cfg, dev, 0)
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(dev)
    kv = kv_cache(cfg, 16 * 256, dev)
    cases = {"decode 16 tok": (decode_batch(16, 256, kv, dev), 16),
             "prefill 8192 tok": (build_prefill_only([list(range(8192))], dev), 8192)}
    xs = {k: torch.randn(t, cfg.hidden_size, device=dev, dtype=torch.bfloat16) for k, (_, t) in cases.items()}
    sizes = [layer_stream_bytes(layer) for layer in layers]
    layer_bytes = sizes[0]
    plan = plan_offload(sizes, 0, (len(sizes) // 2 + 2) * layer_bytes, 0)   # half the layers + 2 buffers
    log(f"[offload] layer {layer_bytes / 1e6:.1f} MB; streamed {len(plan.offloaded_layers)} of "
        f"{len(sizes)}: {plan.offloaded_layers}")
    s = StepStreams(dev)
    resident, refs = {}, {}
    with torch.inference_mode(), s.on(s.compute):
        for k, (batch, _) in cases.items():
            refs[k] = run_stack(layers, xs[k], batch, inv_freq).float()
            resident[k] = event_ms(lambda: run_stack(layers, xs[k], batch, inv_freq), 5, s.compute)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    streamer = LayerStreamer(layers, plan, s)
    torch.cuda.empty_cache()
    results["offload_device_bytes_saved"] = saved = before - torch.cuda.memory_allocated(dev)
    log(f"[offload] device memory: {saved / 1e9:.2f} GB freed ({len(plan.offloaded_layers)} layers out, "
        "2 buffers in)")
    serial = StepStreams(dev)
    serial.h2d = serial.compute            # the same copies, queued in line with the compute
    rows = []
    for k, (batch, _) in cases.items():
        for mode, streams in (("prefetch", s), ("serial", serial)):
            streamer.streams = streams
            with torch.inference_mode(), streams.on(streams.compute):
                out = run_stack(layers, xs[k], batch, inv_freq).float()
                torch.cuda.synchronize()
                err = ((out - refs[k]).norm() / refs[k].norm()).item()
                before = streamer.copied_bytes
                iters = 5
                ms = event_ms(lambda: run_stack(layers, xs[k], batch, inv_freq), iters, streams.compute)
                per_fwd = (streamer.copied_bytes - before) / (iters + 2)
            gbps = per_fwd / ms / 1e6
            rows.append({"case": k, "mode": mode, "ms": ms, "resident_ms": resident[k],
                         "copy_GB": per_fwd / 1e9, "GBps": gbps, "pct_h2d": 100 * gbps / ceil["h2d_pinned_GBps"],
                         "copy_floor_ms": per_fwd / ceil["h2d_pinned_GBps"] / 1e6, "rel_err": err})
            log(f"[offload] {k:17s} {mode:8s} {ms:8.2f} ms  resident {resident[k]:7.2f} ms  "
                f"{gbps:6.1f} GB/s ({rows[-1]['pct_h2d']:.0f}% of H2D)  rel err {err:.1e}")
    streamer.streams = s
    results["offload"] = rows
    # trace: one prefill forward with the prefetch
    batch = cases["prefill 8192 tok"][0]
    with torch.inference_mode(), s.on(s.compute):
        trace(lambda: run_stack(layers, xs["prefill 8192 tok"], batch, inv_freq), out_dir,
              "offload_8b_prefill8192", "Llama-3.1-8B stack, 16 of 32 layers streamed, 8192-token prefill")


# ----------------------------------------------------------------------------- 2. step-input upload

def bench_upload(dev, out_dir, results):
    from engine.kernels.rope import rope_inv_freq
    from engine.memory.host_ring import PinnedRing
    from engine.streams import StepStreams, TokenReadback
    from models.presets import SHAPE_PRESETS
    cfg = SHAPE_PRESETS["llama-3.2-1b"]
    layers = make_layers(cfg, dev, 1)
    from models.llama import RMSNorm
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dev, torch.bfloat16)
    torch.manual_seed(2)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(dev)
    max_seqs, max_ctx, steps, bs = 64, 512, 60, 16
    per_seq = max_ctx // bs
    kv = kv_cache(cfg, max_seqs * max_ctx, dev)
    kv_init = (kv.k.clone(), kv.v.clone())
    s = StepStreams(dev)
    ring = PinnedRing(3, 1 << 16, s)
    readback = TokenReadback(s, num_slots=2)
    from engine.batch import Batch

    def host_inputs(num_seqs, step, ids):
        ctx = 200 + step
        tables = [[q * per_seq + j for j in range(per_seq)] for q in range(num_seqs)]
        return {"input_ids": ids, "positions": [ctx - 1] * num_seqs,
                "slot_mapping": [t[(ctx - 1) // bs] * bs + (ctx - 1) % bs for t in tables],
                "block_tables": tables, "context_lens": [ctx] * num_seqs,
                "logits_indices": list(range(num_seqs))}

    dtypes = {"input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
              "block_tables": torch.int32, "context_lens": torch.int32, "logits_indices": torch.int64}

    def forward(d, num_seqs):
        b = Batch(input_ids=d["input_ids"], positions=d["positions"], slot_mapping=d["slot_mapping"],
                  kv_cache=kv, num_prefills=0, num_prefill_tokens=0, prefill_offsets=d["logits_indices"][:1],
                  prefill_context_lens=d["context_lens"][:0],
                  prefill_block_tables=d["block_tables"][:0], prefill_has_prefix=False,
                  num_decodes=num_seqs, decode_context_lens=d["context_lens"],
                  decode_block_tables=d["block_tables"], logits_indices=d["logits_indices"], sampled=[])
        x = torch.nn.functional.embedding(d["input_ids"], embed)
        h = run_stack(layers, x, b, inv_freq)
        h = norm(h)
        return torch.argmax(h.index_select(0, d["logits_indices"]) @ embed.t(), dim=-1)

    def run(mode, num_seqs, n_steps):
        kv.k.copy_(kv_init[0])
        kv.v.copy_(kv_init[1])
        torch.cuda.synchronize()
        ids = list(range(1, num_seqs + 1))
        out_tokens, pending, prev_dev = [], None, None
        t0 = time.perf_counter()
        with torch.inference_mode(), s.on(s.compute):
            for step in range(n_steps):
                inp = host_inputs(num_seqs, step, ids)
                if mode == "pageable":
                    d = {k: torch.tensor(v, dtype=dtypes[k], device=dev) for k, v in inp.items()}
                elif mode == "pinned same stream":
                    d = {k: torch.tensor(v, dtype=dtypes[k], pin_memory=True).to(dev, non_blocking=True)
                         for k, v in inp.items()}
                else:
                    slot = ring.acquire()
                    for k, v in inp.items():
                        if not (mode == "ring + async readback" and k == "input_ids" and prev_dev is not None):
                            slot.put(k, v, dtypes[k])
                    d = ring.upload(slot)
                    if "input_ids" not in d:
                        d["input_ids"] = prev_dev
                tokens = forward(d, num_seqs)
                if mode == "ring + async readback":
                    ring.release(slot)
                    ticket = readback.send(tokens)
                    prev_dev = tokens
                    if pending is not None:
                        out_tokens.append(pending.result().tolist())
                    pending = ticket
                    continue
                if mode == "ring":
                    ring.release(slot)
                ids = tokens.tolist()
                out_tokens.append(ids)
            if pending is not None:
                out_tokens.append(pending.result().tolist())
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n_steps * 1e3, out_tokens

    modes = ("pageable", "pinned same stream", "ring", "ring + async readback")
    rows = []
    for num_seqs in (1, 64):
        base_tokens = None
        for mode in modes:
            run(mode, num_seqs, 8)            # warm-up: kernels, pinned buffers, device twins
            ms_runs = []
            for _ in range(3):
                ms, toks = run(mode, num_seqs, steps)
                ms_runs.append(ms)
            base_tokens = base_tokens or toks
            same = toks == base_tokens
            rows.append({"batch": num_seqs, "mode": mode, "ms_per_step": statistics.median(ms_runs),
                         "spread_ms": max(ms_runs) - min(ms_runs), "same_tokens": same})
            log(f"[upload] batch {num_seqs:3d} {mode:22s} {rows[-1]['ms_per_step']:7.3f} ms/step "
                f"(spread {rows[-1]['spread_ms']:.3f})  same tokens as pageable: {same}")
    results["upload"] = rows
    results["upload_ring_host_waits"] = ring.host_waits
    trace(lambda: run("ring + async readback", 64, 6), out_dir, "step_pipeline_1b_b64",
          "Llama-3.2-1B decode steps, batch 64: ring upload + async token readback")


# ----------------------------------------------------------------------------- 3. allocators

def alloc_child(backend, release):
    from engine.memory import allocator
    allocator.configure_allocator(backend, release)
    dev = torch.device("cuda")
    allocator.apply_release(dev)
    assert allocator.allocator_backend() == backend
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
    out = {"backend": backend, "release": release}
    for phase, sizes in (("growing", growing), ("varying", varying)):
        times = []
        for m in sizes:
            t = time.perf_counter()
            step(m)
            times.append((time.perf_counter() - t) * 1e3)
        out[phase] = {"median_ms": statistics.median(times), "mean_ms": statistics.mean(times),
                      "max_ms": max(times), "total_ms": sum(times)}
    out["reserved_GB"] = torch.cuda.memory_reserved() / 1e9 if backend == "native" else _pool_reserved(dev)
    print("RESULT " + json.dumps(out), flush=True)


def _pool_reserved(dev):
    from cuda.bindings import runtime as cudart
    err, pool = cudart.cudaDeviceGetDefaultMemPool(dev.index or 0)
    err, value = cudart.cudaMemPoolGetAttribute(pool, cudart.cudaMemPoolAttr.cudaMemPoolAttrReservedMemCurrent)
    return int(value) / 1e9


def bench_allocators(results):
    rows = []
    for backend, release in (("native", "dedicated"), ("cudaMallocAsync", "dedicated"),
                             ("cudaMallocAsync", "shared")):
        # torch reads the variable when it loads: the child starts with it set
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        env["PYTORCH_ALLOC_CONF"] = f"backend:{backend}"
        p = subprocess.run([sys.executable, __file__, "--alloc-child", backend, release],
                           capture_output=True, text=True, env=env, cwd=ROOT)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not line:
            log(f"[alloc] {backend} {release} FAILED:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
            continue
        r = json.loads(line[0][7:])
        rows.append(r)
        log(f"[alloc] {backend:16s} {release:9s} growing: median {r['growing']['median_ms']:.3f} "
            f"max {r['growing']['max_ms']:.2f} total {r['growing']['total_ms']:.1f} ms | varying: median "
            f"{r['varying']['median_ms']:.3f} mean {r['varying']['mean_ms']:.3f} max {r['varying']['max_ms']:.2f} ms"
            f" | reserved {r['reserved_GB']:.2f} GB")
    results["allocators"] = rows


# ----------------------------------------------------------------------------- 4. traces

def trace(fn, out_dir, name, title):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"{name}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    with gzip.open(path + ".gz", "wt") as f:
        json.dump({"traceEvents": [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]}, f)
    os.remove(path)
    timeline_png(events, os.path.join(out_dir, f"{name}.png"), title)


def timeline_png(events, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        log(f"[trace] no GPU events for {path}")
        return
    t0 = min(e["ts"] for e in gpu)
    streams = {}
    for e in gpu:
        streams.setdefault(e.get("args", {}).get("stream", -1), []).append(e)

    def kind(e):
        n = e["name"]
        if "HtoD" in n:
            return "H2D copy"
        if "DtoH" in n:
            return "D2H copy"
        return "memcpy/memset" if e["cat"] != "kernel" else "kernel"

    colors = {"kernel": "tab:blue", "H2D copy": "tab:orange", "D2H copy": "tab:green", "memcpy/memset": "tab:gray"}
    order = sorted(streams, key=lambda k: -len(streams[k]))
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.8 * len(order)))
    labels = []
    for row, sid in enumerate(order):
        evs = streams[sid]
        kinds = [kind(e) for e in evs]
        main = max(set(kinds), key=kinds.count)
        busy = sum(e["dur"] for e in evs) / 1e3
        plural = {"kernel": "kernels", "H2D copy": "H2D copies", "D2H copy": "D2H copies"}.get(main, main)
        labels.append(f"stream {sid}\n{plural}, busy {busy:.1f} ms")
        for k in colors:
            bars = [((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 1e-3)) for e, kk in zip(evs, kinds) if kk == k]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=colors[k], label=k)
    handles, names = ax.get_legend_handles_labels()
    uniq = dict(zip(names, handles))
    ax.legend(uniq.values(), uniq.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_yticks(range(len(order)), labels, fontsize=8)
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"[trace] wrote {path}")


# ----------------------------------------------------------------------------- main

def free_memory():
    gc.collect()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_streams"))
    ap.add_argument("--alloc-child", nargs=2, metavar=("BACKEND", "RELEASE"))
    ap.add_argument("--skip", default="", help="comma list of parts to skip: offload,upload,alloc")
    args = ap.parse_args()
    if args.alloc_child:
        alloc_child(*args.alloc_child)
        return
    os.makedirs(args.out, exist_ok=True)
    skip = set(args.skip.split(","))
    results = {}
    if "alloc" not in skip:        # first: the children need the GPU memory to themselves
        bench_allocators(results)
    dev = torch.device("cuda")
    results["device"] = torch.cuda.get_device_name(dev)
    results["torch"] = torch.__version__
    results["ceilings"] = ceil = ceilings(dev)
    log(f"[ceil] {results['device']}: " + ", ".join(f"{k} {v:.1f}" for k, v in ceil.items()))
    if "offload" not in skip:
        bench_offload(dev, ceil, args.out, results)
        free_memory()        # the streamer's hooks hold the layers in a reference cycle
    if "upload" not in skip:
        bench_upload(dev, args.out, results)
    with open(os.path.join(args.out, "bench_streams.json"), "w") as f:
        json.dump(results, f, indent=1)
    summary(results)


def summary(r):
    log(f"\n## {r['device']}, torch {r['torch']}")
    c = r["ceilings"]
    log(f"ceilings: pinned H2D {c['h2d_pinned_GBps']:.1f} GB/s, pinned D2H {c['d2h_pinned_GBps']:.1f} GB/s, "
        f"HBM copy {c['hbm_copy_GBps']:.0f} GB/s")
    if "offload" in r:
        log(f"offload: {r['offload_device_bytes_saved'] / 1e9:.2f} GB of device memory freed")
        log("\n| case | mode | ms / forward | all-resident ms | H2D GB / fwd | GB/s | % of H2D ceiling | rel err vs resident |")
        log("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for x in r["offload"]:
            log(f"| {x['case']} | {x['mode']} | {x['ms']:.2f} | {x['resident_ms']:.2f} | {x['copy_GB']:.2f} | "
                f"{x['GBps']:.1f} | {x['pct_h2d']:.0f}% | {x['rel_err']:.1e} |")
    if "upload" in r:
        log("\n| batch | inputs | ms / step | spread | same tokens |")
        log("| ---: | --- | ---: | ---: | --- |")
        for x in r["upload"]:
            log(f"| {x['batch']} | {x['mode']} | {x['ms_per_step']:.3f} | {x['spread_ms']:.3f} | {x['same_tokens']} |")
    if r.get("allocators"):
        log("\n| allocator | release | growing: median / max / total ms | varying: median / mean / max ms | reserved GB |")
        log("| --- | --- | --- | --- | ---: |")
        for x in r["allocators"]:
            g, v = x["growing"], x["varying"]
            log(f"| {x['backend']} | {x['release']} | {g['median_ms']:.3f} / {g['max_ms']:.2f} / {g['total_ms']:.1f} | "
                f"{v['median_ms']:.3f} / {v['mean_ms']:.3f} / {v['max_ms']:.2f} | {x['reserved_GB']:.2f} |")


if __name__ == "__main__":
    main()
