"""benchmarks/make_checkpoint.py with the real llm-compressor (the `compress` extra): the checkpoints it
makes of the embedded model load as stored, in the format they hold, and compute what their
references compute. Skipped where llm-compressor is not installed; CI runs this file in the README's
`compress` environment (a virtual environment with `pip install -e ".[compress]"`)."""
import pytest
import torch

pytest.importorskip("llmcompressor")

from test_compressed import (CPU, _check_bit_exact, _dense_copy, _nvfp4_runs_as_its_decompression,  # noqa: E402
                             _recipe, _transformers)
from tests.numerics import rel_err  # noqa: E402


def _logits_match_transformers(path, reference, max_err):
    """The engine's logits on checkpoint `path` against transformers' on `reference`, over fresh
    random tokens: relative error (of the logits' norm) below max_err."""
    from engine import LLM
    hf = _transformers(reference)
    llm = LLM(str(path), device="cpu", dtype="fp32")
    try:
        ids = torch.randint(0, llm.tokenizer.vocab_size, (48,)).tolist()
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        got = llm.logits(ids)
        err = rel_err(got, expected)
        assert err < max_err, err
    finally:
        llm.shutdown(timeout=1)


# A few short calibration windows keep SparseGPT on the CPU within a minute or two.
CALIBRATION = ["--calibration-windows", "8", "--calibration-window", "128"]


@pytest.mark.parametrize("scheme", ["fp8", "nvfp4", "2:4"])
def test_recipe_checkpoints_load_as_stored(tmp_path, scheme):
    from engine import LLM
    from models.loader import load_model
    out = tmp_path / "ckpt"
    _recipe().main(["--scheme", scheme, "--out", str(out)] + (CALIBRATION if scheme == "2:4" else []))
    loaded = load_model(str(out), CPU, torch.float32)
    if scheme == "2:4":
        # SparseGPT prunes and updates the FFN weights; attention stays dense. The weights are stored
        # dense (the engine checks the 2:4 pattern at load). transformers refuses a compressed-tensors
        # config that holds only a sparsity_config, so it runs the same tensors as a plain checkpoint.
        assert loaded.checkpoint.sparse_ffn and loaded.checkpoint.weights == "bf16"
        backends = {name: lin.backend.name for name, lin in loaded.model.linear_layers()}
        assert {b for n, b in backends.items() if ".mlp." in n} == {"2:4"}
        assert {b for n, b in backends.items() if ".self_attn." in n} == {"bf16"}
        # fp32 apart only: about 1e-6 relative (a maximum absolute difference, used before, drew
        # 1e-4 to 1.2e-3 over different random tokens).
        _dense_copy(out, tmp_path / "dense")
        _logits_match_transformers(out, tmp_path / "dense", 1e-4)
        return
    assert loaded.checkpoint.weights == scheme and not loaded.checkpoint.sparse_ffn
    if scheme == "fp8":
        _check_bit_exact(out, loaded, scheme)
        # llm-compressor's round to nearest makes the engine's own `--weights fp8` values and scales:
        # the two models are the same tensors and give the same logits. (transformers' FP8 forward is
        # no whole-model reference here: each projection matches it (test_compressed.py), but over 30
        # layers one-code differences in the per-token activation rounding compound, to 8% of the
        # logits' norm apart, about FP8's own distance from dense.)
        stored, own = LLM(str(out), device="cpu", dtype="fp32"), LLM("llama", device="cpu", dtype="fp32", weights="fp8")
        try:
            a, b = stored.engine.model.state_dict(), own.engine.model.state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            ids = torch.randint(0, own.tokenizer.vocab_size, (48,)).tolist()
            assert torch.equal(stored.logits(ids), own.logits(ids))
        finally:
            stored.shutdown(timeout=1)
            own.shutdown(timeout=1)
    else:
        # transformers cannot run NVFP4 weights in fp32 on the CPU (test_compressed.py checks why): the
        # reference is the checkpoint as compressed-tensors decompresses it, run dense.
        _nvfp4_runs_as_its_decompression(out, tmp_path / "dense")
