"""The LM head in its own weight format (EngineConfig.lm_head): logits against a float64 reference of
the dequantised head on random inputs, the bf16 head's greedy tokens unchanged, state_dict / .to(),
bad values; on a GPU (marker gpu) the format's kernels at llama-3.1-8b's head shape and the head
inside captured decode graphs."""
import warnings

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import HEAD_AGREEMENT_BOUND, LM_HEAD_FORMATS, OWN_HEAD_AGREEMENT, EngineConfig, default_lm_head
from engine.formats import nvfp4
from engine.formats.fp8 import dequantize_fp8, quantize_rows_fp8
from engine.linear import tune_model
from models.llama import LlamaForCausalLM
from models.presets import LlamaConfig
from tests.numerics import rel_err

# Relative error of logits against the float64 reference, by the dtype the head computes in.
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def random_model(tied, vocab=1001, hidden=96, device="cpu", dtype=torch.float32, seed=0):
    """One decoder layer; vocab and hidden are multiples of nothing the kernels tile by (but K of 16)."""
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_layers=1,
                      num_heads=2, num_kv_heads=1, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg, device, dtype)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32) * 0.5)
    return model


def reference_logits(model, hidden, w=None):
    """float64 logits of the head as its format computes them: the dequantised weight (`w`, if
    given), and for fp8 the activation quantised per token as the format's GEMM does; for nvfp4,
    past the decode kernels' M on a GPU that selects it, the FP8 path's weight and activations."""
    backend = model.lm_head.backend
    if backend.name == "nvfp4" and hidden.is_cuda and backend.input_quant(hidden.shape[0]) == "fp8":
        return nvfp4.nvfp4_fp8_linear_reference(hidden, backend.tensor, torch.float32).double()
    w = backend.dequantize().double() if w is None else w
    if backend.name == "fp8":
        hidden = dequantize_fp8(*quantize_rows_fp8(hidden))
    return hidden.double() @ w.t()


def poison_allocator(device):
    """Leave NaN in the memory the next allocations get (the CUDA caching allocator hands freed
    blocks back), so an output element a kernel forgets to write shows up."""
    if device.type == "cuda":
        junk = torch.full((1 << 28,), float("nan"), device=device)
        del junk


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantised_head_logits_match_float64_reference(fmt, tied):
    model = random_model(tied)
    table = model.embed_tokens.weight.clone()
    model.set_lm_head(fmt)
    assert model.lm_head.backend.name == fmt
    # The embedding lookup keeps the full-precision table; the head is its own quantised copy.
    assert torch.equal(model.embed_tokens.weight, table) and model.embed_tokens.weight.dtype == torch.float32
    if tied:
        assert rel_err(model.lm_head.backend.dequantize(), table) < 0.15
    for m in (1, 37, 203):
        hidden = torch.randn(m, model.config.hidden_size) * 3
        logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (m, model.config.vocab_size)
        assert torch.isfinite(logits).all()
        assert rel_err(logits, reference_logits(model, hidden)) < TOL[torch.float32]


def test_bf16_head_is_the_table_or_the_dense_head():
    tied, untied = random_model(True), random_model(False)
    tied.set_lm_head("bf16")
    untied.set_lm_head("bf16")
    assert tied.lm_head is None and untied.lm_head.backend.name == "bf16"
    hidden = torch.randn(19, 96)
    want = hidden.double() @ tied.embed_tokens.weight.double().t()
    assert rel_err(tied.compute_logits(hidden), want) < TOL[torch.float32]


# Greedy tokens of the embedded model (CPU, fp32) before the LM head had a format (code 9707a4f).
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Water boils at a temperature of"]
TODAY = {"bf16": [[7042, 30, 198, 198, 504, 2988, 314, 42], [253, 1232, 278, 198, 198, 19, 12066, 6486],
                  [1130, 216, 33, 28, 32, 32, 32, 4742]],
         "fp8": [[7042, 30, 198, 198, 504, 2988, 314, 42], [253, 1232, 278, 198, 198, 19, 4246, 260],
                 [1130, 216, 33, 28, 34, 32, 32, 4742]]}


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_bf16_head_keeps_todays_greedy_tokens(weights):
    llm = LLM("llama", device="cpu", dtype="fp32", weights=weights, lm_head="bf16")
    try:
        assert llm.engine.model.lm_head is None      # tied: the table itself, no copy
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert [o.token_ids for o in out] == TODAY[weights]
    finally:
        llm.shutdown(timeout=1)


def test_quantised_head_engine_on_the_embedded_model():
    """A quantised head serves: the engine converts it, generates, and scores with it."""
    llm = LLM("llama", device="cpu", dtype="fp32", lm_head="nvfp4")
    try:
        model = llm.engine.model
        assert llm.engine.config.lm_head == "nvfp4" and model.lm_head.backend.name == "nvfp4"
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
        ids = llm.tokenizer.encode(PROMPTS[1])
        logits = llm.logits(ids)
        hidden = llm.engine.hidden_states([ids])[0]
        assert rel_err(logits, reference_logits(model, hidden)) < TOL[torch.float32]
    finally:
        llm.shutdown(timeout=1)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_state_dict_and_to_keep_the_quantised_head(fmt):
    a = random_model(True, seed=1)
    a.set_lm_head(fmt)
    b = random_model(True, seed=2)
    b.set_lm_head(fmt)
    state = a.state_dict()
    assert any(k.startswith("lm_head.backend.") for k in state)
    b.load_state_dict(state)
    hidden = torch.randn(23, 96)
    assert torch.equal(a.compute_logits(hidden), b.compute_logits(hidden))
    dtypes = {k: v.dtype for k, v in a.lm_head.state_dict().items()}
    moved = a.to("meta")
    assert moved.lm_head.backend.name == fmt
    assert all(v.device.type == "meta" for v in moved.lm_head.state_dict().values())
    assert {k: v.dtype for k, v in moved.lm_head.state_dict().items()} == dtypes


@pytest.mark.parametrize("n,k", [(128256, 4096), (49152, 576)])      # llama-3.1-8b's head, the embedded one's
def test_head_shapes_select_kernels_on_hopper(n, k):
    """The selection (capability faked) gives the vocabulary-wide heads a kernel at every M bucket
    a decode or scoring step runs, never the reference."""
    from engine.formats import fp8, nvfp4
    from engine.kernels import select
    from engine.kernels.platform import fake_capability
    cuda, tiled = torch.device("cuda"), nvfp4.tileable(n, k)
    select.clear_cache()
    try:
        with fake_capability((9, 0)), warnings.catch_warnings():
            warnings.simplefilter("error")
            for m in (1, 3, 16, 17, 128, 129, 512):
                assert select.select(fp8.FP8_GEMM, select.Problem("fp8_gemm", m, n, k, cuda)).kernel.name == \
                    ("triton_stream" if m <= 16 else "cute_wgmma_sm90")
                problem = select.Problem("nvfp4_gemm", m, n, k, cuda, (torch.bfloat16, tiled))
                assert select.select(nvfp4.NVFP4_GEMM, problem).kernel.name == \
                    ("gluon_decode" if m <= 4 else "gluon_wgmma_decode" if m <= 16 else "triton_decode" if m <= 128
                     else "fp8_dequantize_wgmma")
    finally:
        select.clear_cache()


def test_tuning_covers_the_head(monkeypatch):
    model = random_model(True)
    model.set_lm_head("fp8")
    seen = []
    monkeypatch.setattr(model.lm_head.backend, "tune", lambda tuner, ms, **kw: seen.append(ms))
    tune_model(model, None, [1, 2, 4])
    assert seen == [[1, 2, 4]]


def test_bad_lm_head_raises_value_error_naming_it():
    for bad in ("fp4", "int8", "BF16", ""):
        with pytest.raises(ValueError, match="lm_head"):
            EngineConfig(lm_head=bad)
    with pytest.raises(ValueError, match="lm_head"):
        LLM("llama", device="cpu", lm_head="e4m3")


def test_default_lm_head_rule():
    assert default_lm_head("bf16") == "bf16"
    for fmt in ("fp8", "nvfp4"):
        own = OWN_HEAD_AGREEMENT[fmt] >= HEAD_AGREEMENT_BOUND
        assert default_lm_head(fmt) == (fmt if own else "bf16")
        assert default_lm_head(fmt, stored=True) == "bf16"      # a checkpoint's head loads as stored
    assert set(LM_HEAD_FORMATS) == {"bf16", "fp8", "nvfp4"}


def test_cli_flags():
    import bench
    import serve
    assert serve.parse_args(["--lm-head", "fp8"]).lm_head == "fp8"
    with pytest.raises(SystemExit):
        serve.parse_args(["--lm-head", "fp4"])
    with pytest.raises(SystemExit):
        bench.main(["--lm-head", "fp4", "--out", "unused"])


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_gpu_head_kernels_at_llama_8b_shape(fmt):
    """llama-3.1-8b's head (N = 128256, K = 4096) on the selected kernels, never the reference, at
    decode and larger M with tails."""
    device = torch.device("cuda")
    model = random_model(False, vocab=128256, hidden=4096, device=device, dtype=torch.bfloat16)
    model.set_lm_head(fmt)
    w = model.lm_head.backend.dequantize().double()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*runs the PyTorch reference.*")
        for m in (1, 3, 16, 37, 130):
            hidden = torch.randn(m, 4096, device=device, dtype=torch.bfloat16)
            poison_allocator(device)
            logits = model.compute_logits(hidden)
            assert logits.dtype == torch.float32 and logits.shape == (m, 128256)
            assert torch.isfinite(logits).all()
            assert rel_err(logits, reference_logits(model, hidden, w)) < TOL[torch.bfloat16], m


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_gpu_head_in_cuda_graphs(fmt):
    """The quantised head is captured with the decode step (llama-tiny, bf16): a replay writes every
    logit of its poisoned output and equals the same step run eagerly; the engine decodes on it."""
    device = torch.device("cuda")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*runs the PyTorch reference.*")
        llm = LLM("llama-tiny", device="cuda", dtype="bf16", lm_head=fmt, kv_cache_tokens=4096, max_num_seqs=16)
    try:
        engine = llm.engine
        graphs, model = engine.graphs, engine.model
        assert graphs is not None and model.lm_head.backend.name == fmt
        gen = torch.Generator(device).manual_seed(7)
        with torch.inference_mode():
            for b in (1, 5, 16):
                bucket = graphs.bucket(b)
                graphs.input_ids[:bucket].copy_(torch.randint(100, 49000, (bucket,), device=device, generator=gen))
                # Each row its own KV block (no sequence owns blocks 1..bucket yet): rows left on the
                # shared scratch block would race to write it, and replay and eager would differ.
                blocks = torch.arange(1, bucket + 1, device=device, dtype=torch.int32)
                graphs.block_tables[:bucket, 0] = blocks
                graphs.slot_mapping[:bucket] = blocks.long() * engine.kv_cache.block_size
                for logits in graphs.logits.values():
                    logits.fill_(float("nan"))
                graphs.graphs[bucket].replay()
                replayed = graphs.logits[bucket].clone()
                batch = graphs._batch(bucket)
                eager = model.compute_logits(model(batch.input_ids, batch.positions, batch))
                assert replayed.dtype == torch.float32 and torch.isfinite(replayed).all(), b
                assert rel_err(replayed, eager) < 1e-3, b
        out = llm.generate([[100 + i for i in range(n)] for n in (3, 40, 17)],
                           SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert all(len(o.token_ids) == 12 for o in out)
    finally:
        llm.shutdown(timeout=1)
