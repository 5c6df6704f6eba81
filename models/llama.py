"""The Llama architecture, one definition for every weight format and device.

Runs on packed tokens: a step's sequences are concatenated into one [T, hidden] matrix, so the linear
layers see no padding. Attention reads the step's layout (which rows are prefill chunks, which are
decodes, where each sequence's KV blocks are) from the `Batch` built by engine/batch.py. Linear
layers go through engine.linear (a backend per weight format); the memory-bound ops go through
engine.kernels, which pick the fused kernel or the PyTorch reference.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.kernels import attention as attn_ops
from engine.kernels.norms import rms_norm
from engine.kernels.rope import apply_rope, rope_inv_freq
from engine.formats import DenseWeight
from engine.linear import Linear
from models.presets import LlamaConfig


class RMSNorm(nn.Module):
    def __init__(self, size, eps, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.fused = True   # the engine's fused-kernels switch (LlamaForCausalLM.set_fused_kernels)

    def forward(self, x, residual=None, quant=None):
        return rms_norm(x, self.weight, self.eps, residual, quant, self.fused)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, device=None, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        # q, k and v in one GEMM: the activation is read once.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, device, dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, device, dtype)
        self.fused = True

    def forward(self, x, positions, batch, inv_freq):
        qkv = self.qkv_proj(x)
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = batch.kv_cache.layer(self.layer_idx) if batch.kv_cache is not None else (None, None)
        # RoPE also stores this step's K/V in the paged cache (one kernel)
        kv_write = (v, k_cache, v_cache, batch.slot_mapping) if k_cache is not None else None
        q, k = apply_rope(q, k, positions, inv_freq, kv_write, self.fused)
        o = attend(q, k, v, batch, k_cache, v_cache, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


def attend(q, k, v, batch, k_cache, v_cache, scale):
    """Attention over this step's K/V, already in the paged cache (k_cache None: no cache, prefill
    only): prefill rows first, decode rows after."""
    p = batch.num_prefill_tokens
    if batch.num_decodes == 0:
        return _prefill(q, k, v, batch, k_cache, v_cache, scale)
    if p == 0:   # decode only: no copy into a shared output (one kernel less per layer)
        return attn_ops.decode_attention(q, k_cache, v_cache, batch.decode_block_tables,
                                         batch.decode_context_lens, scale)
    out = torch.empty_like(q)
    out[:p] = _prefill(q[:p], k[:p], v[:p], batch, k_cache, v_cache, scale)
    out[p:] = attn_ops.decode_attention(q[p:], k_cache, v_cache, batch.decode_block_tables,
                                        batch.decode_context_lens, scale)
    return out


def _prefill(q, k, v, batch, k_cache, v_cache, scale):
    if q.is_cuda and not batch.prefill_has_prefix:
        # Variable-length prompts as jagged nested tensors: flash SDPA, no padding anywhere.
        # The lengths' bounds come from the host: asked of the device, they would cost a sync.
        def nt(x):
            return torch.nested.nested_tensor_from_jagged(x, batch.prefill_offsets, min_seqlen=batch.prefill_min_len,
                                                          max_seqlen=batch.prefill_max_len)
        return attn_ops.prefill_attention_nested(nt(q), nt(k), nt(v), scale).values()
    return attn_ops.prefill_attention(q, k, v, batch.prefill_offsets, batch.prefill_context_lens,
                                      batch.prefill_block_tables, k_cache, v_cache, scale)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, device=None, dtype=None):
        super().__init__()
        # gate and up in one GEMM (rows [0, F) are gate, [F, 2F) up): the activation is read once.
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, device, dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, device, dtype)

    def forward(self, x):
        # With an FP8 down_proj the SwiGLU product leaves the kernel as e4m3: it is never stored in
        # bf16. A 2:4 gate_up at decode computes it in the GEMM's epilogue (Linear.swiglu).
        return self.down_proj(self.gate_up_proj.swiglu(x, self.down_proj.input_quant))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, device=None, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.self_attn = LlamaAttention(cfg, layer_idx, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mlp = LlamaMLP(cfg, device, dtype)

    def forward(self, x, residual, positions, batch, inv_freq):
        # The residual add is fused into the norm that follows it, and with FP8 GEMMs after them the
        # norms write their output already quantised (1 byte per element, never a bf16 copy).
        if residual is None:
            residual = x
            h = self.input_layernorm(x, quant=self.self_attn.qkv_proj.input_quant)
        else:
            h, residual = self.input_layernorm(x, residual, self.self_attn.qkv_proj.input_quant)
        h = self.self_attn(h, positions, batch, inv_freq)
        h, residual = self.post_attention_layernorm(h, residual, self.mlp.gate_up_proj.input_quant)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, device=None, dtype=None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, device, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        # None: tied to the embedding table (until set_lm_head gives it a quantised copy of it).
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, device, dtype)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
                             .to(device), persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids, positions, batch):
        """input_ids, positions: [T] packed tokens. Returns the final-norm hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, batch, self.inv_freq)
        x, _ = self.norm(x, residual)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden):
        """hidden [M, hidden] -> fp32 logits [M, vocab], through the LM head's weight format."""
        logits = hidden @ self.embed_tokens.weight.t() if self.lm_head is None else self.lm_head(hidden)
        return logits.float()

    def set_lm_head(self, fmt: str) -> None:
        """Put the LM head in weight format `fmt` (bf16: the model dtype), once, on a model fresh from
        loading. With tied embeddings a quantised head is its own copy of the table; the embedding
        lookup keeps the table."""
        if self.lm_head is None:
            if fmt == "bf16":
                return
            self.lm_head = Linear(self.config.hidden_size, self.config.vocab_size, device="meta")
            self.lm_head.backend = DenseWeight(self.embed_tokens.weight)   # shared until converted
        self.lm_head.convert(fmt)

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
