"""Fused Triton kernels vs eager PyTorch and torch.compile, at Llama-3.1-8B shapes, on one GPU.

For 1, 64 and 8192 tokens: fused residual-add + RMSNorm (bf16 out and FP8 out), L2 norm, SwiGLU
(bf16 out and FP8 out) and RoPE; each kernel's median time, the bytes it must move (every input
read once, every output written once), achieved GB/s and its fraction of the device-to-device copy
bandwidth measured in the same run. Decode attention over the paged cache at batch 1, 64 and 256,
against gather + SDPA, and over the same cache in FP8 (kv_cache_dtype="fp8"); then with unequal
contexts, rows in random order against longest first (the engine's layout). Prefill attention
over packed prompts and over chunks after a cached prefix, in TFLOP/s against the bf16 GEMM
ceiling measured in the run, beside FlashAttention-2 on the fresh prompts. Then the bytes that
recompute-instead-of-store saves per layer per token (counted, not timed), and a small sweep of
launch configurations.

    python benchmarks/bench_fused.py            # correctness checks, then the tables
    python benchmarks/bench_fused.py --check    # correctness checks only
    python benchmarks/bench_fused.py --decode   # decode attention only (its checks and table)
    python benchmarks/bench_fused.py --prefill  # prefill attention only (its checks and table)

Times are medians of benchmarks/timing.py `cold_ms`: L2 is evicted by reading 256 MB before every
timed call, so inputs come from HBM, not L2 (a flush that writes, as triton.testing.do_bench's
does, would also charge each call the write-back of its dirty lines). The events bracket
the Python launch too: at 1 and 64 tokens the times are launch-bound (host launch cost included),
not a measure of the kernels.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import math
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.batch import query_block_ends  # noqa: E402
from engine.kernels import attention, norms, rope, swiglu  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import cold_ms  # noqa: E402

HIDDEN, FFN, N_HEADS, N_KV, HEAD_DIM = 4096, 14336, 32, 8, 128   # Llama-3.1-8B
EPS = 1e-5
BF16 = torch.bfloat16
DEVICE = "cuda"
TOKENS = (1, 64, 8192)
# (batch, context); 1 x 512 and 64 x 2,048 are where the decode goals are stated (BENCHMARKS.md)
DECODE_CASES = [(1, 512), (1, 1024), (1, 4096), (64, 1024), (64, 2048), (64, 4096), (256, 640)]
UNEVEN_CONTEXTS, UNEVEN_BATCHES = (100, 2048), (32, 64, 128, 256)
BLOCK_SIZE = 16
# Prefill attention: (what, chunk lengths, the cached prefix before each chunk)
PREFILL_CASES = [("4 prompts of 2,048", [2048] * 4, [0] * 4), ("1 prompt of 8,192", [8192], [0]),
                 ("16 prompts of 512", [512] * 16, [0] * 16), ("32 prompts of 256", [256] * 32, [0] * 32),
                 ("64 prompts of 128", [128] * 64, [0] * 64),
                 ("5 prompts of 100 to 3,000", [100, 3000, 700, 1500, 2892], [0] * 5),
                 ("1 chunk of 8,192 after 8,192", [8192], [8192]),
                 ("8 chunks of 1,024 after 512", [1024] * 8, [512] * 8),
                 ("64 chunks of 16 after 1,000", [16] * 64, [1000] * 64)]
PREFILL_CHECKS = [([300, 129, 40], [0, 0, 0]), ([300, 129, 40], [1000, 256, 0])]
BF16_BOUND = 1e-2       # bf16 outputs (and bf16 P in P @ V) vs an fp32-math reference
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def bench_ms(fn):
    return cold_ms(fn, rep=100, warmup=25)


def copy_bandwidth_gbs():
    src = torch.randn(256 * 1024 * 1024, device=DEVICE, dtype=torch.float32)   # 1 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


# --------------------------------------------------------------------------------------------------
# the cases: (name, make inputs for M tokens) -> (fused fn, reference fn, bytes moved)


def case_rms(m, residual, quant):
    x = torch.randn(m, HIDDEN, device=DEVICE, dtype=BF16)
    r = torch.randn(m, HIDDEN, device=DEVICE, dtype=BF16) if residual else None
    w = torch.randn(HIDDEN, device=DEVICE, dtype=BF16)
    out_bytes = m * HIDDEN + 4 * m if quant else 2 * m * HIDDEN
    nbytes = 2 * m * HIDDEN + 2 * HIDDEN + out_bytes + (4 * m * HIDDEN if residual else 0)
    return (lambda: norms.rms_norm_triton(x, w, EPS, r, quant),
            lambda f: (lambda: f(x, w, EPS, r, quant)), norms.rms_norm_ref, nbytes)


def case_l2(m):
    x = torch.randn(m, HIDDEN, device=DEVICE, dtype=BF16)
    return lambda: norms.l2_norm_triton(x), lambda f: (lambda: f(x)), norms.l2_norm_ref, 4 * m * HIDDEN


def case_swiglu(m, quant):
    gu = torch.randn(m, 2 * FFN, device=DEVICE, dtype=BF16)
    out_bytes = m * FFN + 4 * m if quant else 2 * m * FFN
    return (lambda: swiglu.swiglu_triton(gu, quant), lambda f: (lambda: f(gu, quant)), swiglu.swiglu_ref,
            4 * m * FFN + out_bytes)


def case_rope(m):
    qkv = torch.randn(m, (N_HEADS + 2 * N_KV) * HEAD_DIM, device=DEVICE, dtype=BF16)
    q = qkv[:, :N_HEADS * HEAD_DIM].view(m, N_HEADS, HEAD_DIM)
    k = qkv[:, N_HEADS * HEAD_DIM:(N_HEADS + N_KV) * HEAD_DIM].view(m, N_KV, HEAD_DIM)
    pos = torch.randint(0, 131072, (m,), device=DEVICE)
    inv_freq = rope.rope_inv_freq(HEAD_DIM, 500000.0, LLAMA3_SCALING).to(DEVICE)
    nbytes = 2 * 2 * m * (N_HEADS + N_KV) * HEAD_DIM + 8 * m + 4 * HEAD_DIM // 2
    return (lambda: rope.apply_rope_triton(q, k, pos, inv_freq), lambda f: (lambda: f(q, k, pos, inv_freq)),
            rope.apply_rope_ref, nbytes)


CASES = [
    ("rmsnorm", lambda m: case_rms(m, False, None)),
    ("add+rmsnorm", lambda m: case_rms(m, True, None)),
    ("add+rmsnorm->fp8", lambda m: case_rms(m, True, "fp8")),
    ("l2norm", case_l2),
    ("swiglu", lambda m: case_swiglu(m, None)),
    ("swiglu->fp8", lambda m: case_swiglu(m, "fp8")),
    ("rope (q,k in place)", case_rope),
]


def paged_decode_inputs(lens):
    """A decode step's attention inputs for contexts `lens` (int32, one per row): q, a random paged
    cache of as many blocks per row as the longest context needs behind shuffled block tables, and
    the context lengths, all on the device."""
    batch, width = len(lens), -(-int(lens.max()) // BLOCK_SIZE)
    k_cache = torch.randn(batch * width, BLOCK_SIZE, N_KV, HEAD_DIM, device=DEVICE, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * width, device=DEVICE).to(torch.int32).view(batch, width)
    q = torch.randn(batch, N_HEADS, HEAD_DIM, device=DEVICE, dtype=BF16)
    return q, k_cache, v_cache, tables, lens.to(DEVICE)


def decode_inputs(batch, ctx):
    return paged_decode_inputs(torch.full((batch,), ctx, dtype=torch.int32))


def uneven_decode_inputs(batch, lo, hi, seed=0):
    """Contexts drawn uniformly from lo..hi (seeded), rows in that random order."""
    gen = torch.Generator().manual_seed(seed)
    return paged_decode_inputs(torch.randint(lo, hi + 1, (batch,), generator=gen, dtype=torch.int32))


def gather_sdpa(q, k_cache, v_cache, tables, ctx, scale):
    """The baseline: gather each sequence's blocks into a dense [B, ctx, nkv, hd], then SDPA (GQA)."""
    b = q.shape[0]
    k = k_cache[tables.long()].view(b, -1, N_KV, HEAD_DIM).transpose(1, 2)
    v = v_cache[tables.long()].view(b, -1, N_KV, HEAD_DIM).transpose(1, 2)
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True).squeeze(2)


def fp8_cache(k_cache, v_cache):
    """The same cache in FP8: (k, v, (k_scale, v_scale)), engine/kernels/rope.py's layout."""
    (kq, ks), (vq, vs) = rope.quantize_kv_ref(k_cache), rope.quantize_kv_ref(v_cache)
    return kq, vq, (ks, vs)


def decode_bytes(batch, ctx, fp8=False):
    """K and V rows read (an FP8 row: a byte a value and its fp32 scale), q read, out written, the
    block table and context length read."""
    row = HEAD_DIM + 4 if fp8 else HEAD_DIM * 2
    return (2 * batch * ctx * N_KV * row + 2 * batch * N_HEADS * HEAD_DIM * 2
            + batch * (ctx // BLOCK_SIZE) * 4 + batch * 4)


def prefill_inputs(q_lens, prefixes):
    """A prefill step's attention inputs: q, k, v as views of one packed qkv buffer (as the model's
    projection hands them over), each chunk's prefix in a random paged cache behind shuffled block
    tables, cu_seqlens, context lengths and the query blocks' running count (as engine/batch.py)."""
    ctx = [q + p for q, p in zip(q_lens, prefixes)]
    blocks = [-(-c // BLOCK_SIZE) for c in ctx]
    k_cache = torch.randn(sum(blocks), BLOCK_SIZE, N_KV, HEAD_DIM, device=DEVICE, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(sum(blocks), device=DEVICE).to(torch.int32)
    tables = torch.zeros(len(ctx), max(blocks), dtype=torch.int32, device=DEVICE)
    for i, start in enumerate(itertools.accumulate([0] + blocks[:-1])):
        tables[i, :blocks[i]] = order[start:start + blocks[i]]
    qkv = torch.randn(sum(q_lens), N_HEADS + 2 * N_KV, HEAD_DIM, device=DEVICE, dtype=BF16)
    q, k, v = qkv.split([N_HEADS, N_KV, N_KV], dim=1)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    ends = torch.tensor(query_block_ends(q_lens), dtype=torch.int32, device=DEVICE)
    return q, k, v, cu, torch.tensor(ctx, dtype=torch.int32, device=DEVICE), tables, k_cache, v_cache, ends


def prefill_flops(q_lens, prefixes):
    """2 x 2 x head_dim per visible (query, key) pair and query head: each query sees the prefix and
    the chunk's keys up to its own."""
    pairs = sum(n * p + n * (n + 1) // 2 for n, p in zip(q_lens, prefixes))
    return 4 * HEAD_DIM * N_HEADS * pairs


# --------------------------------------------------------------------------------------------------
# correctness at the benchmark shapes


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def dequant(qs):
    q, s = qs
    return q.double() * s.double()[:, None]


def check_cases(m):
    """(name, fn returning (rel err, bound)) for the kernels at m tokens."""
    x = torch.randn(m, HIDDEN, device=DEVICE, dtype=BF16)
    r = torch.randn(m, HIDDEN, device=DEVICE, dtype=BF16)
    w = torch.randn(HIDDEN, device=DEVICE, dtype=BF16)
    gu = torch.randn(m, 2 * FFN, device=DEVICE, dtype=BF16)

    def rms():
        return rel_err(norms.rms_norm_triton(x, w, EPS), norms.rms_norm_ref(x, w, EPS)), BF16_BOUND

    def add_rms():
        (o, nr), (ro, rr) = norms.rms_norm_triton(x, w, EPS, r), norms.rms_norm_ref(x, w, EPS, r)
        return max(rel_err(o, ro), rel_err(nr, rr)), BF16_BOUND

    def add_rms_fp8():
        (qs, _) = norms.rms_norm_triton(x, w, EPS, r, "fp8")
        xr = (x.double() + r.double()).to(BF16).double()
        exact = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
        return rel_err(dequant(qs), exact), 2.0 ** -4    # e4m3: 3 mantissa bits

    def l2():
        return rel_err(norms.l2_norm_triton(x), norms.l2_norm_ref(x)), BF16_BOUND

    def swiglu_bf16():
        return rel_err(swiglu.swiglu_triton(gu), swiglu.swiglu_ref(gu)), BF16_BOUND

    def swiglu_fp8():
        g, u = gu.double().chunk(2, -1)
        return rel_err(dequant(swiglu.swiglu_triton(gu, "fp8")), F.silu(g) * u), 2.0 ** -4

    def rope_qk():
        qkv = torch.randn(m, (N_HEADS + 2 * N_KV) * HEAD_DIM, device=DEVICE, dtype=BF16)
        q = qkv[:, :N_HEADS * HEAD_DIM].view(m, N_HEADS, HEAD_DIM)
        k = qkv[:, N_HEADS * HEAD_DIM:(N_HEADS + N_KV) * HEAD_DIM].view(m, N_KV, HEAD_DIM)
        pos = torch.randint(0, 131072, (m,), device=DEVICE)
        inv = rope.rope_inv_freq(HEAD_DIM, 500000.0, LLAMA3_SCALING).to(DEVICE)
        rq, rk = rope.apply_rope_ref(q, k, pos, inv)
        tq, tk = rope.apply_rope_triton(q, k, pos, inv)
        return max(rel_err(tq, rq), rel_err(tk, rk)), BF16_BOUND

    return [("rmsnorm", rms), ("add+rmsnorm", add_rms), ("add+rmsnorm->fp8 (vs fp64)", add_rms_fp8),
            ("l2norm", l2), ("swiglu", swiglu_bf16), ("swiglu->fp8 (vs fp64)", swiglu_fp8), ("rope", rope_qk)]


def check_decode_case(batch, ctx):
    q, kc, vc, tables, lens = decode_inputs(batch, ctx)
    ref = attention.decode_attention_ref(q, kc, vc, tables, lens, HEAD_DIM ** -0.5)
    return [(f"decode attn b{batch} ctx{ctx}", lambda: (rel_err(
                attention.decode_attention(q, kc, vc, tables, lens, HEAD_DIM ** -0.5), ref), BF16_BOUND)),
            (f"gather+sdpa b{batch} ctx{ctx}", lambda: (rel_err(
                gather_sdpa(q, kc, vc, tables, lens, HEAD_DIM ** -0.5), ref), BF16_BOUND)),
            (f"decode attn, FP8 cache, b{batch} ctx{ctx} (vs its fp32 reference)", lambda: fp8_decode_error(
                q, kc, vc, tables, lens))]


def check_uneven_decode_case():
    q, kc, vc, tables, lens = uneven_decode_inputs(64, *UNEVEN_CONTEXTS)
    ref = attention.decode_attention_ref(q, kc, vc, tables, lens, HEAD_DIM ** -0.5)
    return [(f"decode attn b64 ctx{UNEVEN_CONTEXTS[0]}..{UNEVEN_CONTEXTS[1]}", lambda: (rel_err(
                attention.decode_attention(q, kc, vc, tables, lens, HEAD_DIM ** -0.5), ref), BF16_BOUND))]


def fp8_decode_error(q, kc, vc, tables, lens):
    kq, vq, scales = fp8_cache(kc, vc)
    ref = attention.decode_attention_ref(q, kq, vq, tables, lens, HEAD_DIM ** -0.5, kv_scales=scales)
    out = attention.decode_attention(q, kq, vq, tables, lens, HEAD_DIM ** -0.5, kv_scales=scales)
    return rel_err(out, ref), BF16_BOUND


def check_prefill_case(q_lens, prefixes):
    q, k, v, cu, ctx, tables, kc, vc, ends = prefill_inputs(q_lens, prefixes)
    scale, what = HEAD_DIM ** -0.5, "prefix" if any(prefixes) else "fresh prompts"
    ref = attention.prefill_attention_ref(q, k, v, cu, ctx, tables, kc, vc, scale)
    kq, vq, scales = fp8_cache(kc, vc)
    ref_fp8 = attention.prefill_attention_ref(q, k, v, cu, ctx, tables, kq, vq, scale, scales)
    return [(f"prefill attn, {what}", lambda: (rel_err(attention.prefill_attention_triton(
                q, k, v, cu, ctx, tables, kc, vc, scale, max(prefixes), block_ends=ends), ref), BF16_BOUND)),
            (f"prefill attn, {what}, FP8 cache (vs its fp32 reference)", lambda: (rel_err(
                attention.prefill_attention_triton(q, k, v, cu, ctx, tables, kq, vq, scale, max(prefixes),
                                                   block_ends=ends, kv_scales=scales), ref_fp8), BF16_BOUND))]


def check(decode_only=False, prefill_only=False):
    """Fused vs reference at the benchmark's shapes; prints a table, returns the number of failures."""
    failures = 0
    print("\n## correctness (relative error ||out-ref|| / ||ref||)\n")
    print("| kernel | M | rel err | bound | |")
    print("| --- | ---: | ---: | ---: | --- |")
    groups = [] if decode_only or prefill_only else [(m, lambda m=m: check_cases(m)) for m in TOKENS]
    if not prefill_only:
        groups += [(b, lambda b=b, c=c: check_decode_case(b, c)) for b, c in DECODE_CASES]
        groups += [(64, check_uneven_decode_case)]
    if not decode_only:
        groups += [(sum(n), lambda n=n, p=p: check_prefill_case(n, p)) for n, p in PREFILL_CHECKS]
    for m, make in groups:
        for name, run in make():
            try:
                err, bound = run()
                verdict = "ok" if math.isfinite(err) and err < bound else "FAIL"
                print(f"| {name} | {m} | {err:.2e} | {bound:.1e} | {verdict} |", flush=True)
            except Exception as e:   # report, keep going: one run on the GPU must say everything
                verdict = "FAIL"
                print(f"| {name} | {m} | {type(e).__name__}: {str(e)[:200]} | | FAIL |", flush=True)
            failures += verdict != "ok"
    return failures


# --------------------------------------------------------------------------------------------------
# timing


def compiled(fn):
    return torch.compile(fn, dynamic=False)   # one graph per shape: the best case for the baseline


def bench_kernels(copy_gbs):
    print("\n## fused kernels vs eager and torch.compile (bf16; medians in us after an L2 eviction by reading)\n")
    print("| kernel | tokens | bytes | fused us | fused GB/s | % copy BW | eager us | compile us "
          "| x eager | x compile |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, make in CASES:
        for m in TOKENS:
            try:
                fused, bind, ref, nbytes = make(m)
                t_fused = bench_ms(fused)
            except Exception as e:   # report, keep going
                print(f"| {name} | {m} | {type(e).__name__}: {str(e)[:200]} |", flush=True)
                continue
            t_eager = bench_ms(bind(ref))
            try:
                t_comp = bench_ms(bind(compiled(ref)))
            except Exception as e:   # report, keep going
                print(f"<!-- torch.compile failed for {name} M={m}: {type(e).__name__}: {str(e)[:300]} -->")
                t_comp = float("nan")
            gbs = nbytes / t_fused / 1e6
            print(f"| {name} | {m} | {nbytes / 1e6:.3f} MB | {t_fused * 1e3:.1f} | {gbs:.0f} "
                  f"| {100 * gbs / copy_gbs:.0f}% | {t_eager * 1e3:.1f} | {t_comp * 1e3:.1f} "
                  f"| {t_eager / t_fused:.2f} | {t_comp / t_fused:.2f} |", flush=True)


def bench_decode(copy_gbs):
    print("\n## decode attention over the paged cache (32/8 heads x 128, bf16, block 16; medians after an L2 eviction by reading)\n")
    print("| batch | context | bytes | splits | fused us | GB/s | % copy BW | TFLOP/s "
          "| gather+SDPA us | x gather+SDPA | FP8 cache: bytes | us | GB/s | % copy BW | x bf16 cache |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    scale = HEAD_DIM ** -0.5
    for batch, ctx in DECODE_CASES:
        q, kc, vc, tables, lens = decode_inputs(batch, ctx)
        t_fused = bench_ms(lambda: attention.decode_attention(q, kc, vc, tables, lens, scale))
        t_base = bench_ms(lambda: gather_sdpa(q, kc, vc, tables, lens, scale))
        kq, vq, scales = fp8_cache(kc, vc)
        t_fp8 = bench_ms(lambda: attention.decode_attention(q, kq, vq, tables, lens, scale, kv_scales=scales))
        nbytes, fp8_bytes = decode_bytes(batch, ctx), decode_bytes(batch, ctx, fp8=True)
        flops = 4 * batch * N_HEADS * ctx * HEAD_DIM
        gbs, fp8_gbs = nbytes / t_fused / 1e6, fp8_bytes / t_fp8 / 1e6
        splits = attention.decode_splits(batch, N_KV, q.device)
        print(f"| {batch} | {ctx} | {nbytes / 1e6:.1f} MB | {splits} | {t_fused * 1e3:.1f} | {gbs:.0f} "
              f"| {100 * gbs / copy_gbs:.0f}% | {flops / t_fused / 1e9:.2f} | {t_base * 1e3:.1f} "
              f"| {t_base / t_fused:.2f} | {fp8_bytes / 1e6:.1f} MB | {t_fp8 * 1e3:.1f} | {fp8_gbs:.0f} "
              f"| {100 * fp8_gbs / copy_gbs:.0f}% | {t_fused / t_fp8:.2f} |", flush=True)


def bench_uneven_decode(copy_gbs):
    """Contexts uniform in 100..2,048 (as in serving's throughput set midway): the rows in random
    order, then longest first, as engine/batch.py lays out a step (the kernel starts them in row
    order)."""
    lo, hi = UNEVEN_CONTEXTS
    print(f"\n## decode attention, contexts uniform in {lo:,}..{hi:,} (32/8 heads x 128, blocks of 16; "
          "medians after an L2 eviction by reading)\n")
    print("| batch | bytes bf16 / FP8 | rows in random order: bf16 us (% copy BW) | longest first "
          "| FP8 cache, random order | FP8 cache, longest first |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    scale = HEAD_DIM ** -0.5
    for batch in UNEVEN_BATCHES:
        q, kc, vc, tables, lens = uneven_decode_inputs(batch, lo, hi)
        kq, vq, scales = fp8_cache(kc, vc)
        cells = []
        tokens = int(lens.sum())
        nbytes = {False: 2 * tokens * N_KV * HEAD_DIM * 2, True: 2 * tokens * N_KV * (HEAD_DIM + 4)}
        for fp8 in (False, True):
            k_cache, v_cache = (kq, vq) if fp8 else (kc, vc)
            for rows in (torch.arange(batch, device=DEVICE), lens.argsort(descending=True, stable=True)):
                qq, tt, ll = q[rows], tables[rows], lens[rows]
                t = bench_ms(lambda: attention.decode_attention(
                    qq, k_cache, v_cache, tt, ll, scale, kv_scales=scales if fp8 else None))
                cells.append(f"{t * 1e3:.1f} ({100 * nbytes[fp8] / t / 1e6 / copy_gbs:.0f}%)")
        print(f"| {batch} | {nbytes[False] / 1e6:.0f} / {nbytes[True] / 1e6:.0f} MB | " + " | ".join(cells) + " |",
              flush=True)


def bf16_gemm_tflops():
    a, b = (torch.randn(8192, 8192, device=DEVICE, dtype=BF16) for _ in range(2))
    return 2 * 8192 ** 3 / bench_ms(lambda: a @ b) / 1e9


def bench_prefill(copy_gbs):
    ceiling = bf16_gemm_tflops()
    print(f"\n## prefill attention over packed rows (32/8 heads x 128, bf16, block 16; medians after an L2 "
          f"eviction by reading; bf16 GEMM ceiling {ceiling:.0f} TFLOP/s at 8192^3 in this run)\n")
    print("| rows | tiling (keys, stages) | TFLOP | us | TFLOP/s | % ceiling | FlashAttention-2 us | x FA2 "
          "| FP8 cache us |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    scale = HEAD_DIM ** -0.5
    for what, q_lens, prefixes in PREFILL_CASES:
        q, k, v, cu, ctx, tables, kc, vc, ends = prefill_inputs(q_lens, prefixes)
        fresh = not any(prefixes)
        flops = prefill_flops(q_lens, prefixes)
        t = bench_ms(lambda: attention.prefill_attention_triton(q, k, v, cu, ctx, tables, kc, vc, scale,
                                                                max(prefixes), block_ends=ends))
        t_fa = (bench_ms(lambda: attention.prefill_attention_flash(q, k, v, cu, max(q_lens), scale))
                if fresh else float("nan"))
        kq, vq, scales = fp8_cache(kc, vc)
        t_fp8 = (float("nan") if fresh else bench_ms(lambda: attention.prefill_attention_triton(
            q, k, v, cu, ctx, tables, kq, vq, scale, max(prefixes), block_ends=ends, kv_scales=scales)))
        tiling = attention.prefill_tiling(BF16, fresh, False)
        tflops = flops / t / 1e9
        print(f"| {what} | {tiling[0]}, {tiling[1]} | {flops / 1e12:.3f} | {t * 1e3:.1f} | {tflops:.0f} "
              f"| {100 * tflops / ceiling:.0f}% | {t_fa * 1e3:.1f} | {t_fa / t:.2f} | {t_fp8 * 1e3:.1f} |", flush=True)


def print_recompute_savings():
    """Bytes per layer per token that recompute-instead-of-store avoids at Llama-3.1-8B (counted).
    Two baselines: a bf16 pipeline with no FP8, and FP8 GEMMs fed by a separate quantise kernel."""
    scale = 4                                   # one fp32 scale per FP8 row
    rope_table = HEAD_DIM * 4                   # a cos/sin row per token: hd/2 cos + hd/2 sin, fp32
    rows = [
        ("RoPE: cos/sin table row not read (angles recomputed from position x inv_freq)",
         rope_table, rope_table),
        # fused: FP8 written once, read once by the GEMM. bf16: 2F written, 2F read. unfused FP8:
        # 2F written, 2F read by the quantiser, F + scale written, F + scale read
        ("SwiGLU -> FP8: no bf16 product", 2 * (FFN - scale), 4 * FFN),
        ("2 x RMSNorm -> FP8: no bf16 norm outputs", 2 * 2 * (HIDDEN - scale), 2 * 4 * HIDDEN),
    ]
    print("\n## recompute instead of store: bytes avoided per layer per token (counted, Llama-3.1-8B)\n")
    print("| what is not stored / read | vs bf16 pipeline | vs FP8 with a separate quantise kernel |")
    print("| --- | ---: | ---: |")
    for name, vs_bf16, vs_unfused in rows:
        print(f"| {name} | {vs_bf16} | {vs_unfused} |")
    print(f"| total | {sum(r[1] for r in rows)} | {sum(r[2] for r in rows)} |")


def sweep(copy_gbs):
    """Launch-configuration alternatives at 8192 tokens (and decode splits), to pick defaults."""
    print("\n## launch-configuration sweep (medians after an L2 eviction by reading)\n")
    print("| kernel | config | us | % copy BW |")
    print("| --- | --- | ---: | ---: |")

    def row(name, config, fn, nbytes):
        ms = bench_ms(fn)
        print(f"| {name} | {config} | {ms * 1e3:.1f} | {100 * nbytes / ms / 1e6 / copy_gbs:.0f}% |", flush=True)

    base_config = norms.row_launch_config
    for warps in (2, 4, 8, 16, 32):
        norms.row_launch_config = swiglu.row_launch_config = lambda n, w=warps: (base_config(n)[0], w)
        for name, make in (("rmsnorm", lambda m: case_rms(m, False, None)),
                           ("add+rmsnorm", lambda m: case_rms(m, True, None)),
                           ("l2norm", case_l2),
                           ("swiglu->fp8", lambda m: case_swiglu(m, "fp8"))):
            fused, _, _, nbytes = make(8192)
            row(name, f"num_warps={warps}", fused, nbytes)
    norms.row_launch_config = swiglu.row_launch_config = base_config
    base_slice = swiglu.SLICE
    for slice_cols in (1024, 2048, 4096, 8192):
        swiglu.SLICE = slice_cols
        fused, _, _, nbytes = case_swiglu(8192, None)
        row("swiglu", f"SLICE={slice_cols}", fused, nbytes)
    swiglu.SLICE = base_slice
    for batch, ctx in DECODE_CASES:
        q, kc, vc, tables, lens = decode_inputs(batch, ctx)
        for splits in (1, 4, 16, 64):
            row(f"decode b{batch} ctx{ctx}", f"splits={splits}",
                lambda: attention.decode_attention(q, kc, vc, tables, lens, 0.088, num_splits=splits),
                decode_bytes(batch, ctx))


def measure_recompute_savings(copy_gbs, m=8192):
    """The same savings measured at 8192 tokens: the fused kernel that quantises on the way out
    against the store path (the kernel writing bf16, then the FP8 quantiser reading it back).
    The time saved, times the copy bandwidth, is the traffic the store path adds; the count of the
    bytes it must add sits beside it. (The RoPE table row, 512 B per token per layer against 20 KB
    of q/k traffic, is below the timing noise: counted only.)"""
    from engine.formats.fp8 import quantize_act_fp8
    print(f"\n## recompute instead of store, measured ({m} tokens; medians after an L2 eviction by reading)\n")
    print("| path | fused us | store path us | saved us | saved x copy BW | counted bytes |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    x, r = (torch.randn(m, HIDDEN, device=DEVICE, dtype=BF16) for _ in range(2))
    w = torch.randn(HIDDEN, device=DEVICE, dtype=BF16)
    gu = torch.randn(m, 2 * FFN, device=DEVICE, dtype=BF16)
    cases = [("add+RMSNorm -> FP8", lambda: norms.rms_norm_triton(x, w, EPS, r, "fp8"),
              lambda: quantize_act_fp8(norms.rms_norm_triton(x, w, EPS, r)[0]), 2 * 2 * m * HIDDEN),
             ("SwiGLU -> FP8", lambda: swiglu.swiglu_triton(gu, "fp8"),
              lambda: quantize_act_fp8(swiglu.swiglu_triton(gu)), 2 * 2 * m * FFN)]
    for name, fused, store, counted in cases:
        t_fused, t_store = bench_ms(fused), bench_ms(store)
        saved = t_store - t_fused
        print(f"| {name} | {t_fused * 1e3:.1f} | {t_store * 1e3:.1f} | {saved * 1e3:.1f} "
              f"| {saved * copy_gbs:.0f} MB | {counted / 1e6:.0f} MB |", flush=True)   # ms x GB/s = MB


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="run the correctness checks only")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    parser.add_argument("--decode", action="store_true", help="decode attention only: its checks and table")
    parser.add_argument("--prefill", action="store_true", help="prefill attention only: its checks and table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused.py needs a CUDA GPU")
    import triton
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64   # one compiled graph per (variant, shape)
    print(f"# bench_fused: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    failures = check(decode_only=args.decode, prefill_only=args.prefill)
    if not args.check:
        copy_gbs = copy_bandwidth_gbs()
        print(f"\nHBM copy bandwidth (1 GiB device-to-device, read + write): {copy_gbs:.0f} GB/s")
        stages = ([bench_decode, bench_uneven_decode] if args.decode else [bench_prefill] if args.prefill else
                  [bench_kernels, bench_decode, bench_uneven_decode, bench_prefill] +
                  ([] if args.no_sweep else [sweep]))
        for stage in stages:
            try:
                stage(copy_gbs)
            except Exception:   # report, keep going with the next table
                traceback.print_exc()
                failures += 1
        if not args.decode and not args.prefill:
            print_recompute_savings()
            measure_recompute_savings(copy_gbs)
    if failures:
        sys.exit(f"{failures} correctness check(s) failed")


if __name__ == "__main__":
    main()
