"""A decode step's inputs into its CUDA graph's static buffers, in one launch.

`stage_decode_inputs(dst, src, rows, scratch_slot, scratch_block)`: dst and src are
(input_ids int64, positions int64, slot_mapping int64, context_lens int32, block_tables int32 2-D)
with unit stride along each row. src holds the step's n sequences (block tables [n, width], width
<= dst's); dst the graph's buffers, at least `rows` (the graph's batch bucket) long. Rows < n take
src's values (the block tables' first `width` columns); rows n..rows-1, left by an earlier, larger
step, are pointed at the scratch KV block that no sequence owns: slot `scratch_slot`, context
length 1, every block-table entry `scratch_block` (their token ids and positions stay as they were).
`stage_decode_inputs_ref` is the same in torch ops, eight launches.

Why a kernel: outside the graph these copies and fills are the step's only work besides sampling,
each a launch of a few microseconds at batch 1 (BENCHMARKS.md, "Where a decode step's GPU time
goes"). One program a row; every size is a run-time argument, so one binary serves every step and
is compiled before serving (`stage_decode_inputs` on the graphs' own buffers at capture).
Triton on CUDA tensors (or everywhere under TRITON_INTERPRET=1), the reference otherwise.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference runs
    triton = None

from engine.kernels.platform import jit, triton_runs

TABLE_CHUNK = 256   # block-table entries a program moves at a time


def stage_decode_inputs_ref(dst, src, rows: int, scratch_slot: int, scratch_block: int) -> None:
    ids, pos, slots, ctx, tables = dst
    n, width = src[4].shape
    for d, s in zip((ids, pos, slots, ctx), src[:4]):
        d[:n].copy_(s, non_blocking=True)
    tables[:n, :width].copy_(src[4], non_blocking=True)
    slots[n:rows].fill_(scratch_slot)
    ctx[n:rows].fill_(1)
    tables[n:rows].fill_(scratch_block)


@jit(do_not_specialize=["n", "width", "src_stride", "scratch_slot", "scratch_block"],
     do_not_specialize_on_alignment=["src_ids", "src_pos", "src_slots", "src_ctx", "src_tables"])
def _stage_kernel(src_ids, src_pos, src_slots, src_ctx, src_tables, src_stride,
                  dst_ids, dst_pos, dst_slots, dst_ctx, dst_tables, dst_stride, dst_width,
                  n, width, scratch_slot, scratch_block, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, CHUNK)
    if row < n:
        tl.store(dst_ids + row, tl.load(src_ids + row))
        tl.store(dst_pos + row, tl.load(src_pos + row))
        tl.store(dst_slots + row, tl.load(src_slots + row))
        tl.store(dst_ctx + row, tl.load(src_ctx + row))
        for c0 in range(0, width, CHUNK):
            c = c0 + cols
            entries = tl.load(src_tables + row * src_stride + c, mask=c < width)
            tl.store(dst_tables + row * dst_stride + c, entries, mask=c < width)
    else:
        tl.store(dst_slots + row, scratch_slot.to(tl.int64))
        tl.store(dst_ctx + row, 1)
        scratch = tl.full([CHUNK], 0, tl.int32) + scratch_block
        for c0 in range(0, dst_width, CHUNK):
            c = c0 + cols
            tl.store(dst_tables + row * dst_stride + c, scratch, mask=c < dst_width)


def stage_decode_inputs(dst, src, rows: int, scratch_slot: int, scratch_block: int) -> None:
    """The module docstring's contract, on the kernel where Triton runs."""
    ids, pos, slots, ctx, tables = dst
    n, width = src[4].shape
    if not n <= rows <= ids.shape[0] or width > tables.shape[1] or any(s.shape[0] != n for s in src):
        raise ValueError(f"stage_decode_inputs: {n} rows of width {width} into {rows} of "
                         f"{tuple(tables.shape)} buffers")
    if not triton_runs(ids):
        return stage_decode_inputs_ref(dst, src, rows, scratch_slot, scratch_block)
    if any(t.stride(-1) != 1 for t in (*dst, *src)):
        raise ValueError("stage_decode_inputs: unit stride along each row is needed")
    _stage_kernel[(rows,)](*src, src[4].stride(0), *dst, tables.stride(0), tables.shape[1],
                           n, width, scratch_slot, scratch_block, CHUNK=TABLE_CHUNK, num_warps=1)
