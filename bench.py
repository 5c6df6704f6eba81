"""bench.py: tokens/sec of each technique against this engine's dense baseline and HF transformers.

    python bench.py --model llama-3.1-8b            # the GPU run behind BENCHMARKS.md
    python bench.py --quick                         # tiny shapes on the CPU: proves the harness runs

One process, one run: the dense bf16 baseline, each technique alone and combined, pipelined steps
switched off, and HF transformers generate; for each, prefill tokens/sec, decode tokens/sec at several
batch sizes, throughput on a set of requests of random lengths (the same requests for the engine and
for HF), peak memory and decode as a % of the HBM roofline measured in the same run. A quality column
(perplexity of the embedded SmolLM2 on a fixed text) sits next to the speed, and every configuration's
logits are checked against the dense baseline before it is timed.

HF generate batches statically: its throughput row runs the same requests in fixed batches (sorted by
output length, left-padded, each batch generating its longest request's output length, EOS unable to
stop it early) and counts only each request's own output tokens as useful; --hf-time-limit cuts it
after the batch that crosses the limit, and the row then says so.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import statistics
import sys
import time

import torch
from tqdm import tqdm

from engine.config import LM_HEAD_FORMATS, EngineConfig, resolve_dtype
from engine.engine import Engine
from engine.kernels.platform import capture
from engine.memory import allocator
from engine.sampling import SamplingParams

# name -> EngineConfig overrides; "lossless" configs must reproduce the dense logits up to rounding.
CONFIGS = {
    "dense":        ({}, True),
    "fused-off":    ({"fused_kernels": False}, True),
    "fp8":          ({"weights": "fp8"}, False),
    "nvfp4":        ({"weights": "nvfp4"}, False),
    "2:4":          ({"sparse_ffn": "magnitude"}, False),
    "2:4+fp8":      ({"sparse_ffn": "magnitude", "weights": "fp8"}, False),
    "kv-fp8":       ({"kv_cache_dtype": "fp8"}, False),
    "fp8+kv-fp8":   ({"weights": "fp8", "kv_cache_dtype": "fp8"}, False),
    "nvfp4+kv-fp8": ({"weights": "nvfp4", "kv_cache_dtype": "fp8"}, False),
    "2:4+fp8+kv-fp8": ({"sparse_ffn": "magnitude", "weights": "fp8", "kv_cache_dtype": "fp8"}, False),
    "overlap-off":  ({"overlap": False}, True),
}
GEMM_SWITCHES = ("weights", "sparse_ffn")     # configs that change the GEMMs get roofline points
THROUGHPUT_SEED = 1                           # the throughput requests' own RNG: same for engine and HF
QUALITY = {"dense": {}, "fp8": {"weights": "fp8"}, "nvfp4": {"weights": "nvfp4"},
           "2:4 magnitude": {"sparse_ffn": "magnitude"}, "2:4 wanda": {"sparse_ffn": "wanda"},
           "2:4+fp8": {"sparse_ffn": "magnitude", "weights": "fp8"}}
QUALITY_HEADS = "fp8,nvfp4"     # LM-head formats measured beside each QUALITY row's bf16 head
# KV-cache formats: their logits computed through the paged cache, QUALITY_CACHE_CHUNK tokens a step
# (LLM.logits), where the other rows' come from one pass that keeps no cache; the first row is the
# control (the cache in the model dtype: the same logits as one pass, up to rounding).
QUALITY_KV = {"dense, KV cache in the model dtype": {}, "dense, fp8 KV cache": {"kv_cache_dtype": "fp8"}}
QUALITY_CACHE_CHUNK = 16
# Numerics of a GPU path the CPU's reference does not take, emulated on the CPU (a row each).
QUALITY_EMULATED = {"nvfp4, every GEMM past 128 tokens as sm_90 runs it (FP8)": {"weights": "nvfp4"}}
# Relative logit error a lossless switch may cause by rounding alone, per decoder layer: two roundings
# of the same math drift apart layer by layer (measured: the dense llama-3.2-1b preset in bf16 against
# fp32 on the CPU, 0.026 over 16 layers, 1.6e-3 a layer).
LOSSLESS_TOLERANCE_PER_LAYER = {"bf16": 2e-3, "fp16": 5e-4, "fp32": 1e-5}
GUARD_PROMPT = "The quick brown fox jumps over the lazy dog. In the beginning"
GUARD_CHUNK = 16


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device) -> float:
    """Device-to-device copy in bytes/s, counting bytes read plus bytes written."""
    if device.type != "cuda":
        return float("nan")
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n / sorted(times)[len(times) // 2]


def measure_matmul_peak(device, dtype=torch.bfloat16) -> float:
    """cuBLAS FLOP/s on an 8192^3 product of random data (fp8: torch._scaled_mm, e4m3)."""
    if device.type != "cuda":
        return float("nan")
    n = 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    if dtype == torch.float8_e4m3fn:
        one = torch.ones((), device=device)
        bt = b.t()   # _scaled_mm wants its second operand column-major

        def mm():
            return torch._scaled_mm(a, bt, one, one, out_dtype=torch.bfloat16)
    else:
        def mm():
            return a @ b
    for _ in range(3):
        mm()
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        mm()
    sync(device)
    return 2 * n ** 3 * 10 / (time.perf_counter() - t)


def run_to_completion(engine: Engine, requests, step_hosts: list | None = None) -> list[list[int]]:
    """Each request's tokens. step_hosts: gets the host seconds of every step that queued work (the
    last call only hands out tokens)."""
    outs: dict[str, list[int]] = {}
    for rid, ids, params in requests:
        outs[rid] = []
        engine.add_request(rid, ids, params, lambda c, o=outs[rid]: o.extend(c.token_ids))
    while engine.has_work():
        host = engine.stats["host_s"]
        if engine.step() and step_hosts is not None:
            step_hosts.append(engine.stats["host_s"] - host)
    return [outs[rid] for rid, _, _ in requests]


def random_prompt(rng, n, vocab):
    return [rng.randrange(100, vocab) for _ in range(n)]


def bench_prefill(engine, rng, vocab, num, length, passes=3):
    """Prefill tokens/sec, from the pass of median time among `passes` (one pass alone moved by up
    to 30% between calls on the same code), and host seconds per step: the median over every step
    of the timed passes that queued work (a pass has only a few steps, whose mean moved by several
    milliseconds between calls)."""
    def reqs(tag):
        return [(f"{tag}{i}", random_prompt(rng, length, vocab), SamplingParams(max_tokens=1, detokenize=False))
                for i in range(num)]
    # Warm-up pass: kernel compilation, autotuning and sparse-algorithm searches happen on first use.
    run_to_completion(engine, reqs("w"))
    times, step_hosts = [], []
    for p in range(passes):
        batch = reqs(f"p{p}_")
        sync(engine.device)
        t = time.perf_counter()
        run_to_completion(engine, batch, step_hosts)
        sync(engine.device)
        times.append(time.perf_counter() - t)
    return num * length / statistics.median(times), statistics.median(step_hosts)


def bench_decode(engine, rng, vocab, batch, prompt_len, steps):
    """Decode tokens/sec with `batch` sequences all decoding: time `steps` steps after their prefill."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True, detokenize=False)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", random_prompt(rng, prompt_len, vocab), params, lambda c: None)
    while any(not r.seq.output_ids for r in engine.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()                           # warm-up (and CUDA graph capture, if any)
    sync(engine.device)
    host_before = engine.stats["host_s"]
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    elapsed = time.perf_counter() - t
    host = (engine.stats["host_s"] - host_before) / steps
    for rid in list(engine.requests):
        engine.abort(rid)
    return batch * steps / elapsed, elapsed / steps, host


def throughput_requests(args, vocab) -> list[tuple[list[int], int]]:
    """The throughput test's requests: (prompt ids, output length), both lengths uniform in
    min_len..max_len, from their own RNG so the engine's configs and HF get the very same ones."""
    rng = random.Random(THROUGHPUT_SEED)
    reqs = []
    for _ in range(args.requests):
        n_in, n_out = rng.randint(args.min_len, args.max_len), rng.randint(args.min_len, args.max_len)
        reqs.append((random_prompt(rng, n_in, vocab), n_out))
    return reqs


def bench_throughput(engine, requests):
    def params(n):
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
    # Warm-up on the same prompt lengths (other tokens, so the prefix cache cannot serve the timed
    # run) and short outputs: steps mixing 1..256 prefill chunks with decodes compile their kernel
    # variants here, not in the timed run (the first configuration would pay them all).
    run_to_completion(engine, [(f"w{i}", [100 + (t * 7 + 13) % 49000 for t in ids], params(min(n_out, 16)))
                               for i, (ids, n_out) in enumerate(requests)])
    reqs = [(f"t{i}", ids, params(n_out)) for i, (ids, n_out) in enumerate(requests)]
    sync(engine.device)
    before = engine.metrics()
    t = time.perf_counter()
    outs = run_to_completion(engine, reqs)
    sync(engine.device)
    elapsed = time.perf_counter() - t
    after = engine.metrics()
    # Preempted sequences are recomputed later (engine/scheduler.py): work done twice.
    return {"throughput_tok_s": sum(len(o) for o in outs) / elapsed,
            "throughput_steps": after["steps"] - before["steps"],
            "throughput_preemptions": after["preemptions"] - before["preemptions"]}


def weight_bytes(engine) -> int:
    model = engine.model
    total = sum(lin.backend.weight_bytes() for _, lin in model.linear_layers())
    head = model.embed_tokens.weight.nbytes if model.lm_head is None else model.lm_head.backend.weight_bytes()
    return total + head


def time_fn(fn, device, reps=20) -> float:
    """Median seconds per call. On the GPU: replays of a CUDA graph of `reps` calls, each after a
    write of 256 MB that evicts the weights from L2, minus the same graph of writes alone; so
    neither launch overhead nor a warm L2 flatters small-M GEMMs."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]
    flush = torch.empty(1 << 28, dtype=torch.uint8, device=device)

    def graph_of(body):
        g = torch.cuda.CUDAGraph()
        with capture(g):      # (Triton kernels under either allocator)
            for _ in range(reps):
                body()
        return g

    def median_replay(g):
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return sorted(times)[2]

    try:
        both = graph_of(lambda: (flush.fill_(1), fn()))
    except RuntimeError:    # not capturable: one eager call between events, launch included
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    flush_only = graph_of(lambda: flush.fill_(1))
    return max(median_replay(both) - median_replay(flush_only), 0.0) / reps


def gemm_points(engine, name, ms) -> list[dict]:
    """Each GEMM of the first decoder layer, and the LM head, at several M: arithmetic intensity and
    FLOP/s."""
    points = []
    layer = engine.model.layers[0]
    gemms = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
             "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}
    if engine.model.lm_head is not None:    # a tied bf16 head is the embedding table, no Linear
        gemms["lm_head"] = engine.model.lm_head
    act_bytes = torch.empty(0, dtype=engine.dtype).element_size()
    for gname, lin in gemms.items():
        for m in ms:
            x = torch.randn(m, lin.in_features, device=engine.device, dtype=engine.dtype)
            with torch.inference_mode():
                secs = time_fn(lambda lin=lin, x=x: lin(x), engine.device)
            flops = 2 * m * lin.in_features * lin.out_features
            nbytes = lin.backend.weight_bytes() + m * (lin.in_features + lin.out_features) * act_bytes
            points.append({"config": name, "gemm": gname, "M": m, "seconds": secs,
                           "intensity": flops / nbytes, "flops_per_s": flops / secs})
    return points


def bench_config(name, overrides, args, device, shared):
    rng = random.Random(0)
    cfg = EngineConfig(model=args.model, device=str(device), dtype=args.dtype, seed=0,
                       max_num_batched_tokens=args.step_tokens, kv_cache_tokens=args.kv_tokens,
                       **{**args.engine_overrides, **overrides})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = Engine(cfg)
    vocab = min(engine.model_config.vocab_size, 49152)
    row = {"config": name, "num_layers": engine.model_config.num_layers}
    guard_ids = engine.tokenizer.encode(GUARD_PROMPT, add_special_tokens=False)
    guard = run_to_completion(engine, [("guard", guard_ids, SamplingParams(
        max_tokens=args.guard_tokens, temperature=0, ignore_eos=True, detokenize=False))])[0]
    # Random weights give near-flat logits, so greedy tokens diverge under any rounding change; the
    # logits compared by relative error are the sharper guard. They are taken over the same tokens
    # for every configuration (the prompt and dense's continuation): past the first token where two
    # continuations differ, their own logits would describe different sequences. They come through
    # the paged KV cache, GUARD_CHUNK tokens a step, so a KV-cache format is guarded too (one pass
    # without the cache with tensor parallelism, where the other ranks would need those steps).
    ref, ref_logits = shared.get("dense", (guard, None))
    with torch.inference_mode():
        ids = guard_ids + ref
        logits = (engine.cached_logits(ids, GUARD_CHUNK) if engine.tp is None else engine.sequence_logits(ids)).cpu()
    if ref_logits is not None:
        row["agreement"] = sum(a == b for a, b in zip(guard, ref)) / len(ref)
        row["logits_rel_err"] = ((logits - ref_logits).norm() / ref_logits.norm()).item()
    else:
        shared["dense"] = guard, logits
        row["agreement"], row["logits_rel_err"] = 1.0, 0.0
    if args.guard_only:
        engine.close()
        del engine
        _release_device(device)
        return row
    row["prefill_tok_s"], prefill_host = bench_prefill(engine, rng, vocab, args.prefill_seqs, args.prefill_len)
    row["prefill_host_ms"] = prefill_host * 1e3
    # Per GPU: with tensor parallelism the weights, KV heads and roofline are one rank's.
    kv_per_token = engine.kv_bytes_per_token()
    wbytes = weight_bytes(engine)
    row["weight_GB"] = wbytes / 1e9
    for b in args.decode_batches:
        tps, step_s, host_s = bench_decode(engine, rng, vocab, b, args.decode_prompt, args.decode_steps)
        row[f"decode_b{b}_tok_s"] = tps
        row[f"decode_b{b}_host_ms"] = host_s * 1e3
        ctx = args.decode_prompt + args.decode_steps // 2
        ideal = (wbytes + b * ctx * kv_per_token) / shared["copy_bw"]
        row[f"decode_b{b}_roofline_pct"] = 100 * ideal / step_s
    row.update(bench_throughput(engine, throughput_requests(args, vocab)))
    if name == "dense" or any(k in overrides for k in GEMM_SWITCHES):   # the others leave the GEMMs alone
        shared.setdefault("points", []).extend(gemm_points(engine, name, args.gemm_ms))
    if device.type == "cuda":
        row["peak_mem_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
    engine.close()      # with tensor parallelism: the other ranks exit
    del engine
    _release_device(device)
    return row


def _release_device(device) -> None:
    """Give an engine's memory back before the next configuration loads."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_hf(args, device, rng_seed=0):
    """HF transformers generate on the same shapes (random weights), bf16, as the outside baseline."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    from models.presets import SHAPE_PRESETS
    c = SHAPE_PRESETS[args.model]
    hf_cfg = HFConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                      rope_scaling=c.rope_scaling, max_position_embeddings=c.max_position_embeddings,
                      tie_word_embeddings=c.tie_word_embeddings)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg).to(dtype).eval()
    rng = random.Random(rng_seed)
    row = {"config": "HF transformers"}
    vocab = min(c.vocab_size, 49152)
    for b in args.decode_batches:
        ids = torch.tensor([random_prompt(rng, args.decode_prompt, 49152) for _ in range(b)], device=device)
        kw = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        sync(device)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=args.decode_steps, min_new_tokens=args.decode_steps, **kw)
        sync(device)
        row[f"decode_b{b}_tok_s"] = b * args.decode_steps / (time.perf_counter() - t)
    ids = torch.tensor([random_prompt(rng, args.prefill_len, 49152) for _ in range(args.prefill_seqs)], device=device)
    with torch.inference_mode():
        model(ids[:1])
        sync(device)
        t = time.perf_counter()
        for i in range(args.prefill_seqs):
            model(ids[i:i + 1], logits_to_keep=1)
        sync(device)
    row["prefill_tok_s"] = args.prefill_seqs * args.prefill_len / (time.perf_counter() - t)
    row.update(hf_throughput(model, throughput_requests(args, vocab), args, device))
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def hf_throughput(model, requests, args, device) -> dict:
    """HF generate on the throughput test's requests. generate() batches statically, so: batches of
    --hf-batch requests grouped by output length (shortest first; knowing the lengths ahead is an
    advantage no real client gives it), prompts left-padded to the batch's longest, and every row
    generating the batch's longest output (min_new_tokens, no EOS: nothing ends early). Useful
    tokens = each request's own output length; the padding rows' extra tokens are not counted."""
    order = sorted(range(len(requests)), key=lambda i: (requests[i][1], len(requests[i][0])))
    batches = [order[i:i + args.hf_batch] for i in range(0, len(order), args.hf_batch)]
    useful = generated = done = 0
    sync(device)
    t = time.perf_counter()
    for idx in batches:
        if time.perf_counter() - t > args.hf_time_limit:
            break
        prompts = [requests[i][0] for i in idx]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        n = max(requests[i][1] for i in idx)
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
        sync(device)
        useful += sum(requests[i][1] for i in idx)
        generated += len(idx) * n
        done += len(idx)
    elapsed = time.perf_counter() - t
    how = (f"static batches of {args.hf_batch} sorted by output length, left-padded; "
           f"{useful} useful of {generated} generated tokens counted")
    out = {"throughput_tok_s": useful / elapsed, "throughput_requests": done,
           "throughput_useful_tokens": useful, "throughput_generated_tokens": generated,
           "throughput_s": elapsed, "throughput_method": how}
    if done < len(requests):
        out["throughput_note"] = (f"cut by --hf-time-limit {args.hf_time_limit:.0f}s: {done} of "
                                  f"{len(requests)} requests (the shortest outputs) in {elapsed:.0f}s; "
                                  f"{how}")
    return out


def quality(args, device):
    """Perplexity of the embedded SmolLM2 under each weight format, with a bf16 LM head and with the
    head in each of --quality-heads; how often its next-token prediction agrees with the dense model's
    (bf16 head, in the model dtype) at every position of the text; and, for a quantised head, with
    the bf16 head over the same weights (the figure engine/config.py's default_lm_head reads). The
    KV-cache rows (QUALITY_KV) read their prefixes through the paged cache."""
    from engine.llm import LLM
    from engine.quality import evaluate, top1_agreement
    rows, reference = {}, None
    # Checkpoints of the embedded model (benchmarks/make_checkpoint.py) load as stored, each its own row;
    # the load-time formats are measured with each LM head too.
    plain = contextlib.nullcontext
    entries = [(name, "llama", overrides, ("bf16", *args.quality_heads), None, plain)
               for name, overrides in QUALITY.items()]
    entries += [(name, "llama", overrides, ("bf16",), QUALITY_CACHE_CHUNK, plain) for name, overrides in QUALITY_KV.items()]
    if device.type == "cpu":
        entries += [(name, "llama", overrides, ("bf16",), None, nvfp4_fp8_path_on_cpu)
                    for name, overrides in QUALITY_EMULATED.items()]
    entries += [(os.path.basename(os.path.normpath(path)), path, {}, ("bf16",), None, plain) for path in args.checkpoint or []]
    for name, model, overrides, heads, cache_chunk, numerics in entries:
        bf16_head = None
        for head in heads:
            label = name if head == "bf16" else f"{name}, {head} head"
            try:
                llm = LLM(model, device=str(device), dtype=args.dtype, **{**overrides, "lm_head": head})
            except (ValueError, NotImplementedError, ImportError) as e:
                rows[label] = f"n/a ({e})"
                continue
            try:
                with numerics():
                    ppl, predictions, agreement = evaluate(llm, args.ppl_window, args.ppl_windows, reference, cache_chunk)
            finally:
                llm.shutdown(timeout=1)
            if reference is None:
                reference, agreement = predictions, 1.0
            rows[label] = {"perplexity": ppl, "top1_agreement": agreement}
            if head == "bf16":
                bf16_head = predictions
            elif bf16_head is not None:
                rows[label]["top1_vs_bf16_head"] = top1_agreement(predictions, bf16_head)
    return rows


@contextlib.contextmanager
def nvfp4_fp8_path_on_cpu():
    """The CPU's NVFP4 GEMM computes what sm_90 with CuTe DSL does: W4A16 up to the decode kernels'
    M; past it the weight decoded to FP8 (`to_fp8`) times x quantised per token, which the norm or
    SwiGLU before writes (input_quant), as sm_90's kernel list says."""
    from engine.formats import nvfp4
    from engine.kernels.select import clear_cache
    table = nvfp4.NVFP4_GEMM["other"]
    nvfp4.NVFP4_GEMM["other"] = nvfp4.sm90_reference_kernels()
    clear_cache()
    try:
        yield
    finally:
        nvfp4.NVFP4_GEMM["other"] = table
        clear_cache()


def write_json(results, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)


def write_outputs(results, args):
    write_json(results, args.out)
    md = markdown_table(results)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    plot_bars(results, os.path.join(args.out, "tokens_per_sec.png"))
    plot_roofline(results, os.path.join(args.out, "roofline.png"))
    return md


def markdown_table(results) -> str:
    rows = results["configs"]
    keys = ["prefill_tok_s"] + [f"decode_b{b}_tok_s" for b in results["args"]["decode_batches"]] + \
           ["throughput_tok_s", "throughput_preemptions", "peak_mem_GB", "agreement", "logits_rel_err"] + \
           [f"decode_b{b}_roofline_pct" for b in results["args"]["decode_batches"]] + \
           ["prefill_host_ms"] + [f"decode_b{b}_host_ms" for b in results["args"]["decode_batches"]]
    head = "| config | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1) + "\n" if rows else ""
    body = ""
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            cells.append("" if v is None else (f"{v:.3g}" if isinstance(v, float) and abs(v) < 10 else
                                               f"{v:.0f}" if isinstance(v, float) else str(v)))
        body += f"| {r['config']} | " + " | ".join(cells) + " |\n"
    q = ("\n| quality (embedded SmolLM2) | perplexity | top-1 agreement with dense | with the bf16 head |\n"
         "|---|---|---|---|\n") + "".join(_quality_row(k, v) for k, v in results.get("quality", {}).items())
    notes = "".join(f"\n{r['config']} throughput: {r.get('throughput_note') or r['throughput_method']}\n"
                    for r in rows if r.get("throughput_method"))
    ceil = results["ceilings"]
    hdr = (f"device: {results['device']}; copy bandwidth {ceil['copy_GBps']:.0f} GB/s; "
           f"bf16 GEMM {ceil['bf16_TFLOPs']:.0f} TFLOP/s; allocator {results.get('allocator', 'native')}\n\n")
    return hdr + head + body + notes + q


def _quality_row(name, v) -> str:
    if not isinstance(v, dict):
        return f"| {name} | {v} | | |\n"
    head = v.get("top1_vs_bf16_head")
    return (f"| {name} | {v['perplexity']:.3f} | {v['top1_agreement']:.3f} | "
            f"{'' if head is None else f'{head:.3f}'} |\n")


def plot_bars(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in results["configs"] if "error" not in r]
    metrics = [k for k in ("prefill_tok_s", *[f"decode_b{b}_tok_s" for b in results["args"]["decode_batches"]],
                           "throughput_tok_s")]
    dense = next((r for r in rows if r["config"] == "dense"), None)
    if dense is None:
        return
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        vals = [r.get(m, 0) / dense[m] if dense.get(m) and r.get(m) else 0 for m in metrics]
        ax.bar([j + i * width for j in range(len(metrics))], vals, width, label=r["config"])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(metrics))], [m.replace("_tok_s", "") for m in metrics])
    ax.set_ylabel("tokens/sec vs dense bf16")
    ax.set_title(f"{results['args']['model']} on {results['device']}")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_roofline(results, path):
    """Each GEMM a point at its arithmetic intensity and achieved FLOP/s, under the measured
    bandwidth and bf16 compute ceilings."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points = results.get("gemm_points", [])
    if not points:
        return
    fig, ax = plt.subplots(figsize=(8, 5.5))
    configs = sorted({p["config"] for p in points}, key=lambda c: list(CONFIGS).index(c))
    markers = dict(zip(configs, "os^vDP*X"))
    for c in configs:
        ps = [p for p in points if p["config"] == c]
        ax.scatter([p["intensity"] for p in ps], [p["flops_per_s"] / 1e12 for p in ps],
                   marker=markers[c], label=c, alpha=0.8)
    bw = results["ceilings"]["copy_GBps"] * 1e9
    for key, style in (("bf16_TFLOPs", "k-"), ("fp8_TFLOPs", "k--")):
        peak = results["ceilings"].get(key, float("nan")) * 1e12
        if not (math.isnan(bw) or math.isnan(peak)):   # measured on a GPU in this run
            knee = peak / bw
            ax.plot([0.3, knee, 3e4], [0.3 * bw / 1e12, peak / 1e12, peak / 1e12], style, lw=1,
                    label=f"measured roof: {bw / 1e12:.2f} TB/s, {peak / 1e12:.0f} TFLOP/s "
                          f"{key.split('_')[0]}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of weights + activations)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"layer-0 GEMMs of {results['args']['model']} at M in {results['args']['gemm_ms']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def engine_overrides(args, ap) -> dict:
    """EngineConfig fields the command line sets for every configuration."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    out = {}
    if args.offload:
        if "offload" not in fields:
            ap.error("--offload: this engine's EngineConfig has no offload field yet")
        out["offload"] = True
    if args.gpu_memory_limit is not None:
        out["gpu_memory_limit"] = args.gpu_memory_limit
    if args.tune == "off":
        out["tune"] = "off"
    if args.tensor_parallel_size != 1:
        out["tensor_parallel_size"] = args.tensor_parallel_size
    if args.lm_head is not None:
        out["lm_head"] = args.lm_head
    if args.no_cuda_graphs:
        out["cuda_graphs"] = False
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="a preset name (default llama-3.1-8b)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--dtype", default=None, help="model dtype (default bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and counts for the CPU (CI)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    ap.add_argument("--hf-batch", type=int, default=64,
                    help="HF throughput: requests per static generate() batch (default %(default)s)")
    ap.add_argument("--hf-time-limit", type=float, default=300.0,
                    help="HF throughput: start no new batch after this many seconds; a cut row says "
                         "so (default %(default)s)")
    ap.add_argument("--no-quality", action="store_true", help="skip the perplexity column")
    ap.add_argument("--quality-only", action="store_true",
                    help="only the perplexity column (the embedded model's file is not on every GPU box)")
    ap.add_argument("--checkpoint", action="append", metavar="DIR",
                    help="quality: also a checkpoint of the embedded model (benchmarks/make_checkpoint.py); "
                         "repeatable")
    ap.add_argument("--requests", type=int, default=256, help="requests in the throughput test")
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--prefill-seqs", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--decode-batches", default="1,16,64")
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--step-tokens", type=int, default=8192, help="per-step token budget")
    ap.add_argument("--kv-tokens", type=int, default=None, help="KV cache size in tokens (default: from memory)")
    ap.add_argument("--guard-tokens", type=int, default=32)
    ap.add_argument("--guard-only", action="store_true",
                    help="only the correctness guard of each configuration (no timings, no HF)")
    ap.add_argument("--ppl-window", type=int, default=512)
    ap.add_argument("--ppl-windows", type=int, default=8)
    ap.add_argument("--gemm-ms", default="1,16,128,1024,8192", help="M values of the roofline points")
    ap.add_argument("--out", default="bench_results", help="folder for results.json/.md and the plots")
    ap.add_argument("--offload", action="store_true",
                    help="every config: stream the decoder layers that do not fit the GPU from pinned "
                         "host memory (EngineConfig.offload; limit: --gpu-memory-limit, else free memory)")
    ap.add_argument("--gpu-memory-limit", type=float, default=None, metavar="GIB",
                    help="every config: GiB of device memory for weights, KV cache and activations")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="every config: decode steps run eagerly")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                    help="shard every config over N GPUs (one process each); weights, roofline and GEMM "
                         "points are then one rank's")
    ap.add_argument("--tune", choices=("on", "off"), default="on",
                    help="time the GEMM kernels at engine start (cached in ~/.cache/microengine) or "
                         "take each op's defaults")
    ap.add_argument("--lm-head", choices=LM_HEAD_FORMATS, default=None,
                    help="every config: the LM head's weight format (default: engine/config.py's "
                         "default_lm_head, from the weight format and the measured quality)")
    ap.add_argument("--quality-heads", default=QUALITY_HEADS,
                    help="comma list of LM-head formats the quality column measures beside the bf16 "
                         "head ('' for none; default %(default)s)")
    allocator.add_arguments(ap)
    ap.add_argument("--replot", metavar="RESULTS_JSON",
                    help="only redraw the table and pictures of an earlier run's results.json")
    args = ap.parse_args(argv)
    allocator.configure_from_args(args, ap)     # before CUDA starts; may restart the process once
    args.engine_overrides = engine_overrides(args, ap)
    if args.replot:
        with open(args.replot) as f:
            results = json.load(f)
        print(write_outputs(results, args))
        return
    if args.quick:
        args.model = "llama-tiny" if args.model == "llama-3.1-8b" else args.model
        args.requests, args.min_len, args.max_len = 8, 8, 32
        args.prefill_seqs, args.prefill_len, args.decode_prompt, args.decode_steps = 2, 64, 32, 8
        args.decode_batches, args.guard_tokens, args.ppl_window, args.ppl_windows = "1,4", 8, 128, 2
        args.step_tokens, args.gemm_ms, args.quality_heads = 512, "1,64", "fp8"
    args.gemm_ms = [int(m) for m in args.gemm_ms.split(",")]
    args.quality_heads = [h.strip() for h in args.quality_heads.split(",") if h.strip()]
    if any(h not in LM_HEAD_FORMATS for h in args.quality_heads):
        ap.error(f"--quality-heads: choose from {', '.join(LM_HEAD_FORMATS)}")
    args.decode_batches = [int(b) for b in args.decode_batches.split(",")]
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}")
    if "dense" in names:
        names.remove("dense")
    names.insert(0, "dense")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[
        resolve_dtype(args.dtype, device)]
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shared = {"copy_bw": measure_copy_bandwidth(device)}   # nan on the CPU: no roofline there
    results = {"device": dev_name, "args": vars(args), "date": time.strftime("%Y-%m-%d"),
               "allocator": f"{args.allocator} ({args.memory_release})" if device.type == "cuda" else "n/a",
               "ceilings": {"copy_GBps": shared["copy_bw"] / 1e9,
                            "bf16_TFLOPs": measure_matmul_peak(device) / 1e12,
                            "fp8_TFLOPs": measure_matmul_peak(device, torch.float8_e4m3fn) / 1e12},
               "configs": []}
    steps = names + ([] if args.no_hf or args.guard_only else ["HF transformers"]) + \
        ([] if args.no_quality or args.guard_only else ["quality"])
    if args.quality_only:
        steps = ["quality"]
    for name in tqdm(steps, desc="bench", unit="config", file=sys.stderr):
        try:
            if name == "HF transformers":
                results["configs"].append(bench_hf(args, device))
            elif name == "quality":
                results["quality"] = quality(args, device)
            else:
                row = bench_config(name, CONFIGS[name][0], args, device, shared)
                bound = LOSSLESS_TOLERANCE_PER_LAYER[args.dtype_name] * row.pop("num_layers")
                if CONFIGS[name][1] and row["logits_rel_err"] > bound:
                    row["note"] = (f"lossless switch moved the logits by {row['logits_rel_err']:.2e} "
                                   "(relative), more than rounding explains")
                results["configs"].append(row)
        except (ValueError, NotImplementedError, ImportError, RuntimeError) as e:
            results["configs"].append({"config": name, "error": f"{type(e).__name__}: {e}"})
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        write_json(results, args.out)   # a run cut short by a crash or a time limit keeps what it measured
    results["gemm_points"] = shared.get("points", [])
    md = write_outputs(results, args)
    print(md)
    for r in results["configs"]:
        for key in ("error", "note", "throughput_note"):
            if key in r:
                print(f"{r['config']}: {r[key]}")
    print(f"wrote {args.out}/results.json, results.md, tokens_per_sec.png, roofline.png")


if __name__ == "__main__":
    main()
