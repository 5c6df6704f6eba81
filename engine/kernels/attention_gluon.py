"""Decode attention over an FP8 paged KV cache, in Gluon (sm_89+): MMA operands straight from the
bytes each thread copied.

`fp8_cache_decode_kernel` has the contract of engine/kernels/attention.py's `_decode_kernel` with an
FP8 cache (KV_FP8), and that module launches it and merges its splits: one program per (KV head,
sequence, split of the context), q [B, n_heads, 128] in bf16 or fp16, the cache [blocks, 16,
n_kv, 128] e4m3 with fp32 scales [blocks, 16, n_kv] (engine/kernels/rope.py's layout), block tables
int32, up to 8 query heads per KV head. Given the rows' new k and v (ROPE), it rotates q and k with
the RoPE kernel's arithmetic (the same bits) and stores k and v in the cache first. Its output
equals the Triton kernel's within rounding: the e4m3 values enter the dots exactly in fp16, the
key scales multiply the scores, the value scales the probabilities (in fp16, each page's divided by
its largest, which multiplies the page's product).

Design. The Triton kernel streams the FP8 cache at about half the copy bandwidth: its tiles go
through shared memory and back into MMA fragments byte by byte, and three programs of 168
registers an SM leave too few warps to cover that (BENCHMARKS.md, "FP8 KV cache"). Here each warp
takes whole pages (16 keys) of its program's split, runs its own online softmax, and moves each
thread's bytes in 16-byte pieces to exactly the registers the MMA reads; the warps meet once, at
the end.
- Scores: S^T = K Q^T, mma.sync m16n8k16 f16: K the A operand (16 keys x 128 d), Q^T the B operand
  (8 head columns). The dot runs over d in a permuted order, the same for K and Q, in which each
  thread's 32 values of a key row are 32 contiguous bytes: d = 32t + 4s + 2h + p is the MMA's
  k = 16s + 8h + 2t + p (t the thread in its lane quad, s the k16 step).
- Output: O^T += V^T P^T: V^T the A operand (128 d rows x 16 keys), P^T the B operand, P from the
  scores' accumulator (a transpose within 8 x 8 blocks). O^T's rows are d permuted so that each
  thread reads 16 contiguous bytes of each of its four key rows: d = 16g + 2i + e is row
  16i + 8e + g (g the lane quad); the store puts them back.
- e4m3 -> f16 in inline PTX, a word (4 values) in two `cvt.rn.f16x2.e4m3x2`.
- The pace is set by how many warps an SM holds, not by how far ahead each loads: the next page's
  bytes and scales travel by cp.async into a two-page ring in shared memory (a thread copies the
  bytes it will read, so a page waits on `cp.async.wait_group` and one barrier that frees the
  slot), which leaves the registers to 128 a thread (the launch caps them): four programs an SM,
  where the same prefetch held in registers needed 168 and fit three. Deeper rings, or three
  programs with more registers, were slower (BENCHMARKS.md, "Tried and did not pay").
Splits (attention.py's FP8_GLUON_MAX_SPLITS at most): each a multiple of the warps' 4 pages, so the
late splits of short contexts may be empty (they store l = 0, as the Triton kernel's do).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp_async
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# The CTA-wide barrier is gl.thread_barrier in Triton 3.6 (the GPU machine's) and gl.barrier in later
# releases: the store of the new row compiles with either.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# cp.async from global to shared memory: async_copy_global_to_shared in Triton 3.6, async_load later.
_copy_to_shared = getattr(cp_async, "async_load", None) or cp_async.async_copy_global_to_shared

HEAD_DIM = gl.constexpr(128)
PAGE = gl.constexpr(16)    # keys per cache block: one MMA tile of keys
MAX_GROUP = 8              # query heads per KV head: the B operand's 8 columns
NUM_WARPS = 4
MAX_REGISTERS = 128        # four programs of 4 warps an SM
STAGES = gl.constexpr(2)   # pages a warp holds in shared memory: STAGES - 1 in flight beside the one in use
# A page's rows are 128 bytes: 16-byte chunks XOR-swizzled by row so that the 8 rows a load
# instruction touches fall in distinct banks.
WORDS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(4, 1, 8, [2, 1, 0]))
SCALES_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))


@gluon.constexpr_function
def _warps(num_warps):
    return [[1 << i, 0, 0] for i in range(num_warps.bit_length() - 1)]


@gluon.constexpr_function
def k_words_layout(num_warps):
    """[W, 16 keys, 32 words of 4 d]: warp w's page; thread (g, t) keys g and g + 8, words 8t .. 8t + 7."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 8, 0]],
        lane_bases=[[0, 0, 8], [0, 0, 16], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=_warps(num_warps), block_bases=[], shape=[num_warps, 16, 32])


@gluon.constexpr_function
def v_words_layout(num_warps):
    """[W, 16 keys, 32 words]: thread (g, t) keys 2t, 2t + 1, 2t + 8, 2t + 9, words 4g .. 4g + 3."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 8, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
        warp_bases=_warps(num_warps), block_bases=[], shape=[num_warps, 16, 32])


@gluon.constexpr_function
def q_layout(num_warps):
    """[W, 8 heads, 128 d]: thread (g, t) head g, d 32t .. 32t + 31; every warp the same."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
        lane_bases=[[0, 0, 32], [0, 0, 64], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=_warps(num_warps), block_bases=[], shape=[num_warps, 8, 128])


_E4M3_WORD_ASM = gl.constexpr(
    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")


@gluon.jit
def _e4m3_words(words, W: gl.constexpr):
    """[W, 16, 32] words of 4 e4m3 values -> [W, 16, 128] f16 (byte j of word i is element 4i + j)."""
    x = gl.join(words, words)
    x = gl.join(x, x)
    f = gl.inline_asm_elementwise(_E4M3_WORD_ASM, "=r,=r,r,r,r,r", [x], dtype=gl.float16, is_pure=True,
                                  pack=4)
    return f.reshape(W, 16, 128)


@gluon.jit
def _dot_order(x, W: gl.constexpr, R: gl.constexpr):
    """[W, R, 128] in d order -> the score dot's k order (d = 32t + 4s + 2h + p is k = 16s + 8h + 2t + p)."""
    return x.reshape(W, R, 4, 8, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(W, R, 128)


@gluon.jit
def _row_order(x, W: gl.constexpr):
    """[W, 16, 128] in d order -> O^T's row order (d = 16g + 2i + e is row 16i + 8e + g)."""
    return x.reshape(W, 16, 8, 8, 2).permute(0, 1, 3, 4, 2).reshape(W, 16, 128)


@gluon.jit
def _page_ids(table_ptr, first, end, layout: gl.constexpr):
    """The cache blocks of pages first + w of a sequence (w the warp), [W] int64 in `layout` (a
    slice to [W]); 0 for pages at or past `end`, whose loads are masked."""
    W: gl.constexpr = gl.num_warps()
    idx = first + gl.arange(0, W, layout=layout)
    return gl.load(table_ptr + idx, mask=idx * PAGE < end, other=0).to(gl.int64)


@gluon.jit
def _copy_page_words(dst, cache_ptr, page, first, end, kv_head, stride_wb, stride_wr,
                     layout: gl.constexpr):
    """Asynchronous copies of pages first + w (blocks `page`, [W] int64 in a slice of `layout`) into
    the shared [W, 16, 32] words `dst`, each thread the bytes it later reads; keys at or past `end`
    land as 0 (every value the MMA sees is finite)."""
    W: gl.constexpr = gl.num_warps()
    w = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    r = gl.arange(0, PAGE, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    c = gl.arange(0, HEAD_DIM // 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    words = cache_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    offs = (page[:, None, None] * stride_wb + r[None, :, None] * stride_wr + kv_head * (HEAD_DIM // 4)
            + c[None, None, :])
    key = (first + w)[:, None] * PAGE + r[None, :]
    _copy_to_shared(dst, words + offs, mask=(key < end)[:, :, None], cache_modifier=".cg")


@gluon.jit
def _copy_page_scales(dst, scale_ptr, page, first, end, kv_head, stride_sb, stride_sr,
                      layout: gl.constexpr):
    """The same pages' row scales into the shared [W, 16] `dst`, 0 past `end`."""
    W: gl.constexpr = gl.num_warps()
    w = gl.arange(0, W, layout=gl.SliceLayout(1, layout))
    r = gl.arange(0, PAGE, layout=gl.SliceLayout(0, layout))
    key = (first + w)[:, None] * PAGE + r[None, :]
    _copy_to_shared(
        dst, scale_ptr + page[:, None] * stride_sb + r[None, :] * stride_sr + kv_head, mask=key < end)


@gluon.jit
def _copy_pages(k_dst, v_dst, ks_dst, vs_dst, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table,
                page, first, end, kv_head, stride_wb, stride_wr, stride_sb, stride_sr,
                kl: gl.constexpr, vl: gl.constexpr, sl: gl.constexpr):
    """Pages first + w (blocks `page`, [W] in a slice of kl) into one slot of the four rings, as one
    cp.async group; returns the blocks of the pages W further on, read now so that their copies
    need not wait for them. Every lane of warp w holds block w in each of the three layouts, so one
    load serves them all and the conversions move no data."""
    W: gl.constexpr = gl.num_warps()
    vp = gl.convert_layout(page, gl.SliceLayout(1, gl.SliceLayout(2, vl)), assert_trivial=True)
    sp = gl.convert_layout(page, gl.SliceLayout(1, sl), assert_trivial=True)
    _copy_page_words(k_dst, k_cache_ptr, page, first, end, kv_head, stride_wb, stride_wr, kl)
    _copy_page_words(v_dst, v_cache_ptr, vp, first, end, kv_head, stride_wb, stride_wr, vl)
    _copy_page_scales(ks_dst, k_scale_ptr, sp, first, end, kv_head, stride_sb, stride_sr, sl)
    _copy_page_scales(vs_dst, v_scale_ptr, sp, first, end, kv_head, stride_sb, stride_sr, sl)
    cp_async.commit_group()
    return _page_ids(table, first + W, end, gl.SliceLayout(1, gl.SliceLayout(2, kl)))


@gluon.jit
def _rope_cos_sin(pos, inv_freq_ptr, j):
    """engine/kernels/rope.py's rope_cos_sin, operation for operation (the same bits): cos and sin
    of pos * inv_freq[j], the angle reduced to [-pi, pi] with 2*pi in three parts."""
    angle = pos.to(gl.float32) * gl.load(inv_freq_ptr + j)
    turns = gl.floor(angle * 0.15915494309189535 + 0.5)
    reduced = gl.fma(-turns, 6.28125, angle)
    reduced = gl.fma(-turns, 0.0019353071693331003, reduced)
    reduced = gl.fma(-turns, 1.0253131677018246e-11, reduced)
    return gl.cos(reduced), gl.sin(reduced)


@gluon.jit
def _rotate(x_ptr, d, cos, sin):
    """A head row (or rows) at columns d rotated as rope.py's kernel rotates it, in fp32 (cos and sin
    of the columns' angles, broadcast alike)."""
    HALF: gl.constexpr = HEAD_DIM // 2
    first = d < HALF
    x = gl.load(x_ptr + d).to(gl.float32)
    xp = gl.load(x_ptr + gl.where(first, d + HALF, d - HALF)).to(gl.float32)
    return gl.where(first, x * cos - xp * sin, x * cos + xp * sin)


@gluon.jit
def _store_row(cache_ptr, scale_ptr, row, x, d, dtype: gl.constexpr):
    """One head row x (fp32) stored at element `row` of the cache as rope.py's kernel stores it:
    rounded to the model's dtype, then e4m3 with its scale amax / 448 (1 for a zero row), saturated at
    +-448 (max and min: Triton 3.6's Gluon has no clamp)."""
    xf = x.to(dtype).to(gl.float32)
    amax = gl.max(gl.abs(xf), axis=0)
    sc = gl.where(amax > 0, amax / 448.0, 1.0)
    gl.store(scale_ptr + row // HEAD_DIM, sc)
    gl.store(cache_ptr + row + d, gl.minimum(gl.maximum(xf / sc, -448.0), 448.0).to(gl.float8e4nv))


@gluon.jit(do_not_specialize=["bt_stride", "num_splits"],
           do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr"])
def fp8_cache_decode_kernel(q_ptr, k_ptr, v_ptr, inv_freq_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                            v_scale_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_acc_ptr,
                            part_max_ptr, part_sum_ptr, scale_log2e, stride_qb, stride_qh, stride_kb,
                            stride_kh, stride_vb, stride_vh, stride_wb, stride_wr, stride_sb, stride_sr,
                            bt_stride, n_heads, num_splits, GROUP: gl.constexpr, ROPE: gl.constexpr):
    """Program (KV head, sequence, split). Cache strides in 32-bit words (stride_wb, stride_wr: a
    block, a row) and scale elements (stride_sb, stride_sr); out [B, n_heads, 128] where
    num_splits == 1, else the split's running max (exp2 domain), sum and output to the part_*
    buffers for the merge kernel."""
    W: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1],
                                                  instr_shape=[1, 16, 8])
    kl: gl.constexpr = k_words_layout(W)
    vl: gl.constexpr = v_words_layout(W)
    ql: gl.constexpr = q_layout(W)
    keys_l: gl.constexpr = gl.SliceLayout(2, mma)     # [W, 16 keys]
    heads_l: gl.constexpr = gl.SliceLayout(1, mma)    # [W, 8 heads]
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    kv_head = gl.program_id(0)
    seq = gl.program_id(1).to(gl.int64)
    split = gl.program_id(2)
    ctx = gl.load(context_lens_ptr + seq)
    split_len = gl.cdiv(gl.cdiv(ctx, num_splits), PAGE * W) * (PAGE * W)
    start = split * split_len
    end = gl.minimum(ctx, start + split_len)
    table = block_tables_ptr + seq * bt_stride

    wq = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, ql)))
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, ql)))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(1, ql)))
    head = gl.minimum(kv_head * GROUP + g, kv_head * GROUP + GROUP - 1)   # padding columns: a real head, unused
    q_rows = q_ptr + seq * stride_qb + head[None, :, None] * stride_qh + (wq * 0)[:, None, None]
    if ROPE:
        # the row's token is the context's last, at position ctx - 1; the split that holds it
        # stores its k and v in the cache and reads them back in its loop. cos and sin once per
        # column (a column a thread), then to the columns q's layout repeats
        HALF: gl.constexpr = HEAD_DIM // 2
        pos = ctx - 1
        row_l: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        dr = gl.arange(0, HEAD_DIM, layout=row_l)
        cos, sin = _rope_cos_sin(pos, inv_freq_ptr, gl.where(dr < HALF, dr, dr - HALF))
        d_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, ql))
        q = _rotate(q_rows, d[None, None, :], gl.convert_layout(cos, d_l)[None, None, :],
                    gl.convert_layout(sin, d_l)[None, None, :]).to(dtype)
        if pos >= start:
            page = gl.load(table + pos // PAGE).to(gl.int64)
            row = (page * stride_wb + (pos % PAGE) * stride_wr) * 4 + kv_head * HEAD_DIM
            k = _rotate(k_ptr + seq * stride_kb + kv_head * stride_kh, dr, cos, sin)
            v = gl.load(v_ptr + seq * stride_vb + kv_head * stride_vh + dr).to(gl.float32)
            _store_row(k_cache_ptr, k_scale_ptr, row, k, dr, dtype)
            _store_row(v_cache_ptr, v_scale_ptr, row, v, dr, dtype)
            _cta_barrier()    # every warp sees the row before its loop reads it
    else:
        q = gl.load(q_rows + d[None, None, :])
    q = _dot_order(q.to(gl.float32).to(gl.float16), W, 8).permute(0, 2, 1)
    q_op = gl.convert_layout(q, gl.DotOperandLayout(1, mma, 2))

    m = gl.full([W, 8], float("-inf"), gl.float32, layout=heads_l)
    l = gl.zeros([W, 8], gl.float32, layout=heads_l)
    acc = gl.zeros([W, HEAD_DIM, 8], gl.float32, layout=mma)
    wi = gl.arange(0, W, layout=gl.SliceLayout(1, keys_l))
    ri = gl.arange(0, PAGE, layout=gl.SliceLayout(0, keys_l))
    # A ring of STAGES pages a warp in shared memory, filled by cp.async STAGES - 1 pages ahead of
    # the math (_copy_pages).
    k_ring = gl.allocate_shared_memory(gl.int32, [STAGES, W, PAGE, HEAD_DIM // 4], WORDS_SMEM)
    v_ring = gl.allocate_shared_memory(gl.int32, [STAGES, W, PAGE, HEAD_DIM // 4], WORDS_SMEM)
    ks_ring = gl.allocate_shared_memory(gl.float32, [STAGES, W, PAGE], SCALES_SMEM)
    vs_ring = gl.allocate_shared_memory(gl.float32, [STAGES, W, PAGE], SCALES_SMEM)
    first = start // PAGE
    page = _page_ids(table, first, end, gl.SliceLayout(1, gl.SliceLayout(2, kl)))
    for i in gl.static_range(STAGES - 1):
        page = _copy_pages(k_ring.index(i), v_ring.index(i), ks_ring.index(i), vs_ring.index(i), k_cache_ptr,
                           v_cache_ptr, k_scale_ptr, v_scale_ptr, table, page, first + i * W, end,
                           kv_head, stride_wb, stride_wr, stride_sb, stride_sr, kl, vl, keys_l)
    for j in range(gl.cdiv(gl.cdiv(end - start, PAGE), W)):
        pj = first + j * W
        # page j's copies are done, and every thread is past page j - 1's reads: its slot is free
        cp_async.wait_group(STAGES - 2)
        _cta_barrier()
        slot = (j + STAGES - 1) % STAGES
        page = _copy_pages(k_ring.index(slot), v_ring.index(slot), ks_ring.index(slot), vs_ring.index(slot),
                           k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table, page,
                           pj + (STAGES - 1) * W, end, kv_head, stride_wb, stride_wr, stride_sb, stride_sr,
                           kl, vl, keys_l)

        k_words = k_ring.index(j % STAGES).load(kl)
        v_words = v_ring.index(j % STAGES).load(vl)
        ks = ks_ring.index(j % STAGES).load(keys_l)
        vs = vs_ring.index(j % STAGES).load(keys_l)
        k_op = gl.convert_layout(_dot_order(_e4m3_words(k_words, W), W, 16), gl.DotOperandLayout(0, mma, 2))
        s = mma_v2(k_op, q_op, gl.zeros([W, 16, 8], gl.float32, layout=mma))
        s = s * (ks * scale_log2e)[:, :, None]
        valid = ((pj + wi)[:, None] * PAGE + ri[None, :]) < end
        s = gl.where(valid[:, :, None], s, float("-inf"))
        # online softmax in the exp2 domain; a warp's page past the end leaves its state as it was
        m_new = gl.maximum(m, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_use)
        p = gl.exp2(s - m_use[:, None, :])
        l = l * alpha + gl.sum(p, axis=1)
        # value scales on the probabilities, in fp16 relative to the page's largest
        v_max = gl.max(vs, axis=1)
        v_max = gl.where(v_max > 0, v_max, 1.0)
        p = p * (vs / v_max[:, None])[:, :, None]
        p_op = gl.convert_layout(p.to(gl.float16), gl.DotOperandLayout(1, mma, 2))
        vt = _row_order(_e4m3_words(v_words, W), W).permute(0, 2, 1)
        v_op = gl.convert_layout(vt, gl.DotOperandLayout(0, mma, 2))
        o = mma_v2(v_op, p_op, gl.zeros([W, HEAD_DIM, 8], gl.float32, layout=mma))
        acc = acc * alpha[:, None, :] + o * v_max[:, None, None]
        m = m_new
    # the last copies (pages past the end, zero-filled) land before the merge's scratch, which may
    # reuse the ring's memory, and before the program ends
    cp_async.wait_group(0)

    # the warps' softmaxes merge
    top = gl.max(m, axis=0)
    top_use = gl.where(top == float("-inf"), 0.0, top)
    weight = gl.exp2(m - top_use[None, :])
    total_l = gl.sum(l * weight, axis=0)
    total = gl.sum(acc * weight[:, None, :], axis=0)                 # [128 rows of O^T, 8 heads]
    out_l: gl.constexpr = total.type.layout
    rows = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, out_l))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, out_l))
    d_out = (rows % 8) * 16 + (rows // 16) * 2 + (rows // 8) % 2       # O^T's rows back in d order
    is_head = cols < GROUP
    heads = seq * n_heads + kv_head * GROUP + cols
    sums = gl.convert_layout(total_l, gl.SliceLayout(0, out_l))
    if num_splits == 1:
        gl.store(out_ptr + heads[None, :] * HEAD_DIM + d_out[:, None],
                 (total / sums[None, :]).to(out_ptr.dtype.element_ty), mask=is_head[None, :])
    else:
        hl: gl.constexpr = top.type.layout
        h = gl.arange(0, 8, layout=hl)
        part_h = (seq * n_heads + kv_head * GROUP + h) * num_splits + split
        gl.store(part_max_ptr + part_h, top, mask=h < GROUP)
        gl.store(part_sum_ptr + part_h, total_l, mask=h < GROUP)
        part = heads * num_splits + split
        gl.store(part_acc_ptr + part[None, :] * HEAD_DIM + d_out[:, None], total,
                 mask=(is_head & (sums > 0))[None, :])    # an empty split writes no acc
