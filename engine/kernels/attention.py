"""Attention over a paged KV cache: KV write, prefill over packed variable-length sequences, decode.

Cache layout (per layer): k_cache, v_cache of shape [num_blocks, block_size, n_kv_heads, head_dim].
A sequence's token at position p lives in block block_table[p // block_size], row p % block_size;
its flat slot is block * block_size + row (the slot_mapping of the KV write).

Each function has a plain PyTorch reference (`*_ref`), which is what runs on the CPU; on CUDA
tensors (or anywhere under TRITON_INTERPRET=1) the public functions run Triton kernels. The KV
write has no kernel of its own: RoPE's launch stores prefill rows' K and V (engine/kernels/rope.py,
whose `write_kv_ref` is the reference), and the decode kernel its own rows'.
- `decode_attention`: one program per (sequence, KV head, split of the context). The query heads
  that share a KV head are processed together as the rows of one tile, so each K/V row is read
  from HBM once per KV head (GQA); long contexts are split across programs to fill the GPU and a
  second kernel merges the splits' partial softmaxes. A sequence's KV heads are adjacent in the
  launch order and sequences follow in row order: rows given longest context first (as the engine
  lays out a step) run longest first, so unequal contexts leave no long program to run alone at
  the end. fp32 softmax, online (exp2 domain). Given the rows' new k and v (`new_kv`), the kernel
  also applies RoPE to q and k, with the RoPE kernel's arithmetic (the same bits), and stores k and
  v in the cache: decode needs no RoPE launch. Over an FP8 cache on sm_89+ the same grid runs
  engine/kernels/attention_gluon.py's kernel instead (each thread copies the cache bytes it feeds
  the MMA into a shared-memory ring); the merge is shared.
- `prefill_attention`: packed variable-length sequences. Short prompts with no cached prefix, in
  bf16/fp16 on sm_80+, go to FlashAttention-2's variable-length kernel over the packed rows
  (cu_seqlens), GQA native; the others to this module's prefill kernel: one program per (block of
  queries of one sequence, query head), causal aligned bottom-right: the cached prefix is read from
  the paged cache through the block table, this step's keys straight from k and v. Only the
  prefix's last tile and the diagonal tiles are masked; every other key tile runs without masks.
  Blocks start last first (the most keys first); a step the host knows to have no prefix runs a
  binary without the prefix loops.
- `compile_step_kernels`: these kernels run outside the step graphs, on each step's own shapes, and
  take whatever changes between steps as runtime arguments; this compiles the few binaries left
  (per model) when the engine starts, so none compiles while a request waits.
Which kernel runs is chosen in one place, engine/kernels/select.py, from the ordered lists
DECODE_ATTENTION and PREFILL_ATTENTION (each kernel says why it cannot run; each choice is logged
once), as the GEMMs' are.
Block tables are int32 [num_seqs, max_blocks]; context lengths int32; block_size a power of two.
An FP8 cache (rope.py's layout, with `kv_scales` = (k_scale, v_scale)): the kernels feed its e4m3
values to the dot products as they are (exact in bf16/fp16) and apply the row scales to the scores
(keys) and to the probabilities (values), in fp32; this step's own keys (a prefill chunk's) are
read unquantised. The references dequantise in fp32.
"""
from __future__ import annotations

import functools

import torch

from engine.kernels.norms import e4m3_scale, quantize_e4m3
from engine.kernels.platform import (capability, gluon_missing, interpreting, jit, output_buffer, sm_count,
                                     triton_runs)
from engine.kernels.rope import (apply_rope_ref, check_cache, check_kv_scales, dequantize_kv_ref, rope_cos_sin,
                                 rope_rotate, write_kv_ref)
from engine.kernels.select import Kernel, Problem, select

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the references run
    triton = None


def _gather_seq(cache, block_table, length, scale=None):
    """The first `length` cached rows of one sequence: [length, n_kv, hd] (fp32, dequantised, where
    the cache is FP8 with `scale`)."""
    bs = cache.shape[1]
    nblocks = (length + bs - 1) // bs
    blocks = block_table[:nblocks].long()
    rows = cache[blocks].flatten(0, 1)[:length]
    return rows if scale is None else dequantize_kv_ref(rows, scale[blocks].flatten(0, 1)[:length])


def _attend(q, k, v, scale):
    """q: [Lq, nh, hd] over k, v: [Lk, nkv, hd], causal aligned at the bottom right (the queries are
    the last Lq positions of the Lk keys). fp32 math."""
    lq, nh, _ = q.shape
    lk, nkv, _ = k.shape
    group = nh // nkv
    qf = q.float().transpose(0, 1)                                   # [nh, Lq, hd]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)   # [nh, Lk, hd]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale                       # [nh, Lq, Lk]
    qpos = torch.arange(lk - lq, lk, device=q.device)[:, None]
    kpos = torch.arange(lk, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)     # [Lq, nh, hd]


def prefill_attention_ref(q, k, v, cu_seqlens_q, context_lens, block_tables, k_cache, v_cache, scale,
                          kv_scales=None):
    """Causal attention for packed sequences. q: [T, nh, hd]; k, v: [T, n_kv, hd] (this step's keys).
    Sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1] and sees context_lens[i] keys in all: a
    cached prefix (read from the paged cache, which already holds this step's keys) plus its own,
    read from k and v."""
    ks_, vs_ = kv_scales or (None, None)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    for i in range(len(ctx)):
        s, e = cu[i], cu[i + 1]
        if ctx[i] == e - s:      # no prefix: this step's keys are all there is
            ks, vs = k[s:e], v[s:e]
        else:
            prefix = ctx[i] - (e - s)
            ks = torch.cat([_gather_seq(k_cache, block_tables[i], prefix, ks_).float(), k[s:e].float()])
            vs = torch.cat([_gather_seq(v_cache, block_tables[i], prefix, vs_).float(), v[s:e].float()])
        out[s:e] = _attend(q[s:e], ks, vs, scale)
    return out


def decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, new_kv=None, kv_scales=None):
    """One query per sequence. q: [B, nh, hd]; sequence b sees its first context_lens[b] cached keys.
    new_kv = (k, v, inv_freq), k and v [B, nkv, hd]: each row's token is the last of its context
    (position context_lens - 1); its q and k are not rotated yet and its k, v not cached: RoPE
    rotates them and the cache gets k, v at that position first (what the RoPE kernel would do),
    and every key, that one included, is read back from the cache."""
    ks_, vs_ = kv_scales or (None, None)
    if new_kv is not None:
        k, v, inv_freq = new_kv
        pos = context_lens.long() - 1
        q, k = apply_rope_ref(q, k, pos, inv_freq)
        bs = k_cache.shape[1]
        slots = block_tables.gather(1, (pos // bs)[:, None]).squeeze(1).long() * bs + pos % bs
        write_kv_ref(k, v, k_cache, v_cache, slots, kv_scales)
    out = torch.empty_like(q)
    for b, length in enumerate(context_lens.tolist()):
        ks = _gather_seq(k_cache, block_tables[b], length, ks_)
        vs = _gather_seq(v_cache, block_tables[b], length, vs_)
        out[b] = _attend(q[b:b + 1], ks, vs, scale)[0]
    return out


def prefill_attention_flash(q, k, v, cu_seqlens, max_len, scale):
    """Prefills with no cached prefix: FlashAttention-2's variable-length kernel over the packed rows
    (aten::_flash_attention_forward, what SDPA runs for jagged tensors, called directly: one launch
    and no per-call Python work, where torch.nested's dispatch costs milliseconds of host time per
    layer). q [T, nh, hd], k/v [T, n_kv, hd] (GQA: n_kv divides nh), unit stride along hd;
    cu_seqlens int32 [P + 1]; max_len the longest prompt, known on the host. Causal. -> [T, nh, hd]."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0,
                                                   True, False, scale=scale)[0]


# --------------------------------------------------------------------------------------------------
# Triton kernels


@jit
def _dot(a, b, acc, EXACT_FP32: tl.constexpr):
    """acc + a @ b in fp32 (acc None: a @ b). EXACT_FP32: on fp32 copies without tf32, for fp32
    inputs and under the interpreter (whose dot multiplies bf16 bit patterns as integers); bf16
    products are exact in fp32, so that differs from the tensor cores only in summation order."""
    if EXACT_FP32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        c = tl.dot(a, b, acc)
    return c


@jit
def _rotate_head(x_ptr, d, partner, first, cos, sin):
    """One head (or a tile of heads) rotated as the RoPE kernel rotates it, in fp32: x at columns
    d, read again at the partner columns of the rotate-half pairs."""
    x = tl.load(x_ptr + d).to(tl.float32)
    xp = tl.load(x_ptr + partner).to(tl.float32)
    y1, _ = rope_rotate(x, xp, cos, sin)      # columns of the first half: x is x1, xp is x2
    _, y2 = rope_rotate(xp, x, cos, sin)      # second half: xp is x1, x is x2
    return tl.where(first, y1, y2)


@jit
def _load_cached(cache_ptr, scale_ptr, rows, d, mask, KV_FP8: tl.constexpr, HEAD_DIM: tl.constexpr, dtype):
    """Cached rows (offsets `rows` of their head rows, [N]) at columns d, in `dtype` (exact for e4m3),
    and their scales [N] (an FP8 cache's, at offset / HEAD_DIM; else 1). mask None: all rows valid."""
    if mask is None:
        x = tl.load(cache_ptr + rows[:, None] + d[None, :])
    else:
        x = tl.load(cache_ptr + rows[:, None] + d[None, :], mask=mask[:, None], other=0.0)
    if KV_FP8:
        if mask is None:
            sc = tl.load(scale_ptr + rows // HEAD_DIM)
        else:
            sc = tl.load(scale_ptr + rows // HEAD_DIM, mask=mask, other=0.0)
    else:
        sc = 1.0
    return x.to(dtype), sc


@jit
def _store_cached(cache_ptr, scale_ptr, row, x, KV_FP8: tl.constexpr, HEAD_DIM: tl.constexpr, dtype,
                  ROUND_IN_FP32: tl.constexpr):
    """One head row x (fp32 [HEAD_DIM]) stored at offset `row` of the cache: as `dtype` (the model's)
    rounds it, and in an FP8 cache then quantised with its scale (the RoPE kernel's quantisation)."""
    x = x.to(dtype)
    if KV_FP8:
        xf = x.to(tl.float32)
        sc = e4m3_scale(tl.max(tl.abs(xf), axis=0))
        tl.store(scale_ptr + row // HEAD_DIM, sc)
        tl.store(cache_ptr + row + tl.arange(0, HEAD_DIM), quantize_e4m3(xf, sc, ROUND_IN_FP32))
    else:
        tl.store(cache_ptr + row + tl.arange(0, HEAD_DIM), x.to(cache_ptr.dtype.element_ty))


# The attention kernels run outside the step graphs, on each step's own shapes. What changes from
# step to step is therefore a runtime argument that Triton must not specialise on: the sequence
# count, the block tables' width, the split count, and the alignment of a mixed step's decode rows
# inside its block tables and context lengths. One binary then serves every step; any other new
# specialisation would compile in the middle of serving and stall every request meanwhile. (The
# merge keeps the split count compile-time, for its tile: compile_step_kernels builds all six.)
@jit(do_not_specialize=["bt_stride", "num_splits"],
     do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                   block_tables_ptr, context_lens_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                   scale_log2e, q_stride_b, q_stride_h, k_stride_b, k_stride_h, v_stride_b, v_stride_h,
                   c_stride_block, c_stride_row, c_stride_head, bt_stride, n_heads, num_splits,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, ROPE: tl.constexpr, KV_FP8: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
                   EXACT_FP32: tl.constexpr):
    kv_head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    # this split's keys: a BLOCK_N-aligned share of the context (empty for late splits of short ones)
    split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(ctx, start + split_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g            # the query heads of this KV head, as tile rows
    is_head = g < GROUP
    q_at = q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h
    if ROPE:
        # The row's token is the context's last, at position ctx - 1. Its q and k are rotated here
        # with the RoPE kernel's arithmetic, to the same bits; the split that holds the position
        # stores k and v in the cache and reads them back in its loop.
        HALF: tl.constexpr = HEAD_DIM // 2
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        pos = ctx - 1
        cos, sin = rope_cos_sin(pos, inv_freq_ptr, tl.where(first, d, d - HALF), HALF)
        q_rows = tl.where(is_head[:, None], q_at, q_ptr)      # padding rows read row 0, unused
        q = _rotate_head(q_rows, d[None, :], partner[None, :], first[None, :], cos[None, :],
                         sin[None, :]).to(q_ptr.dtype.element_ty)
        if pos >= start:
            k = _rotate_head(k_ptr + seq * k_stride_b + kv_head * k_stride_h, d, partner, first, cos, sin)
            v = tl.load(v_ptr + seq * v_stride_b + kv_head * v_stride_h + d).to(tl.float32)
            page = tl.load(block_tables_ptr + seq * bt_stride + pos // PAGE).to(tl.int64)
            row = page * c_stride_block + (pos % PAGE) * c_stride_row + kv_head * c_stride_head
            _store_cached(k_cache_ptr, k_scale_ptr, row, k, KV_FP8, HEAD_DIM, q_ptr.dtype.element_ty, ROUND_IN_FP32)
            _store_cached(v_cache_ptr, v_scale_ptr, row, v, KV_FP8, HEAD_DIM, q_ptr.dtype.element_ty, ROUND_IN_FP32)
            tl.debug_barrier()             # the whole program sees the row before the loop reads it
    else:
        q = tl.load(q_at + d[None, :], mask=is_head[:, None], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end                    # every tile holds at least one valid key: m stays finite
        page = tl.load(block_tables_ptr + seq * bt_stride + n // PAGE, mask=valid, other=0)
        rows = page.to(tl.int64) * c_stride_block + (n % PAGE) * c_stride_row + kv_head * c_stride_head
        k, k_scale = _load_cached(k_cache_ptr, k_scale_ptr, rows, d, valid, KV_FP8, HEAD_DIM, q.dtype)
        v, v_scale = _load_cached(v_cache_ptr, v_scale_ptr, rows, d, valid, KV_FP8, HEAD_DIM, q.dtype)
        m, l, acc = _online_softmax_step(q, k, v, k_scale, v_scale, m, l, acc, scale_log2e, valid[None, :], True,
                                         KV_FP8, EXACT_FP32)
    if num_splits == 1:
        o = acc / l[:, None]
        tl.store(out_ptr + (seq * n_heads + heads)[:, None] * HEAD_DIM + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=is_head[:, None])
    else:
        part = (seq * n_heads + heads) * num_splits + split
        tl.store(part_max_ptr + part, m, mask=is_head)
        tl.store(part_sum_ptr + part, l, mask=is_head)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=(is_head & (l > 0))[:, None])   # an empty split writes no acc


@jit
def _decode_merge_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
                         NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Merge one (sequence, head)'s per-split softmax partials: rescale each to the global max.
    One binary per split count, a power of two up to MAX_DECODE_SPLITS: all compiled at start."""
    row = tl.program_id(0).to(tl.int64)    # seq * n_heads + head
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    m = tl.load(part_max_ptr + row * NUM_SPLITS + s)
    l = tl.load(part_sum_ptr + row * NUM_SPLITS + s)
    w = tl.exp2(m - tl.max(m, axis=0))     # empty splits: m = -inf, weight 0
    acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=(l > 0)[:, None], other=0.0)   # empty splits wrote no acc
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty))


@jit
def _online_softmax_step(q, k, v, k_scale, v_scale, m, l, acc, scale_log2e, visible, MASKED: tl.constexpr,
                         SCALED: tl.constexpr, EXACT_FP32: tl.constexpr):
    """One key tile of an online softmax (exp2 domain): the running max m, sum l and output acc,
    updated with the keys `visible` [rows, keys] (MASKED) or with all of them. SCALED: k and v are
    an FP8 cache's values, k_scale and v_scale [keys] their rows' scales."""
    s = _dot(q, tl.trans(k), None, EXACT_FP32)
    if SCALED:
        s = s * k_scale[None, :]
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    # m is kept in the exp2 domain (scaled); the scale folds into one multiply-add per score
    m_new = tl.maximum(m, tl.max(s, axis=1) * scale_log2e)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s * scale_log2e - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if SCALED:
        p = p * v_scale[None, :]
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], EXACT_FP32)   # the MMA accumulates into acc
    return m_new, l, acc


@jit
def _cached_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, n0, prefix, d, kv_head,
                 c_stride_block, c_stride_row, c_stride_head, dtype, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                 MASKED: tl.constexpr, KV_FP8: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Keys and values n0 .. n0 + BLOCK_N - 1 of a sequence's cached prefix, through its block
    table, in `dtype`, and their scales (_load_cached's; MASKED: those past `prefix` read as 0)."""
    n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        valid = n < prefix
        page = tl.load(table_ptr + n // PAGE, mask=valid, other=0)
    else:
        valid = None
        page = tl.load(table_ptr + n // PAGE)
    kv_rows = page.to(tl.int64) * c_stride_block + (n % PAGE) * c_stride_row + kv_head * c_stride_head
    k, k_scale = _load_cached(k_cache_ptr, k_scale_ptr, kv_rows, d, valid, KV_FP8, HEAD_DIM, dtype)
    v, v_scale = _load_cached(v_cache_ptr, v_scale_ptr, kv_rows, d, valid, KV_FP8, HEAD_DIM, dtype)
    return k, v, k_scale, v_scale


@jit(do_not_specialize=["bt_stride", "n_seqs"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                    cu_seqlens_ptr, context_lens_ptr, block_ends_ptr, out_ptr, scale_log2e,
                    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                    c_stride_block, c_stride_row, c_stride_head, bt_stride, n_seqs, n_heads,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEQ_CHUNK: tl.constexpr,
                    HAS_PREFIX: tl.constexpr, KV_FP8: tl.constexpr, EXACT_FP32: tl.constexpr):
    # Query blocks in reverse: a sequence's last blocks, which see the most keys, start first, and
    # the short ones fill the last wave.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    # the sequence that owns query block `pid`: the count of sequences whose running total of
    # BLOCK_M blocks (block_ends) is <= pid, SEQ_CHUNK sequences at a time
    seq = tl.zeros([], tl.int32)
    for i0 in range(0, n_seqs, SEQ_CHUNK):
        i = i0 + tl.arange(0, SEQ_CHUNK)
        block_ends = tl.load(block_ends_ptr + i, mask=i < n_seqs, other=2**30)
        seq += tl.sum((block_ends <= pid).to(tl.int32), axis=0)
    if seq >= n_seqs:                      # the grid is an upper bound on the block count
        return
    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_seqlens_ptr + seq + 1) - q_start).to(tl.int32)
    prefix = tl.load(context_lens_ptr + seq) - q_len
    first_block = tl.load(block_ends_ptr + seq) - tl.cdiv(q_len, BLOCK_M)
    rows = (pid - first_block) * BLOCK_M + tl.arange(0, BLOCK_M)   # query index in the chunk
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + rows)[:, None] * q_stride_t + head * q_stride_h + d[None, :],
                mask=(rows < q_len)[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Tiles that every query of the block sees whole run without masks; only the prefix's last
    # tile and the diagonal tiles mask. The first tile holds a key every row sees (prefix key 0, or
    # chunk key row0 <= row), so each row's running max is finite from the first tile on.

    # 1. the cached prefix, through the block table: every query sees all of it. HAS_PREFIX False
    #    (the host knows no chunk has one) compiles without these loops, which cost the fresh
    #    prompts' loops below registers and time even when they never run.
    if HAS_PREFIX:
        full = prefix // BLOCK_N * BLOCK_N
        for n0 in range(0, full, BLOCK_N):
            k, v, k_scale, v_scale = _cached_tile(
                k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr + seq * bt_stride, n0, prefix,
                d, kv_head, c_stride_block, c_stride_row, c_stride_head, q.dtype, BLOCK_N, PAGE, False, KV_FP8,
                HEAD_DIM)
            m, l, acc = _online_softmax_step(q, k, v, k_scale, v_scale, m, l, acc, scale_log2e, None, False, KV_FP8,
                                             EXACT_FP32)
        for n0 in range(full, prefix, BLOCK_N):   # the partial last tile
            k, v, k_scale, v_scale = _cached_tile(
                k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr + seq * bt_stride, n0, prefix,
                d, kv_head, c_stride_block, c_stride_row, c_stride_head, q.dtype, BLOCK_N, PAGE, True, KV_FP8,
                HEAD_DIM)
            n = n0 + tl.arange(0, BLOCK_N)
            m, l, acc = _online_softmax_step(q, k, v, k_scale, v_scale, m, l, acc, scale_log2e,
                                             (n < prefix)[None, :], True, KV_FP8, EXACT_FP32)

    # 2. this chunk's own keys: those before the block's first query row0 (BLOCK_N divides BLOCK_M)
    #    are seen by every row, then the diagonal tiles, causal (query i sees keys 0..i)
    row0 = (pid - first_block) * BLOCK_M
    k_rows = k_ptr + q_start * k_stride_t + kv_head * k_stride_h + d[None, :]
    v_rows = v_ptr + q_start * v_stride_t + kv_head * v_stride_h + d[None, :]
    for n0 in range(0, row0, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_rows + n[:, None] * k_stride_t)
        v = tl.load(v_rows + n[:, None] * v_stride_t)
        m, l, acc = _online_softmax_step(q, k, v, 1.0, 1.0, m, l, acc, scale_log2e, None, False, False, EXACT_FP32)
    for n0 in range(row0, tl.minimum(q_len, row0 + BLOCK_M), BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        in_chunk = n < q_len
        k = tl.load(k_rows + n[:, None] * k_stride_t, mask=in_chunk[:, None], other=0.0)
        v = tl.load(v_rows + n[:, None] * v_stride_t, mask=in_chunk[:, None], other=0.0)
        m, l, acc = _online_softmax_step(q, k, v, 1.0, 1.0, m, l, acc, scale_log2e,
                                         (n[None, :] <= rows[:, None]) & in_chunk[None, :], True, False, EXACT_FP32)

    o = acc / l[:, None]
    tl.store(out_ptr + ((q_start + rows) * n_heads + head)[:, None] * HEAD_DIM + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=(rows < q_len)[:, None])


LOG2E = 1.4426950408889634
# The decode kernel's (keys per tile, pipeline stages), by cache format: an FP8 cache's tiles convert
# in registers, and run fastest twice as wide and less deep (BENCHMARKS.md, "FP8 KV cache").
DECODE_TILING = {"model dtype": (64, 3), "fp8": (128, 2)}
MAX_DECODE_SPLITS = 64   # splits of one sequence's context, at most (decode_splits)
FP8_GLUON_MAX_SPLITS = 16   # the Gluon kernel's 4 warps take 4 pages at a time: more splits stay empty
SEQ_CHUNK = 64           # sequences the prefill kernel's owner search reads at a time
PREFILL_BLOCK_M = 128     # queries per program of the prefill kernel
FRESH_PROMPT_LEN = 256    # prompts without a prefix averaging this long take the prefill kernel, not FA2


def prefill_tiling(dtype: torch.dtype, fresh: bool, fp8_cache: bool) -> tuple[int, int]:
    """Keys per tile (a divisor of PREFILL_BLOCK_M) and pipeline stages of the prefill kernel: 16-bit
    K/V of fresh prompts (no chunk has a cached prefix) in 64-key tiles 3 deep; with a prefix in
    128-key tiles, 3 deep from a 16-bit cache and 2 from an FP8 one (its tiles convert in registers);
    fp32 (twice the bytes) in 64-key tiles 2 deep, to fit shared memory. Each is the fastest of 64 /
    128 keys x 2 / 3 / 4 stages in its regime (BENCHMARKS.md, "Prefill attention")."""
    if dtype == torch.float32:
        return 64, 2
    if fresh:
        return 64, 3
    return 128, 2 if fp8_cache else 3


def _exact_fp32_dot(dtype):
    return dtype == torch.float32 or interpreting()


def decode_splits(num_seqs: int, num_kv_heads: int, device, most: int = MAX_DECODE_SPLITS) -> int:
    """Splits of the context per (sequence, KV head): enough programs for ~2 per SM, a power of two
    up to `most` (large batches run best unsplit, batch 1 at 16..64 splits). The split
    length is decided in the kernel from each sequence's own context length, so the host needs no
    context lengths (no sync)."""
    if device.type != "cuda":
        return 4   # the interpreter: exercise the split-and-merge path
    want = -(-2 * sm_count(device) // max(num_seqs * num_kv_heads, 1))
    return min(most, 1 << (want.bit_length() - 1))


def _decode_launch(q, k_cache, v_cache, block_tables, context_lens, scale, new_kv=None, out=None,
                   kv_scales=None, num_splits=None, gluon=False):
    """decode_attention_ref's contract on the Triton kernel, or (gluon) attention_gluon.py's over an
    FP8 cache; the splits' merge follows either."""
    b, nh, hd = q.shape
    nkv = k_cache.shape[2]
    check_cache(k_cache, v_cache, hd, kv_scales)
    if q.stride(-1) != 1:
        raise ValueError("decode_attention needs unit stride along head_dim")
    group = nh // nkv
    splits = num_splits or decode_splits(b, nkv, q.device, FP8_GLUON_MAX_SPLITS if gluon else MAX_DECODE_SPLITS)
    if splits < 1 or splits > MAX_DECODE_SPLITS or splits & (splits - 1):
        raise ValueError(f"num_splits: must be a power of two up to {MAX_DECODE_SPLITS}, got {splits}")
    out = output_buffer(out, q.shape, q.dtype, q.device)
    if b == 0:
        return out
    block_n, stages = DECODE_TILING["fp8" if kv_scales is not None else "model dtype"]
    if splits > 1:
        part_acc = torch.empty((b, nh, splits, hd), device=q.device, dtype=torch.float32)
        part_max = torch.empty((b, nh, splits), device=q.device, dtype=torch.float32)
        part_sum = torch.empty((b, nh, splits), device=q.device, dtype=torch.float32)
    else:
        part_acc = part_max = part_sum = out   # unused: the kernel writes out directly
    if new_kv is not None:
        k, v, inv_freq = new_kv
        if k.shape != (b, nkv, hd) or v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError(f"decode_attention: new k and v must be [{b}, {nkv}, {hd}] with unit stride "
                             "along head_dim")
        new = (k, v, inv_freq.to(q.device), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    else:    # unused pointers and strides: ROPE is off
        new = (q, q, q, 0, 0, 0, 0)
    if gluon:
        from engine.kernels.attention_gluon import MAX_REGISTERS, NUM_WARPS, fp8_cache_decode_kernel
        k_scale, v_scale = kv_scales
        fp8_cache_decode_kernel[(nkv, b, splits)](
            q, *new[:3], k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, out,
            part_acc, part_max, part_sum, scale * LOG2E, q.stride(0), q.stride(1), *new[3:],
            k_cache.stride(0) // 4, k_cache.stride(1) // 4, k_scale.stride(0), k_scale.stride(1),
            block_tables.stride(0), nh, splits, GROUP=group, ROPE=new_kv is not None, num_warps=NUM_WARPS,
            maxnreg=MAX_REGISTERS)
    else:
        _decode_kernel[(nkv, b, splits)](
            q, *new[:3], k_cache, v_cache, *(kv_scales or (k_cache, v_cache)), block_tables, context_lens, out,
            part_acc, part_max, part_sum,
            scale * LOG2E, q.stride(0), q.stride(1), *new[3:], k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), block_tables.stride(0), nh, splits, GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=hd, PAGE=k_cache.shape[1],
            BLOCK_N=block_n, ROPE=new_kv is not None, KV_FP8=kv_scales is not None,
            ROUND_IN_FP32=interpreting(), EXACT_FP32=_exact_fp32_dot(q.dtype), num_warps=4, num_stages=stages)
    if splits > 1:
        _decode_merge_kernel[(b * nh,)](part_acc, part_max, part_sum, out, NUM_SPLITS=splits,
                                        HEAD_DIM=hd, num_warps=4)
    return out


def prefill_attention_triton(q, k, v, cu_seqlens_q, context_lens, block_tables, k_cache, v_cache, scale,
                             max_prefix: int | None = None, out=None, block_ends=None, kv_scales=None):
    t, nh, hd = q.shape
    nkv = k.shape[1]
    n_seqs = context_lens.shape[0]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("prefill_attention needs unit stride along head_dim")
    if k_cache is None:   # no cache (embeddings): no sequence may have a prefix
        k_cache = v_cache = k.view(t, 1, nkv, hd)
        block_tables = context_lens.view(n_seqs, 1)
        kv_scales = None
    check_cache(k_cache, v_cache, hd, kv_scales)
    out = output_buffer(out, q.shape, q.dtype, q.device)
    if t == 0:
        return out
    # query blocks never straddle sequences; block_ends[i] = query blocks of sequences 0..i (given
    # by the caller, or counted on the device: no sync); the grid is the upper bound
    # cdiv(T, BLOCK_M) + n_seqs
    if block_ends is None:
        q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        block_ends = torch.cumsum((q_lens + PREFILL_BLOCK_M - 1) // PREFILL_BLOCK_M, 0).to(torch.int32)
    grid = (triton.cdiv(t, PREFILL_BLOCK_M) + n_seqs, nh)
    fresh = max_prefix == 0          # the host's promise: no chunk has a cached prefix
    block_n, stages = prefill_tiling(q.dtype, fresh, kv_scales is not None)
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, *(kv_scales or (k_cache, v_cache)), block_tables, cu_seqlens_q, context_lens,
        block_ends, out,
        scale * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), n_seqs, nh,
        GROUP=nh // nkv, HEAD_DIM=hd, PAGE=k_cache.shape[1], BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=block_n, SEQ_CHUNK=SEQ_CHUNK, HAS_PREFIX=not fresh, KV_FP8=kv_scales is not None,
        EXACT_FP32=_exact_fp32_dot(q.dtype), num_warps=8 if hd > 64 else 4, num_stages=stages)
    return out


# --------------------------------------------------------------------------------------------------
# What the model calls: the kernel engine/kernels/select.py picks from the lists below.
#
# The attention Problem: m = query rows, n = query heads, k = head_dim; detail = (q dtype, FP8 cache,
# interpreting, then the op's own facts). The interpreter flag is in the key because tests switch it.


def _problem(op: str, q: torch.Tensor, fp8_cache: bool, *facts) -> Problem:
    return Problem(op, q.shape[0], q.shape[1], q.shape[2], q.device, (q.dtype, fp8_cache, interpreting(), *facts))


def _triton_fits(p: Problem) -> str | None:
    if triton_runs(p.device):
        return None
    return "Triton is not installed" if triton is None else "runs on CUDA or in Triton's interpreter"


def _into(out, o: torch.Tensor) -> torch.Tensor:
    """A reference path's result `o`, or `out` (checked as output_buffer checks it) holding it."""
    return o if out is None else output_buffer(out, o.shape, o.dtype, o.device).copy_(o)


def _gluon_decode_fits(p: Problem) -> str | None:
    """attention_gluon.py's kernel: faster than the Triton kernel over an FP8 cache at every batch
    measured (BENCHMARKS.md, "FP8 KV cache")."""
    dtype, fp8_cache, interp, page, group = p.detail
    cap = capability(p.device)
    if not fp8_cache:
        return "takes an FP8 cache"
    if cap is None or cap < (8, 9):
        return "needs sm_89+ (e4m3 conversion in hardware)"
    if interp or triton is None:
        return "Gluon runs on the GPU only"
    if reason := gluon_missing():
        return reason
    from engine.kernels.attention_gluon import MAX_GROUP
    if dtype not in (torch.bfloat16, torch.float16) or p.k != 128 or page != 16 or group > MAX_GROUP:
        return f"takes 16-bit q, heads of 128, pages of 16 and at most {MAX_GROUP} query heads per KV head"
    return None


def _decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale, new_kv=None, out=None,
                      kv_scales=None, num_splits=None):
    check_kv_scales(k_cache, q.shape[-1], kv_scales)   # (the launch path checks in check_cache)
    o = decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, new_kv, kv_scales)
    return _into(out, o)


DECODE_ATTENTION = {"other": [
    Kernel("gluon_fp8_cache", functools.partial(_decode_launch, gluon=True), check=_gluon_decode_fits),
    Kernel("triton", _decode_launch, needs_cuda=False, check=_triton_fits),
    Kernel("reference", _decode_reference, reference=True)]}


def decode_kernel(q: torch.Tensor, k_cache: torch.Tensor, fp8_cache: bool) -> Kernel:
    """The kernel decode_attention runs for these queries over this cache."""
    group = q.shape[1] // k_cache.shape[2]
    return select(DECODE_ATTENTION, _problem("decode_attention", q, fp8_cache, k_cache.shape[1], group)).kernel


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, new_kv=None, out=None,
                     kv_scales=None, num_splits=None):
    """decode_attention_ref's contract (new_kv, kv_scales included) on the selected kernel, into
    `out` where given (contiguous, q's shape), else a new tensor. kv_scales: (k_scale, v_scale) of
    an FP8 cache. num_splits: a power of two up to MAX_DECODE_SPLITS that overrides the split
    count (tests, the benchmark's sweep, compile_step_kernels)."""
    kernel = decode_kernel(q, k_cache, kv_scales is not None)
    return kernel.run(q, k_cache, v_cache, block_tables, context_lens, scale, new_kv, out, kv_scales, num_splits)


def compile_step_kernels(k_cache, v_cache, kv_scales, num_heads: int, dtype: torch.dtype, block: int) -> None:
    """Compile, before serving, the attention binaries a step launches outside its CUDA graphs: the
    decode kernel for a mixed step's decode rows (their K/V stored by the graph pieces: no RoPE),
    the merge for each split count, and the prefill kernel for fresh prompts and for chunks after a
    cached prefix. The decode graphs' capture compiles the decode kernel with RoPE (with graphs off,
    the first decode step does). Every key read is in `block` of the cache (the
    engine's scratch block); the outputs are dropped. A no-op where the Triton kernels do not run.
    kv_scales: (k_scale, v_scale) of an FP8 cache, else None; dtype: the model's."""
    _, page, nkv, hd = k_cache.shape
    device = k_cache.device
    q = torch.zeros(1, num_heads, hd, device=device, dtype=dtype)
    if not triton_runs(q):
        return
    kv = torch.zeros(1, nkv, hd, device=device, dtype=dtype)

    def one_sequence(context: int):
        """Block table and context length of one sequence of `context` tokens, all in `block`."""
        tables = torch.full((1, -(-context // page)), block, dtype=torch.int32, device=device)
        return tables, torch.tensor([context], dtype=torch.int32, device=device)

    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for prefix in (0, 1):
        tables, ctx = one_sequence(prefix + 1)
        prefill_attention_triton(q, kv, kv, cu, ctx, tables, k_cache, v_cache, 1.0, prefix, kv_scales=kv_scales)
    tables, ctx = one_sequence(2)
    for splits in (1 << i for i in range(MAX_DECODE_SPLITS.bit_length())):
        decode_attention(q, k_cache, v_cache, tables, ctx, 1.0, kv_scales=kv_scales, num_splits=splits)


def _flash_fits(p: Problem) -> str | None:
    """FlashAttention-2 (aten's, on sm_80+) for fresh prompts averaging under FRESH_PROMPT_LEN
    tokens: from there the prefill kernel is the faster (BENCHMARKS.md, "Prefill attention")."""
    dtype, _, _, fresh, short, max_len_known = p.detail
    cap = capability(p.device)
    if cap is None or cap < (8, 0) or dtype not in (torch.bfloat16, torch.float16) or p.k > 256:
        return "needs sm_80+, 16-bit q and heads of at most 256"
    if not fresh:
        return "takes prompts with no cached prefix"
    if not short:
        return f"takes prompts averaging under {FRESH_PROMPT_LEN} tokens"
    return None if max_len_known else "needs the longest prompt's length from the host"


def _prefill_flash(q, k, v, cu_seqlens_q, context_lens, block_tables, k_cache, v_cache, scale, max_prefix=None,
                   out=None, block_ends=None, kv_scales=None, max_len=None):
    o = prefill_attention_flash(q, k, v, cu_seqlens_q, max_len, scale)
    return _into(out, o)


def _prefill_triton(q, k, v, cu_seqlens_q, context_lens, block_tables, k_cache, v_cache, scale, max_prefix=None,
                    out=None, block_ends=None, kv_scales=None, max_len=None):
    return prefill_attention_triton(q, k, v, cu_seqlens_q, context_lens, block_tables, k_cache, v_cache, scale,
                                    max_prefix, out, block_ends, kv_scales)


def _prefill_reference(q, k, v, cu_seqlens_q, context_lens, block_tables, k_cache, v_cache, scale,
                       max_prefix=None, out=None, block_ends=None, kv_scales=None, max_len=None):
    if k_cache is not None:
        check_kv_scales(k_cache, q.shape[-1], kv_scales)
    o = prefill_attention_ref(q, k, v, cu_seqlens_q, context_lens, block_tables, k_cache, v_cache, scale,
                              kv_scales)
    return _into(out, o)


PREFILL_ATTENTION = {"other": [
    Kernel("flash_attention_2", _prefill_flash, check=_flash_fits),
    Kernel("triton", _prefill_triton, needs_cuda=False, check=_triton_fits),
    Kernel("reference", _prefill_reference, reference=True)]}


def prefill_kernel(q: torch.Tensor, fp8_cache: bool, max_prefix: int | None, num_seqs: int,
                   max_len: int | None = None) -> Kernel:
    """The kernel prefill_attention runs for a step's prefill rows q [T, heads, hd] of `num_seqs`
    prompts."""
    fresh, short = max_prefix == 0, q.shape[0] < FRESH_PROMPT_LEN * num_seqs
    return select(PREFILL_ATTENTION, _problem("prefill_attention", q, fp8_cache, fresh, short,
                                              max_len is not None)).kernel


def prefill_attention(q, k, v, cu_seqlens_q, context_lens, block_tables, k_cache, v_cache, scale,
                      max_prefix: int | None = None, out=None, block_ends=None, kv_scales=None,
                      max_len: int | None = None):
    """Packed prompts (chunks) q [T, heads, hd] attending to their cached prefix and to themselves,
    on the selected kernel. max_prefix: the step's longest cached prefix (from the host), which
    picks the kernel and its tiling; 0 promises that no chunk has one (the prefill kernel then
    compiles without the prefix loops), None: not known. max_len: the longest prompt (from the
    host; FlashAttention-2 needs it).
    out: where the result goes (contiguous, q's shape), else a new tensor. block_ends: int32 [P],
    the running count of each sequence's ceil(q_len / PREFILL_BLOCK_M) query blocks, where the
    caller has it (engine/batch.py counts it once per step). kv_scales: (k_scale, v_scale) of an
    FP8 cache."""
    kernel = prefill_kernel(q, kv_scales is not None, max_prefix, context_lens.shape[0], max_len)
    return kernel.run(q, k, v, cu_seqlens_q, context_lens, block_tables, k_cache, v_cache, scale, max_prefix,
                      out, block_ends, kv_scales, max_len)
