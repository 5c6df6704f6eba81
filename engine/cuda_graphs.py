"""CUDA graphs for the engine's steps: a few launches per step instead of a few hundred.

- `DecodeGraphs`, pure decode steps: at small batches each of a layer's ~10 kernels takes
  microseconds, so launches and Python dominate. The whole forward (embedding to logits) is captured
  once per batch-size bucket over static input buffers and replayed. A step's rows are copied into
  the buffers; rows past B (up to the bucket) point at a scratch KV block that no sequence owns, and
  their logits are ignored.
- `StepGraphs`, every other step (prefill chunks, alone or beside decodes) up to the step's token
  budget: the forward in pieces, one per gap between attentions (embedding, norm, qkv, RoPE and the
  KV store before layer 0's attention; o_proj, the MLP and the next layer's norm, qkv and RoPE between
  two attentions; the final norm after the last), each captured once per token-count bucket. The
  attention itself runs eagerly between the pieces, on the step's real rows: its launch depends on
  the step's layout (prompt lengths, which rows decode), which a graph cannot take. So a step costs
  the host ~2 launches a layer instead of ~15, and no per-call library set-up (cuSPARSELt builds its
  plan on every eager call). Pieces hand each other the rotated q/k/v, the residual stream and the
  attention output through static buffers that every bucket shares; rows past T compute on stale
  but finite rows (every op is row-wise) and store their K/V in the scratch block.
Both share one memory pool: only one graph runs at a time, and no graph's intermediates outlive it.
"""
from __future__ import annotations

import bisect

import torch

from engine.batch import Batch
from engine.kernels.decode_inputs import stage_decode_inputs
from engine.kernels.platform import capture

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def token_buckets(max_tokens: int) -> list[int]:
    """The step graphs' token counts: 16 to 512 in steps of at most 64, then eight per octave, so a
    large step pads by at most 1/8 (none at the budget itself), up to max_tokens."""
    out = [16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    lo = 512
    while lo < max_tokens:
        out += [lo + lo // 8 * j for j in range(1, 9)]
        lo *= 2
    return [b for b in out if b < max_tokens] + [max_tokens]


def smallest_at_least(buckets: list[int], n: int) -> int | None:
    """The smallest of the sorted `buckets` that holds n rows (None: n is past the largest)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class DecodeGraphs:
    def __init__(self, model, kv_cache, max_batch: int, max_blocks_per_seq: int, scratch_block: int,
                 pool=None):
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
        self.pool = pool

    def _batch(self, b: int) -> Batch:
        empty = self.positions[:0]
        return Batch(input_ids=self.input_ids[:b], positions=self.positions[:b],
                     slot_mapping=self.slot_mapping[:b], kv_cache=self.kv_cache, num_prefills=0,
                     num_prefill_tokens=0, prefill_offsets=self.context_lens[:1], prefill_max_len=0,
                     prefill_context_lens=self.context_lens[:0], prefill_block_tables=self.block_tables[:0],
                     prefill_max_prefix=0, num_decodes=b, decode_context_lens=self.context_lens[:b],
                     decode_block_tables=self.block_tables[:b], logits_indices=empty, sampled=[])

    def _buffers(self) -> tuple:
        return self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.block_tables

    @torch.inference_mode()
    def capture(self) -> None:
        # The input staging kernel's one binary, compiled now rather than at the first decode step.
        stage_decode_inputs(self._buffers(), tuple(t[:1] for t in self._buffers()), 1, self.scratch_slot,
                            self.scratch_block)
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
        return smallest_at_least(self.buckets, n)

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Replay the graph for a pure-decode batch; returns the logits of its rows [B, vocab]."""
        n = batch.num_decodes
        b = self.bucket(n)
        # The rows into the static buffers; rows n..b, left by an earlier, larger step, back to the
        # scratch block. One launch (engine/kernels/decode_inputs.py).
        stage_decode_inputs(self._buffers(), (batch.input_ids, batch.positions, batch.slot_mapping,
                                              batch.decode_context_lens, batch.decode_block_tables),
                            b, self.scratch_slot, self.scratch_block)
        self.graphs[b].replay()
        return self.logits[b][:n]


class StepGraphs:
    """The piecewise graphs of prefill and mixed steps (module docstring). `run(batch)` gives the
    final-norm hidden states of a step of up to `max_tokens` rows; `capture()` records the pieces
    (CUDA), `trace()` makes each piece a plain call instead (the same buffers and order, for a check
    of the layout on any device)."""

    def __init__(self, model, kv_cache, max_tokens: int, scratch_block: int, pool=None):
        self.model, self.kv_cache = model, kv_cache
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = max_tokens
        attn = model.layers[0].self_attn
        weight = model.embed_tokens.weight
        dev, dtype, n = weight.device, weight.dtype, self.buckets[-1]
        self.scratch_slot = scratch_block * kv_cache.block_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=dev)
        self.qkv = torch.zeros(n, attn.q_size + 2 * attn.kv_size, dtype=dtype, device=dev)
        self.attn_out = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, device=dev)
        self.residual = torch.zeros(n, weight.shape[1], dtype=dtype, device=dev)
        self.hidden = torch.zeros(n, weight.shape[1], dtype=dtype, device=dev)
        self.pieces: dict[int, list] = {}     # bucket -> piece i's replay (or call)
        self.pool = pool

    def _batch(self, t: int) -> Batch:
        """What the pieces read of a step: its rows' positions and KV slots, in the static buffers."""
        empty = self.positions[:0]
        return Batch(input_ids=self.input_ids[:t], positions=self.positions[:t],
                     slot_mapping=self.slot_mapping[:t], kv_cache=self.kv_cache, num_prefills=0,
                     num_prefill_tokens=t, prefill_offsets=empty, prefill_max_len=0,
                     prefill_context_lens=empty, prefill_block_tables=None, prefill_max_prefix=0,
                     num_decodes=0, decode_context_lens=None, decode_block_tables=None,
                     logits_indices=empty, sampled=[])

    def _piece(self, i: int, t: int, batch: Batch) -> None:
        """Piece i (0 .. layers) of a step of t rows: what runs between attention i - 1 and attention i."""
        m = self.model
        if i == 0:
            x, residual = m.embed_tokens(self.input_ids[:t]), None
        else:
            nxt = m.layers[i] if i < len(m.layers) else None
            x, residual = m.layers[i - 1].after_attention(self.attn_out[:t], self.residual[:t], nxt)
        if i < len(m.layers):
            m.layers[i].attention_inputs(x, residual, self.positions[:t], batch, m.inv_freq,
                                         self.qkv[:t], self.residual[:t])
        else:
            m.norm(x, residual, out=self.hidden[:t])

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so smaller buckets reuse its memory.
        pieces = range(len(self.model.layers) + 1)
        for t in sorted(self.buckets, reverse=True):
            batch = self._batch(t)
            for i in pieces:    # warm up: lazy inits and kernel compiles happen outside the graph
                self._piece(i, t, batch)
            torch.cuda.synchronize()
            graphs = []
            for i in pieces:
                graph = torch.cuda.CUDAGraph()
                with capture(graph, pool=self.pool):
                    self._piece(i, t, batch)
                if self.pool is None:
                    self.pool = graph.pool()
                graphs.append(graph)
            self.pieces[t] = [g.replay for g in graphs]

    def trace(self) -> None:
        for t in self.buckets:
            batch = self._batch(t)
            self.pieces[t] = [lambda i=i, t=t, batch=batch: self._piece(i, t, batch)
                              for i in range(len(self.model.layers) + 1)]

    def bucket(self, n: int) -> int | None:
        return smallest_at_least(self.buckets, n)

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """The final-norm hidden states [T, hidden] of the step's rows (T <= max_tokens), valid until
        the next run."""
        t = batch.input_ids.shape[0]
        b = self.bucket(t)
        self.input_ids[:t].copy_(batch.input_ids, non_blocking=True)
        self.positions[:t].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:t].copy_(batch.slot_mapping, non_blocking=True)
        # Rows t..b may hold an earlier step's slots: point them back at the scratch block.
        self.slot_mapping[t:b].fill_(self.scratch_slot)
        pieces = self.pieces[b]
        q, k, v = self.model.layers[0].self_attn.split_qkv(self.qkv[:t])    # the layers' shapes are alike
        for i, layer in enumerate(self.model.layers):
            pieces[i]()
            layer.self_attn.attend(q, k, v, batch, None, self.attn_out[:t])
        pieces[-1]()
        return self.hidden[:t]
