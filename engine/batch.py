"""One step's inputs: the scheduled sequences packed into flat token rows, with no padding.

Prefill chunks come first, back to back, described by their offsets (cu_seqlens): attention runs
over the packed rows with those offsets (flash attention's variable-length kernel), so
variable-length prompts need no padding. Decodes (one token per sequence) follow, longest context
first, with their block tables and context lengths.

`plan_batch` lays a step out on the host as plain lists (the engine packs them into a pinned slot and
uploads them in one copy); `BatchPlan.batch` wraps the uploaded tensors as the `Batch` the model
reads. A decode row whose token was sampled by the step still in flight holds PLACEHOLDER on the
host; `fill_rows` / `fill_src` say where to copy it from on the device (that step's token tensor), so
the host never waits for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels.attention import PREFILL_BLOCK_M
from engine.scheduler import ScheduledSeq

PLACEHOLDER = 0     # a token id still on the device; any valid id keeps a missed fill from crashing


@dataclass
class Batch:
    input_ids: torch.Tensor              # [T] int64: prefill rows, then decode rows
    positions: torch.Tensor              # [T] int64
    slot_mapping: torch.Tensor | None    # [T] int64: where each row's K/V goes in the paged cache
    kv_cache: object | None              # engine.memory.kv_cache.KVCache, or None (no cache kept)
    num_prefills: int
    num_prefill_tokens: int
    prefill_offsets: torch.Tensor        # [P + 1] int32 cu_seqlens of the prefill chunks
    prefill_max_len: int                 # the longest chunk, known on the host (never asked of the device)
    prefill_context_lens: torch.Tensor   # [P] int32: cached prefix + this chunk
    prefill_block_tables: torch.Tensor | None  # [P, max_blocks] int32
    prefill_max_prefix: int              # the longest cached prefix a chunk attends to (0: none), from the host
    num_decodes: int
    decode_context_lens: torch.Tensor | None   # [D] int32
    decode_block_tables: torch.Tensor | None   # [D, max_blocks] int32
    logits_indices: torch.Tensor         # rows whose logits are sampled, in `sampled` order
    sampled: list[ScheduledSeq]          # the sequences that get a new token this step
    # [P] int32: the prefill attention kernel's query blocks through chunk i, counted on the host
    # once per step (None: the kernel counts them on the device)
    prefill_block_ends: torch.Tensor | None = None


@dataclass
class BatchPlan:
    fields: dict[str, tuple[list, torch.dtype]]   # every input tensor's host data
    num_prefills: int
    num_prefill_tokens: int
    prefill_max_len: int
    prefill_max_prefix: int
    num_decodes: int
    num_fills: int                       # rows whose token comes from the previous step's samples
    num_sampled: int
    sampled: list[ScheduledSeq]          # (empty on a tensor-parallel worker: it samples nothing)

    def shape(self) -> tuple:
        """Everything but the fields' data and the sequences: what another rank needs (from_shape)."""
        return (self.num_prefills, self.num_prefill_tokens, self.prefill_max_len, self.prefill_max_prefix, self.num_decodes, self.num_fills, self.num_sampled)

    @staticmethod
    def from_shape(shape: tuple) -> "BatchPlan":
        return BatchPlan(None, *shape, sampled=[])

    def batch(self, dev: dict[str, torch.Tensor], kv_cache) -> Batch:
        """The Batch over the uploaded fields (`dev`: name -> device tensor)."""
        p = self.num_prefills
        ctx, tables = dev["context_lens"], dev["block_tables"]
        return Batch(
            input_ids=dev["input_ids"], positions=dev["positions"], slot_mapping=dev["slot_mapping"],
            kv_cache=kv_cache, num_prefills=p, num_prefill_tokens=self.num_prefill_tokens,
            prefill_offsets=dev["prefill_offsets"], prefill_max_len=self.prefill_max_len,
            prefill_context_lens=ctx[:p],
            prefill_block_tables=tables[:p], prefill_max_prefix=self.prefill_max_prefix,
            num_decodes=self.num_decodes, decode_context_lens=ctx[p:], decode_block_tables=tables[p:],
            logits_indices=dev["logits_indices"], sampled=self.sampled,
            prefill_block_ends=dev["prefill_block_ends"])


def query_block_ends(lens: list[int]) -> list[int]:
    """The prefill attention kernel's query blocks through each chunk: running sums of
    ceil(len / PREFILL_BLOCK_M) (Batch.prefill_block_ends)."""
    return np.cumsum([-(-n // PREFILL_BLOCK_M) for n in lens], dtype=np.int64).tolist()


def plan_batch(scheduled: list[ScheduledSeq], block_size: int, pending: dict | None = None) -> BatchPlan:
    """pending: sequence -> row of the in-flight step's sampled tokens that holds its last token."""
    prefills = [s for s in scheduled if s.num_tokens > 1]
    # Decode rows longest context first: the decode attention starts its programs in row order, so
    # the longest start first and the short ones fill the end (no long straggler in a last wave).
    decodes = sorted((s for s in scheduled if s.num_tokens == 1), key=lambda s: s.start, reverse=True)
    bs = block_size
    # Rows as int64 arrays: one per prefill chunk (no Python object per token), then one for all the
    # decode rows, built by scalar arithmetic (cheaper than any array set-up for a single token).
    ids, pos, slots = [], [], []
    dec_ids, dec_pos, dec_slots = [], [], []
    offsets, ctx, logit_rows, sampled, fill_rows, fill_src = [0], [], [], [], [], []
    for item in prefills + decodes:
        seq, start, n = item.seq, item.start, item.num_tokens
        table = seq.block_table
        if n == 1:
            dec_ids += seq.tokens(start, start + 1)
            dec_pos.append(start)
            dec_slots.append(table[start // bs] * bs + start % bs)
        else:
            p = np.arange(start, start + n)
            ids.append(np.asarray(seq.tokens(start, start + n), dtype=np.int64))
            pos.append(p)
            slots.append(np.asarray(table)[p // bs] * bs + p % bs)
        offsets.append(offsets[-1] + n)
        ctx.append(start + n)
        last_row = offsets[-1] - 1
        if pending and seq in pending and start + n == len(seq):
            fill_rows.append(last_row)      # its last token is the one still on the device
            fill_src.append(pending[seq])
        if item.samples:
            logit_rows.append(last_row)
            sampled.append(item)
    ids, pos, slots = (np.concatenate(parts + [np.asarray(dec, dtype=np.int64)])
                       for parts, dec in ((ids, dec_ids), (pos, dec_pos), (slots, dec_slots)))
    np_ = len(prefills)
    width = max(len(s.seq.block_table) for s in scheduled)
    tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in prefills + decodes]
    lens = [s.num_tokens for s in prefills]
    fields = {"input_ids": (ids, torch.int64), "positions": (pos, torch.int64),
              "slot_mapping": (slots, torch.int64), "prefill_offsets": (offsets[:np_ + 1], torch.int32),
              "context_lens": (ctx, torch.int32), "block_tables": (tables, torch.int32),
              "logits_indices": (logit_rows, torch.int64),
              "prefill_block_ends": (query_block_ends(lens), torch.int32)}
    if fill_rows:
        fields["fill_rows"] = (fill_rows, torch.int64)
        fields["fill_src"] = (fill_src, torch.int64)
    return BatchPlan(fields, np_, offsets[np_], max(lens, default=0),
                     max((s.start for s in prefills), default=0), len(decodes), len(fill_rows), len(sampled), sampled)


def build_prefill_only(token_lists: list[list[int]], device) -> Batch:
    """Whole sequences with no KV cache kept: for scoring (all-position logits) and embeddings."""
    ids = [t for toks in token_lists for t in toks]
    pos = [p for toks in token_lists for p in range(len(toks))]
    offsets = [0]
    for toks in token_lists:
        offsets.append(offsets[-1] + len(toks))
    input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    off = torch.tensor(offsets, dtype=torch.int32, device=device)
    ctx = torch.tensor([len(t) for t in token_lists], dtype=torch.int32, device=device)
    lens = [len(t) for t in token_lists]
    return Batch(
        input_ids=input_ids, positions=torch.tensor(pos, dtype=torch.int64, device=device),
        slot_mapping=None, kv_cache=None, num_prefills=len(token_lists), num_prefill_tokens=len(ids),
        prefill_offsets=off, prefill_max_len=max(lens),
        prefill_context_lens=ctx, prefill_block_tables=None, prefill_max_prefix=0,
        num_decodes=0, decode_context_lens=None, decode_block_tables=None,
        logits_indices=torch.arange(len(ids), device=device), sampled=[],
        prefill_block_ends=torch.tensor(query_block_ends(lens), dtype=torch.int32, device=device))
