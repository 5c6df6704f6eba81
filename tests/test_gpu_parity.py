"""GPU: our model in bf16 at llama-3.2-1b shapes against transformers built from the same weights."""
import pytest
import torch

from tests.numerics import rel_err


def to_hf(model, dtype=None):
    """A transformers LlamaForCausalLM holding the same weights as our model (fused q/k/v, gate/up
    split), in `dtype` (default: our model's)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = model.config
    hf_cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                         intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                         num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                         head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                         rope_scaling=c.rope_scaling, max_position_embeddings=c.max_position_embeddings,
                         tie_word_embeddings=c.tie_word_embeddings)
    dev = model.embed_tokens.weight.device
    dt = dtype or model.embed_tokens.weight.dtype
    hf = LlamaForCausalLM(hf_cfg).to(device=dev, dtype=dt).eval()
    # Module.to(dtype) also rounds the RoPE frequencies to bf16, which transformers itself never
    # does (they stay fp32 when it loads a bf16 model): put fp32 frequencies back, ours (the
    # Llama-3 scaling formula is checked against transformers' in test_model.py).
    hf.model.rotary_emb.inv_freq = model.inv_freq.clone()
    nq, nkv, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(model.embed_tokens.weight)
        hf.model.norm.weight.copy_(model.norm.weight)
        if model.lm_head is not None:
            hf.lm_head.weight.copy_(model.lm_head.weight)
        for ours, theirs in zip(model.layers, hf.model.layers):
            qkv = ours.self_attn.qkv_proj.weight
            theirs.self_attn.q_proj.weight.copy_(qkv[:nq])
            theirs.self_attn.k_proj.weight.copy_(qkv[nq:nq + nkv])
            theirs.self_attn.v_proj.weight.copy_(qkv[nq + nkv:])
            theirs.self_attn.o_proj.weight.copy_(ours.self_attn.o_proj.weight)
            gu = ours.mlp.gate_up_proj.weight
            theirs.mlp.gate_proj.weight.copy_(gu[:f])
            theirs.mlp.up_proj.weight.copy_(gu[f:])
            theirs.mlp.down_proj.weight.copy_(ours.mlp.down_proj.weight)
            theirs.input_layernorm.weight.copy_(ours.input_layernorm.weight)
            theirs.post_attention_layernorm.weight.copy_(ours.post_attention_layernorm.weight)
    return hf


@pytest.mark.gpu
def test_llama_3_2_1b_bf16_matches_transformers():
    """Both engines run bf16; each is compared with transformers in fp32 on the same weights, and
    our bf16 error must be of the size of transformers' own bf16 error."""
    from engine import LLM
    llm = LLM("llama-3.2-1b", device="cuda", dtype="bf16", kv_cache_tokens=8192)
    try:
        hf = to_hf(llm.engine.model)
        hf32 = to_hf(llm.engine.model, torch.float32)
        gen = torch.Generator().manual_seed(0)
        ours_all, theirs_all, ref_all = [], [], []
        for n in (7, 300):
            ids = torch.randint(0, 49152, (n,), generator=gen).tolist()
            x = torch.tensor([ids], device="cuda")
            ours = llm.logits(ids).float()
            with torch.no_grad():
                theirs = hf(x).logits[0].float().cpu()
                ref = hf32(x).logits[0].cpu()
            err_ours = rel_err(ours, ref)
            err_hf = rel_err(theirs, ref)
            assert err_ours < max(1.5 * err_hf, 5e-3), (err_ours, err_hf)
            ours_all.append(ours)
            theirs_all.append(theirs)
            ref_all.append(ref)
        # Random weights give near-flat logits, so bf16 flips some argmaxes: ours must flip no more
        # often than transformers' own bf16 run does.
        top = torch.cat(ref_all).argmax(-1)
        agree_ours = (torch.cat(ours_all).argmax(-1) == top).float().mean().item()
        agree_hf = (torch.cat(theirs_all).argmax(-1) == top).float().mean().item()
        assert agree_ours >= agree_hf - 0.05, (agree_ours, agree_hf)
    finally:
        llm.shutdown(timeout=1)
