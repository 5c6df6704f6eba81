"""The Llama architecture, one definition for every weight format and device.

Runs on packed tokens: a step's sequences are concatenated into one [T, hidden] matrix, so the linear
layers see no padding. Attention reads the step's layout (which rows are prefill chunks, which are
decodes, where each sequence's KV blocks are) from the `Batch` built by engine/batch.py. Linear
layers go through engine.linear (a backend per weight format); the memory-bound ops go through
engine.kernels, which pick the fused kernel or the PyTorch reference.

Tensor parallelism (`tp`, engine/parallel.py; Megatron's split): each rank holds
- q/k/v and gate/up column-parallel: its query heads with their KV heads (split where the KV heads
  divide by the ranks, each rank's one KV head replicated where the ranks divide by them) and its
  slice of the FFN rows, so attention and SwiGLU run on local data;
- o_proj and down_proj row-parallel (their K): each rank's product is a partial sum, all-reduced
  once per projection. The all-reduce lands before the fused residual-add + RMSNorm that follows,
  so no fusion straddles it;
- the embedding and the LM head vocabulary-parallel: a lookup outside the rank's rows gives zeros
  and one all-reduce sums them; each rank's logits slice is all-gathered for rank 0 to sample.
Norm weights and RoPE are replicated. Numerics: each rank holds exactly its slice of the one-GPU
weights (scales included); only an FP8 GEMM's per-token activation scale differs, as it spans the
rank's K of a row-parallel projection. `tensor_parallel_shards` is the one place that says who holds
what; weights are loaded through `load_weight`, which takes the rank's part of each full tensor.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import attention as attn_ops
from engine.kernels.norms import rms_norm
from engine.kernels.platform import triton_runs
from engine.kernels.rope import apply_rope, apply_rope_triton, rope_inv_freq
from engine.formats import DenseWeight
from engine.linear import Linear
from engine.parallel import Shard, split_evenly
from models.presets import LlamaConfig


def tensor_parallel_shards(cfg: LlamaConfig, size: int) -> dict[str, list[Shard]]:
    """Every rank's Shard of each kind of weight ("qkv", "o", "gate_up", "down", "vocab"), and the
    heads each rank runs ("heads", "kv_heads": [(first, count)] per rank). ValueError naming
    tensor_parallel_size where the model does not split `size` ways."""
    h, kv, hd, f, v, d = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                          cfg.vocab_size, cfg.hidden_size)
    for what, n in (("attention heads", h), ("FFN size", f), ("vocabulary", v)):
        if n % size:
            raise ValueError(f"tensor_parallel_size: {size} does not divide the model's {what} ({n})")
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size: {size} ranks cannot share {kv} KV heads (one must divide "
                         "the other: KV heads split, or each one replicated on size / KV ranks)")
    nq, nkv = h * hd, kv * hd
    hl = h // size
    out = {k: [] for k in ("qkv", "o", "gate_up", "down", "vocab", "heads", "kv_heads")}
    for r, (f0, f1) in enumerate(split_evenly(f, size)):
        kvl = kv // size if kv % size == 0 else 1
        k0 = r * kvl if kv % size == 0 else r // (size // kv)
        q = (r * hl * hd, (r + 1) * hl * hd)
        kk = (nq + k0 * hd, nq + (k0 + kvl) * hd)
        out["qkv"].append(Shard((q, kk, (kk[0] + nkv, kk[1] + nkv)), (0, d)))
        out["o"].append(Shard(((0, d),), q))
        out["gate_up"].append(Shard(((f0, f1), (f + f0, f + f1)), (0, d)))
        out["down"].append(Shard(((0, d),), (f0, f1)))
        out["vocab"].append(Shard(((r * v // size, (r + 1) * v // size),), (0, d)))
        out["heads"].append((r * hl, hl))
        out["kv_heads"].append((k0, kvl))
    return out


class VocabParallelEmbedding(nn.Module):
    """The token embedding; with `tp`, this rank's slice of the vocabulary rows."""

    def __init__(self, vocab: int, dim: int, device=None, dtype=None, tp=None):
        super().__init__()
        self.tp = tp
        rows = vocab // (tp.size if tp is not None else 1)
        self.start = rows * (tp.rank if tp is not None else 0)
        self.weight = nn.Parameter(torch.empty(rows, dim, device=device, dtype=dtype), requires_grad=False)

    def load(self, value: torch.Tensor) -> None:
        self.weight.data.copy_(value[self.start:self.start + self.weight.shape[0]])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(x)


class NormedRows(NamedTuple):
    """RMSNorm(h) * g handed off between two GEMMs (engine/kernels/stream_triton.py states the
    protocol): xg = h * g and the partial sums of squares of h's rows; the GEMM that takes them
    applies 1 / rms itself."""
    xg: torch.Tensor
    parts: torch.Tensor
    eps: float

    @staticmethod
    def after(producer: Linear, x: torch.Tensor, residual: torch.Tensor, norm: "RMSNorm") -> "NormedRows":
        """residual += producer(x) in place, and RMSNorm(residual) * norm.weight handed off."""
        return NormedRows(*producer.backend.norm_out_forward(x, residual, norm.weight), norm.eps)

    def project(self, consumer: Linear, swiglu: bool = False) -> torch.Tensor:
        return consumer.backend.row_scaled_forward(self.xg, self.parts, self.eps, swiglu)


def norm_handoff(producer: Linear, consumer: Linear, norm: "RMSNorm", residual, m: int, swiglu: bool) -> bool:
    """Whether the RMSNorm between producer and consumer hands off (no norm kernel): both GEMMs' formats
    take part at M rows (`WeightFormat.norm_handoff`), on one GPU, with the fused kernels on."""
    return (norm.fused and producer.tp is None and residual is not None and residual.is_contiguous()
            and producer.backend.norm_handoff(m) and consumer.backend.norm_handoff(m, swiglu))


class RMSNorm(nn.Module):
    def __init__(self, size, eps, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.fused = True   # the engine's fused-kernels switch (LlamaForCausalLM.set_fused_kernels)

    def forward(self, x, residual=None, quant=None, out=None, residual_out=None):
        return rms_norm(x, self.weight, self.eps, residual, quant, self.fused, out, residual_out)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, device=None, dtype=None, tp=None, shards=None):
        super().__init__()
        self.layer_idx, self.tp = layer_idx, tp
        rank = tp.rank if tp is not None else 0
        self.head_dim = cfg.head_dim
        self.num_heads = shards["heads"][rank][1] if shards else cfg.num_heads
        self.num_kv_heads = shards["kv_heads"][rank][1] if shards else cfg.num_kv_heads
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one GEMM: the activation is read once.
        self.qkv_proj = Linear(cfg.hidden_size, nq + 2 * nkv, device, dtype, shards and shards["qkv"], tp)
        self.o_proj = Linear(nq, cfg.hidden_size, device, dtype, shards and shards["o"], tp)
        self.fused = True

    def split_qkv(self, qkv):
        """q [T, heads, hd], k and v [T, kv heads, hd]: views of a [T, q + 2 kv columns] tensor laid
        out as qkv_proj writes it (q, k, v side by side)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))

    def kv_cache(self, batch):
        """This layer's (k_cache, v_cache, kv_scales), or Nones where the step keeps no cache; kv_scales
        is None but for an FP8 cache."""
        return batch.kv_cache.layer(self.layer_idx) if batch.kv_cache is not None else (None, None, None)

    def project(self, h, positions, batch, inv_freq, out=None):
        """The attention's inputs from the normed rows h [T, hidden] (or a `NormedRows`): (q, k, v,
        new_kv), q [T, heads, hd] and k, v [T, kv heads, hd], with this step's K/V stored in the
        paged cache. The prefill rows are rotated here; so are the decode rows, unless the fused
        decode attention kernel rotates and stores them itself, in which case new_kv = (their k, v,
        inv_freq) for it, else None. out [T, q + 2 kv columns]: the rotated q, k and v go there (the
        step graphs' static buffer), every row rotated here."""
        q, k, v = self.split_qkv(h.project(self.qkv_proj) if isinstance(h, NormedRows) else self.qkv_proj(h))
        k_cache, v_cache, kv_scales = self.kv_cache(batch)
        if out is None and batch.num_decodes and k_cache is not None and self.fused and triton_runs(q):
            # The decode rows are rotated, and their K/V stored, by the decode attention kernel
            # itself (one launch less per layer); prefill rows by RoPE's kernel, in place.
            p = batch.num_prefill_tokens
            if p:
                apply_rope_triton(q[:p], k[:p], positions[:p], inv_freq,
                                  (v[:p], k_cache, v_cache, batch.slot_mapping[:p], kv_scales))
            return q, k, v, (k[p:], v[p:], inv_freq)
        # RoPE also stores this step's K/V in the paged cache (one kernel)
        kv_write = (v, k_cache, v_cache, batch.slot_mapping, kv_scales) if k_cache is not None else None
        q, k = apply_rope(q, k, positions, inv_freq, kv_write, self.fused, out)
        return (q, k, v, None) if out is None else (*self.split_qkv(out), None)

    def attend(self, q, k, v, batch, new_kv=None, out=None):
        """Attention over the step's rows (`project`'s outputs) -> [T, heads, hd], into out where given."""
        return attend(q, k, v, batch, *self.kv_cache(batch), self.scale, new_kv, out)

    def output(self, o):
        """o_proj of the attention's output [T, heads, hd] (all-reduced across ranks)."""
        o = self.o_proj(o.reshape(o.shape[0], self.q_size))
        return o if self.tp is None else self.tp.all_reduce(o)

    def forward(self, x, positions, batch, inv_freq):
        q, k, v, new_kv = self.project(x, positions, batch, inv_freq)
        return self.output(self.attend(q, k, v, batch, new_kv))


def attend(q, k, v, batch, k_cache, v_cache, kv_scales, scale, new_kv=None, out=None):
    """Attention over this step's K/V, already in the paged cache (k_cache None: no cache, prefill
    only; kv_scales: an FP8 cache's): prefill rows first, decode rows after. new_kv = (k, v,
    inv_freq) of the decode rows: their q and k are not rotated yet nor their K/V cached; the decode
    kernel does both first. out: where the result goes (contiguous, q's shape)."""
    p = batch.num_prefill_tokens
    if batch.num_decodes == 0:
        return _prefill(q, k, v, batch, k_cache, v_cache, kv_scales, scale, out)

    def decode(qd, out):
        return attn_ops.decode_attention(qd, k_cache, v_cache, batch.decode_block_tables,
                                         batch.decode_context_lens, scale, new_kv, out, kv_scales)
    if p == 0:   # decode only: no copy into a shared output (one kernel less per layer)
        return decode(q, out)
    if out is None:
        out = torch.empty_like(q)
    _prefill(q[:p], k[:p], v[:p], batch, k_cache, v_cache, kv_scales, scale, out[:p])
    decode(q[p:], out[p:])
    return out


def _prefill(q, k, v, batch, k_cache, v_cache, kv_scales, scale, out=None):
    # The longest prompt's length and the longest cached prefix come from the host (asked of the
    # device, they would cost a sync); they pick the kernel (FlashAttention-2 for short fresh prompts).
    return attn_ops.prefill_attention(q, k, v, batch.prefill_offsets, batch.prefill_context_lens,
                                      batch.prefill_block_tables, k_cache, v_cache, scale,
                                      max_prefix=batch.prefill_max_prefix, out=out,
                                      block_ends=batch.prefill_block_ends, kv_scales=kv_scales,
                                      max_len=batch.prefill_max_len)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, device=None, dtype=None, tp=None, shards=None):
        super().__init__()
        self.tp = tp
        f = cfg.intermediate_size
        # gate and up in one GEMM (rows [0, F) are gate, [F, 2F) up): the activation is read once.
        # Sharded, a rank holds its gate rows then the same up rows: SwiGLU stays local.
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * f, device, dtype, shards and shards["gate_up"], tp)
        self.down_proj = Linear(f, cfg.hidden_size, device, dtype, shards and shards["down"], tp)

    def activation(self, x):
        """silu(gate) * up of the normed rows x. With an FP8 down_proj the SwiGLU product leaves the
        kernel as e4m3: it is never stored in bf16. A dense or 2:4 gate_up at decode computes it in
        the GEMM's epilogue (Linear.swiglu)."""
        m = (x[0] if isinstance(x, tuple) else x).shape[0]   # x: bf16 rows, or (e4m3, scale)
        return self.gate_up_proj.swiglu(x, self.down_proj.input_quant(m))

    def down(self, act):
        """down_proj of the SwiGLU product (all-reduced across ranks)."""
        y = self.down_proj(act)
        return y if self.tp is None else self.tp.all_reduce(y)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, device=None, dtype=None, tp=None, shards=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.self_attn = LlamaAttention(cfg, layer_idx, device, dtype, tp, shards)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mlp = LlamaMLP(cfg, device, dtype, tp, shards)
        self.streamed = False   # set by engine/streams/offload.py for a layer it streams

    # The residual add is fused into the norm that follows it, and with FP8 GEMMs after them the
    # norms write their output already quantised (1 byte per element, never a bf16 copy). Where the
    # GEMMs on both sides of a norm can (decode-sized M; dense and 2:4 weights), the norm
    # hands off instead (`NormedRows`): the GEMM before it adds the residual, the one after applies
    # 1 / rms.

    def attention_inputs(self, x, residual, positions, batch, inv_freq, qkv_out=None, residual_out=None):
        """The input norm and `LlamaAttention.project`: (q, k, v, new_kv, residual). x: the layer's
        input, or `NormedRows` of the residual (the previous layer's down_proj handed this norm
        off). qkv_out and residual_out: where the attention's inputs and the residual stream go
        (the step graphs' static buffers)."""
        if isinstance(x, NormedRows):
            h = x
            if residual_out is not None and residual_out.data_ptr() != residual.data_ptr():
                residual = residual_out.copy_(residual)
        else:
            quant = self.self_attn.qkv_proj.input_quant(x.shape[0])
            if residual is None:
                residual = x if residual_out is None else residual_out.copy_(x)
                h = self.input_layernorm(x, quant=quant)
            else:
                h, residual = self.input_layernorm(x, residual, quant, residual_out=residual_out)
        return (*self.self_attn.project(h, positions, batch, inv_freq, qkv_out), residual)

    def after_attention(self, o, residual, next_layer=None):
        """o_proj, the post-attention norm and the MLP: (the MLP's output, residual). With
        next_layer, the output may be `NormedRows` (next_layer's input norm handed off); residual
        may then be updated in place. Never into a streamed layer (engine/streams/offload.py): its
        norm weight exists on the device only while it runs itself."""
        attn, mlp = self.self_attn, self.mlp
        m = o.shape[0]
        o = o.reshape(m, attn.q_size)
        if norm_handoff(attn.o_proj, mlp.gate_up_proj, self.post_attention_layernorm, residual, m, swiglu=True):
            act = NormedRows.after(attn.o_proj, o, residual, self.post_attention_layernorm).project(
                mlp.gate_up_proj, swiglu=True)
        else:
            h, residual = self.post_attention_layernorm(attn.output(o), residual, mlp.gate_up_proj.input_quant(m))
            act = mlp.activation(h)
        if next_layer is not None and not next_layer.streamed and norm_handoff(
                mlp.down_proj, next_layer.self_attn.qkv_proj, next_layer.input_layernorm, residual, m, swiglu=False):
            return NormedRows.after(mlp.down_proj, act, residual, next_layer.input_layernorm), residual
        return mlp.down(act), residual

    def forward(self, x, residual, positions, batch, inv_freq, next_layer=None):
        q, k, v, new_kv, residual = self.attention_inputs(x, residual, positions, batch, inv_freq)
        return self.after_attention(self.self_attn.attend(q, k, v, batch, new_kv), residual, next_layer)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, device=None, dtype=None, tp=None):
        """tp: this rank's engine.parallel.TPGroup (None: the whole model on one device)."""
        super().__init__()
        self.config, self.tp = cfg, tp
        shards = tensor_parallel_shards(cfg, tp.size) if tp is not None else None
        self.num_local_kv_heads = shards["kv_heads"][tp.rank][1] if shards else cfg.num_kv_heads
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, device, dtype, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, device, dtype, tp, shards)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        # None: tied to the embedding table (until set_lm_head gives it a quantised copy of it).
        self.vocab_shards = shards and shards["vocab"]
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, device, dtype, self.vocab_shards, tp)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
                             .to(device), persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids, positions, batch):
        """input_ids, positions: [T] packed tokens. Returns the final-norm hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            x, residual = layer(x, residual, positions, batch, self.inv_freq, nxt)
        x, _ = self.norm(x, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden, out: torch.Tensor | None = None):
        """hidden [M, hidden] -> fp32 logits [M, vocab], through the LM head's weight format (with tp:
        every rank's slice, gathered on every rank); into `out` [M, vocab] fp32 where given."""
        logits = hidden @ self.embed_tokens.weight.t() if self.lm_head is None else self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        return logits.float() if out is None else out.copy_(logits)

    def set_lm_head(self, fmt: str) -> None:
        """Put the LM head in weight format `fmt` (bf16: the model dtype), once, on a model fresh from
        loading. With tied embeddings a quantised head is its own copy of the table (with tp: of
        this rank's rows); the embedding lookup keeps the table."""
        if self.lm_head is None:
            if fmt == "bf16":
                return
            self.lm_head = Linear(self.config.hidden_size, self.config.vocab_size, "meta",
                                  shards=self.vocab_shards, tp=self.tp)
            self.lm_head.backend = DenseWeight(self.embed_tokens.weight)   # shared until converted
        self.lm_head.convert(fmt)

    def full_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(state_dict name, shape of the whole tensor) of every weight, in state_dict order: what a
        loader hands to `load_weight`."""
        out = []
        for name, t in self.state_dict(keep_vars=True).items():
            if name == "embed_tokens.weight":
                out.append((name, (self.config.vocab_size, self.config.hidden_size)))
            elif name.endswith(".backend.weight"):
                out.append((name, self.get_submodule(name[:-len(".backend.weight")]).full_shape))
            else:   # replicated
                out.append((name, tuple(t.shape)))
        return out

    def load_weight(self, name: str, value: torch.Tensor, row0: int = 0) -> None:
        """Copy in this rank's part of the full tensor `name` (a state_dict name; for a fused Linear,
        `value` may be the section starting at row `row0`, e.g. k of q/k/v). ValueError on a shape
        that does not fit."""
        if name.endswith(".backend.weight"):
            self.get_submodule(name[:-len(".backend.weight")]).load(value, row0)
        elif name == "embed_tokens.weight":
            want = (self.config.vocab_size, self.config.hidden_size)
            if tuple(value.shape) != want:
                raise ValueError(f"shape {tuple(value.shape)} where {want} was expected")
            self.embed_tokens.load(value)
        else:
            param = self.get_parameter(name)
            if param.shape != value.shape:
                raise ValueError(f"shape {tuple(value.shape)} where {tuple(param.shape)} was expected")
            param.data.copy_(value)

    def set_fused_kernels(self, enabled: bool) -> None:
        """The fused norm, RoPE and SwiGLU kernels (True) or their PyTorch references (False), for
        this model only. Attention is not switched: its reference is no baseline to time."""
        for module in self.modules():
            if hasattr(module, "fused"):
                module.fused = enabled

    def linear_layers(self, ffn_only=False):
        """(name, Linear) of the decoder layers' GEMMs: what a weight format converts."""
        for i, layer in enumerate(self.layers):
            if not ffn_only:
                yield f"layers.{i}.self_attn.qkv_proj", layer.self_attn.qkv_proj
                yield f"layers.{i}.self_attn.o_proj", layer.self_attn.o_proj
            yield f"layers.{i}.mlp.gate_up_proj", layer.mlp.gate_up_proj
            yield f"layers.{i}.mlp.down_proj", layer.mlp.down_proj
