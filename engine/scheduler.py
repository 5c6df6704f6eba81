"""Continuous batching: which sequences run this step, and how many tokens each.

Every step has a token budget shared by decodes (1 token each) and prefill chunks, so a long prompt is
prefilled a chunk at a time and never stalls the running decodes. Running sequences go first, oldest
first; then waiting ones are admitted strictly first come, first served (no skipping ahead, so no
starvation). When the KV pool runs dry, the newest running sequence is preempted: its blocks are
freed and it goes back to the head of the queue, to be recomputed from its tokens later (recompute
instead of store: no KV is swapped out), never failed.
"""
from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from engine.memory.kv_cache import BlockPool, block_hash
from engine.sampling import SamplingParams


class ContextLengthError(ValueError):
    """A request that can never run within the configured limits."""


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0               # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # prefix hashes of the published blocks
    num_cached_tokens: int | None = None    # prompt tokens served from the prefix cache when first admitted
    num_pending: int = 0                # trailing output tokens sampled but not yet read back
    arrival: int = field(default_factory=lambda: next(_arrival))
    finish_reason: str | None = None

    def __len__(self):
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start, end):
        """Tokens [start, end) of prompt + output, without concatenating the two (a hot path)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int                          # first position computed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so a new token is sampled."""
        return self.start + self.num_tokens == len(self.seq)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, prefix_caching: bool = True):
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # sorted by arrival: the newest is last
        self.num_preemptions = 0

    # ---------------------------------------------------------------- admission

    def check(self, prompt_len: int, max_tokens: int | None) -> int:
        """Refuse what can never run; returns the effective max_tokens."""
        if prompt_len == 0:
            raise ValueError("prompt: must not be empty")
        if prompt_len >= self.max_model_len:
            raise ContextLengthError(
                f"prompt: {prompt_len} tokens, but the context limit (max_model_len) is "
                f"{self.max_model_len} tokens, and at least 1 must be left for the output")
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise ContextLengthError(
                f"max_tokens: {prompt_len} prompt tokens + {max_tokens} max_tokens exceed the context "
                f"limit (max_model_len) of {self.max_model_len} tokens; at most {room} can be generated")
        blocks = -(-(prompt_len + max_tokens) // self.block_size)
        if blocks > self.pool.num_blocks:
            raise ContextLengthError(
                f"prompt: {prompt_len} prompt + {max_tokens} output tokens need {blocks} KV blocks of "
                f"{self.block_size} tokens, but the KV cache has only {self.pool.num_blocks} "
                f"({self.pool.num_blocks * self.block_size} tokens); lower max_tokens or grow the cache")
        return max_tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed, budget)
            if n <= 0 or len(seq.output_ids) >= seq.max_tokens:
                i += 1      # its last token is sampled and on its way back: nothing left to compute
                continue
            while not self._reserve(seq, seq.num_computed + n):
                victim = self.running[-1]       # the newest: it has waited least
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break                           # seq preempted itself: everything after it too
            out.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
            i += 1
        # Admit newcomers in arrival order; a preemption this step means the pool is full.
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            if seq.num_computed == 0 and self.prefix_caching:
                self._match_prefix(seq)
            n = min(len(seq) - seq.num_computed, budget)
            if not self._reserve(seq, seq.num_computed + n):
                self._free_blocks(seq)          # give back the prefix it matched; retry later
                seq.num_computed = 0
                break                           # first come, first served: nobody skips ahead
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.num_cached_tokens is None:   # a preempted sequence's re-admission does not count
                seq.num_cached_tokens = seq.num_computed
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            out.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        return out

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate() for _ in range(need))
        return True

    def _match_prefix(self, seq: Sequence) -> None:
        # At least one token must be computed, to have logits to sample from.
        bs = self.block_size
        max_blocks = (len(seq) - 1) // bs
        parent = None
        for b in range(max_blocks):
            toks = tuple(seq.tokens(b * bs, (b + 1) * bs))
            h = block_hash(parent, toks)
            block = self.pool.lookup(h, toks)
            if block is None:
                break
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed = len(seq.block_table) * bs

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _free_blocks(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):   # the tail is freed first, so evicted first
            self.pool.release(block)
        seq.block_table.clear()
        seq.block_hashes.clear()

    # ---------------------------------------------------------------- after the forward pass

    def advance(self, item: ScheduledSeq) -> None:
        """Account for the tokens computed this step and publish the blocks they filled."""
        item.seq.num_computed = item.start + item.num_tokens
        self.publish(item.seq)

    def publish(self, seq: Sequence) -> None:
        """Make the sequence's full blocks findable, once their tokens are known on the host (a
        block holding a token still on its way back waits for it)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed, len(seq) - seq.num_pending) // bs
        for b in range(len(seq.block_hashes), full):
            toks = tuple(seq.tokens(b * bs, (b + 1) * bs))
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, toks)
            self.pool.publish(seq.block_table[b], h, toks)
            seq.block_hashes.append(h)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self._free_blocks(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
