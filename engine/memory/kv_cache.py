"""The paged KV cache: a pool of fixed-size blocks, a block table per sequence, reference counts,
and prefix caching of full blocks.

A full block is named by a hash of its tokens chained with its prefix's hash, so two requests whose
prompts start alike map their first blocks to the same physical blocks. The block keeps its tokens,
and a hit is verified against them (a hash collision can cost a miss, never a wrong answer). Freed
blocks that hold a cached prefix stay findable until the pool needs them: they are reused in
least-recently-freed order.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from engine.kernels.rope import KV_FP8


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        # Blocks with ref_count 0, oldest-freed first; allocation takes from the front.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_of: dict[int, int] = {}              # block -> its prefix hash (full blocks only)
        self.tokens_of: dict[int, tuple] = {}          # block -> its tokens, to verify hits
        self.block_of: dict[int, int] = {}             # prefix hash -> block
        self.queries = self.hits = 0                   # prefix-cache statistics, in blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.hash_of.pop(block, None)
        if h is not None:                               # evict its cached prefix
            self.tokens_of.pop(block)
            if self.block_of.get(h) == block:
                del self.block_of[h]
        self.ref_count[block] = 1
        return block

    def release(self, block: int) -> None:
        assert self.ref_count[block] > 0, f"block {block} freed twice"
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free[block] = None

    def lookup(self, prefix_hash: int, tokens: tuple) -> int | None:
        """The cached block holding `tokens` after the prefix named by prefix_hash, taken (ref + 1)."""
        self.queries += 1
        block = self.block_of.get(prefix_hash)
        if block is None or self.tokens_of.get(block) != tokens:
            return None
        self.hits += 1
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1
        return block

    def publish(self, block: int, prefix_hash: int, tokens: tuple) -> None:
        """Make a full block findable by later requests."""
        if block in self.hash_of or prefix_hash in self.block_of:
            return
        self.hash_of[block] = prefix_hash
        self.tokens_of[block] = tokens
        self.block_of[prefix_hash] = block


def block_hash(parent: int | None, tokens: tuple) -> int:
    return hash((parent, tokens))


class KVCache:
    """Per-layer K and V tensors of shape [num_blocks + 1, block_size, n_kv_heads, head_dim], in the
    model dtype, or with fp8=True in e4m3 with an fp32 scale per (token, KV head) row in k_scale and
    v_scale [num_layers, num_blocks + 1, block_size, n_kv_heads] (engine/kernels/rope.py's layout).

    The last block belongs to no sequence: padded rows of a CUDA-graph decode step write there."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, fp8=False):
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.scratch_block = num_blocks
        store = KV_FP8 if fp8 else dtype
        self.k = torch.empty(shape, dtype=store, device=device)
        self.v = torch.empty(shape, dtype=store, device=device)
        self.k_scale = self.v_scale = None
        if fp8:     # zeros: a row never written reads as 0, not as whatever the memory held
            self.k_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size

    def layer(self, i):
        """(k_cache, v_cache, kv_scales) of layer i; kv_scales = (k_scale, v_scale), or None."""
        scales = None if self.k_scale is None else (self.k_scale[i], self.v_scale[i])
        return self.k[i], self.v[i], scales

    @staticmethod
    def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, fp8=False) -> int:
        if fp8:     # a byte per value and the row's fp32 scale
            return 2 * num_layers * num_kv_heads * (head_dim + 4)
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
