"""One step's inputs: the scheduled sequences packed into flat token rows, with no padding.

Prefill chunks come first, back to back, described by their offsets (cu_seqlens): attention views
its q/k/v rows over those offsets as jagged nested tensors (layout=torch.jagged), so variable-length
prompts need no padding. Decodes (one token per sequence) follow, with their block tables and
context lengths. Every tensor is built on the host in one go and copied to the device once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.scheduler import ScheduledSeq


@dataclass
class Batch:
    input_ids: torch.Tensor              # [T] int64: prefill rows, then decode rows
    positions: torch.Tensor              # [T] int64
    slot_mapping: torch.Tensor | None    # [T] int64: where each row's K/V goes in the paged cache
    kv_cache: object | None              # engine.memory.kv_cache.KVCache, or None (no cache kept)
    num_prefills: int
    num_prefill_tokens: int
    prefill_offsets: torch.Tensor        # [P + 1] int64 cu_seqlens of the prefill chunks (jagged offsets)
    prefill_context_lens: torch.Tensor   # [P] int32: cached prefix + this chunk
    prefill_block_tables: torch.Tensor | None  # [P, max_blocks] int32
    prefill_has_prefix: bool             # any chunk attends to keys computed in an earlier step
    num_decodes: int
    decode_context_lens: torch.Tensor | None   # [D] int32
    decode_block_tables: torch.Tensor | None   # [D, max_blocks] int32
    logits_indices: torch.Tensor         # rows whose logits are sampled, in `sampled` order
    sampled: list[ScheduledSeq]          # the sequences that get a new token this step

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def _table(rows, width):
    return [r + [0] * (width - len(r)) for r in rows]


def build_batch(scheduled: list[ScheduledSeq], kv_cache, device) -> Batch:
    prefills = [s for s in scheduled if s.num_tokens > 1]
    decodes = [s for s in scheduled if s.num_tokens == 1]
    bs = kv_cache.block_size
    ids, pos, slots, offsets, ctx, logit_rows, sampled = [], [], [], [0], [], [], []
    for item in prefills + decodes:
        seq, start, n = item.seq, item.start, item.num_tokens
        ids += seq.tokens(start, start + n)
        pos += range(start, start + n)
        table = seq.block_table
        slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        offsets.append(offsets[-1] + n)
        ctx.append(start + n)
        if item.samples:
            logit_rows.append(len(ids) - 1)
            sampled.append(item)
    np_ = len(prefills)
    width = max(len(s.seq.block_table) for s in scheduled)
    tables = _table([s.seq.block_table for s in prefills + decodes], width)
    pin = device.type == "cuda"

    def dev(data, dtype):
        t = torch.tensor(data, dtype=dtype, pin_memory=pin)
        return t.to(device, non_blocking=True)

    input_ids = dev(ids, torch.int64)
    table_t = dev(tables, torch.int32)
    ctx_t = dev(ctx, torch.int32)
    return Batch(
        input_ids=input_ids, positions=dev(pos, torch.int64), slot_mapping=dev(slots, torch.int64),
        kv_cache=kv_cache, num_prefills=np_, num_prefill_tokens=offsets[np_],
        prefill_offsets=dev(offsets[:np_ + 1], torch.int64),
        prefill_context_lens=ctx_t[:np_], prefill_block_tables=table_t[:np_],
        prefill_has_prefix=any(s.start > 0 for s in prefills),
        num_decodes=len(decodes), decode_context_lens=ctx_t[np_:], decode_block_tables=table_t[np_:],
        logits_indices=dev(logit_rows, torch.int64), sampled=sampled)


def build_prefill_only(token_lists: list[list[int]], device) -> Batch:
    """Whole sequences with no KV cache kept: for scoring (all-position logits) and embeddings."""
    ids = [t for toks in token_lists for t in toks]
    pos = [p for toks in token_lists for p in range(len(toks))]
    offsets = [0]
    for toks in token_lists:
        offsets.append(offsets[-1] + len(toks))
    input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    off = torch.tensor(offsets, dtype=torch.int64, device=device)
    ctx = torch.tensor([len(t) for t in token_lists], dtype=torch.int32, device=device)
    return Batch(
        input_ids=input_ids, positions=torch.tensor(pos, dtype=torch.int64, device=device),
        slot_mapping=None, kv_cache=None, num_prefills=len(token_lists), num_prefill_tokens=len(ids),
        prefill_offsets=off,
        prefill_context_lens=ctx, prefill_block_tables=None, prefill_has_prefix=False,
        num_decodes=0, decode_context_lens=None, decode_block_tables=None,
        logits_indices=torch.arange(len(ids), device=device), sampled=[])
