"""Weight formats end to end on the embedded SmolLM2 (CPU reference kernels): FP8 keeps the greedy
tokens for most prompts; every lossy format runs and its perplexity and top-1 agreement with bf16
on the fixed text are reported (printed with -s; BENCHMARKS.md has bench.py --quality-only's)."""
import math

import pytest

from engine import LLM, SamplingParams
from engine.quality import evaluate

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Water boils at a temperature of",
           "The three primary colors are", "In 1969, the first person to walk on the moon was"]
# Short continuations: greedy decoding of a 135M model drifts apart after a few tokens under any
# rounding change, so "the same greedy tokens" is asked of the first 4.
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PPL = dict(window=256, count=4)


@pytest.fixture(scope="module")
def dense(llm):
    ppl, predictions, _ = evaluate(llm, **PPL)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], ppl, predictions


# Bounds from what was measured here (fp8: ppl +4%, 0.90 agreement; nvfp4: +21%, 0.76), with room.
@pytest.mark.parametrize("name, overrides, max_ratio, min_agreement", [
    ("fp8", {"weights": "fp8"}, 1.15, 0.85),
    ("nvfp4", {"weights": "nvfp4"}, 1.6, 0.7),
    ("2:4 magnitude", {"sparse_ffn": "magnitude"}, None, None),
    ("2:4 wanda", {"sparse_ffn": "wanda"}, None, None),
    ("2:4+fp8", {"sparse_ffn": "magnitude", "weights": "fp8"}, None, None),
])
def test_lossy_format_runs_and_reports_perplexity(dense, name, overrides, max_ratio, min_agreement):
    ref_tokens, ref_ppl, ref_predictions = dense
    llm = LLM("llama", device="cpu", dtype="fp32", **overrides)
    try:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        ppl, _, agreement = evaluate(llm, **PPL, reference=ref_predictions)
    finally:
        llm.shutdown(timeout=1)
    same = sum(a == b for a, b in zip(tokens, ref_tokens))
    print(f"\n{name}: perplexity {ppl:.3f} (bf16 {ref_ppl:.3f}), top-1 agreement {agreement:.3f}; "
          f"greedy identical on {same}/{len(PROMPTS)} prompts")
    assert math.isfinite(ppl) and ppl > 1
    if max_ratio is not None:                 # quantisation alone must stay close to bf16
        assert ppl < max_ratio * ref_ppl
        assert agreement > min_agreement
    if name == "fp8":
        assert same >= 3, same                # "the same greedy tokens for most prompts"


def test_sparse_and_nvfp4_cannot_combine():
    with pytest.raises(ValueError, match="sparse_ffn"):
        LLM("llama-tiny", device="cpu", weights="nvfp4", sparse_ffn="magnitude")
