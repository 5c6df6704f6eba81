"""CUDA graphs for decode steps: one launch per step instead of a few hundred.

A decode step at batch B runs ~10 small kernels per layer; at small B each takes microseconds, so
launch overhead and Python dominate. We capture the forward (embedding to logits) once per batch-size
bucket over static input buffers and replay it. A step's rows are copied into the buffers; rows past
B (up to the bucket) point at a scratch KV block that no sequence owns, and their logits are ignored.
"""
from __future__ import annotations

import torch

from engine.batch import Batch
from engine.kernels.platform import capture

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model, kv_cache, max_batch: int, max_blocks_per_seq: int, scratch_block: int):
        self.model, self.kv_cache = model, kv_cache
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_batch = max_batch
        dev = model.embed_tokens.weight.device
        bs = kv_cache.block_size
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), scratch_block * bs, dtype=torch.int64, device=dev)
        self.block_tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.scratch_slot = scratch_block * bs
        self.scratch_block = scratch_block
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _batch(self, b: int) -> Batch:
        empty = self.positions[:0]
        return Batch(input_ids=self.input_ids[:b], positions=self.positions[:b],
                     slot_mapping=self.slot_mapping[:b], kv_cache=self.kv_cache, num_prefills=0,
                     num_prefill_tokens=0, prefill_offsets=self.context_lens[:1], prefill_max_len=0,
                     prefill_context_lens=self.context_lens[:0], prefill_block_tables=self.block_tables[:0],
                     prefill_max_prefix=0, num_decodes=b, decode_context_lens=self.context_lens[:b],
                     decode_block_tables=self.block_tables[:b], logits_indices=empty, sampled=[])

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so smaller graphs reuse its memory pool.
        dev = self.input_ids.device
        for b in sorted(self.buckets, reverse=True):
            batch = self._batch(b)
            for _ in range(2):   # warm up: Triton autotuning and lazy inits happen outside the graph
                self.model.compute_logits(self.model(batch.input_ids, batch.positions, batch))
            torch.cuda.synchronize()
            # The output is allocated outside the graph (engine/kernels/platform.capture says why).
            self.logits[b] = torch.empty(b, self.model.config.vocab_size, dtype=torch.float32, device=dev)
            graph = torch.cuda.CUDAGraph()
            with capture(graph, pool=self.pool):
                self.model.compute_logits(self.model(batch.input_ids, batch.positions, batch), out=self.logits[b])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Replay the graph for a pure-decode batch; returns the logits of its rows [B, vocab]."""
        n = batch.num_decodes
        b = self.bucket(n)
        width = batch.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.context_lens[:n].copy_(batch.decode_context_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(batch.decode_block_tables, non_blocking=True)
        # Rows n..b were left by an earlier, larger step: point them back at the scratch block.
        self.slot_mapping[n:b].fill_(self.scratch_slot)
        self.context_lens[n:b].fill_(1)
        self.block_tables[n:b].fill_(self.scratch_block)
        self.graphs[b].replay()
        return self.logits[b][:n]
