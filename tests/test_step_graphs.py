"""The step graphs (engine/cuda_graphs.py StepGraphs): prefill and mixed steps run as captured pieces
around eager attention, over static buffers shared by every token-count bucket.

On the CPU the pieces run as plain calls (`StepGraphs.trace`): the same buffers, padding and order as
the captured graphs, so the layout is checked here; on the GPU (marker gpu) the captured pieces are
checked against the eager forward, step by step, in every weight format."""
from __future__ import annotations

import pytest
import torch

from bench import run_to_completion
from engine.config import EngineConfig
from engine.cuda_graphs import BUCKETS, StepGraphs, smallest_at_least, token_buckets
from engine.engine import Engine
from engine.sampling import SamplingParams
from tests.numerics import rel_err


def test_token_buckets_pad_a_large_step_by_at_most_an_eighth():
    for top in (8192, 3000, 100, 16, 10):
        b = token_buckets(top)
        assert b == sorted(set(b)) and b[-1] == top
        assert all(x % 16 == 0 for x in b[:-1])
        for t in range(1, top + 1):
            pad = smallest_at_least(b, t)
            assert pad == next(x for x in b if x >= t) and pad - t <= max(63, t // 8), (top, t, pad)
        assert smallest_at_least(b, top + 1) is None
    assert [smallest_at_least(list(BUCKETS), n) for n in (1, 3, 17, 512, 513)] == [1, 4, 24, 512, None]


def _requests(tag, lengths, max_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return [(f"{tag}{i}", torch.randint(10, 40000, (n,), generator=g).tolist(),
             SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            for i, n in enumerate(lengths)]


def _with_traced_step_graphs(engine, max_tokens):
    """The engine's non-decode steps through StepGraphs' pieces, with every static buffer poisoned
    (NaN; -1 ids): padded rows then compute on NaN, which must reach no real row. Returns the
    list of (rows, bucket, prefills, decodes) of the steps that ran through them."""
    graphs = StepGraphs(engine.model, engine.kv_cache, max_tokens, engine.kv_cache.scratch_block)
    graphs.trace()
    for buf in (graphs.qkv, graphs.attn_out, graphs.residual, graphs.hidden):
        buf.fill_(float("nan"))
    graphs.input_ids.fill_(1)
    seen = []
    run = graphs.run

    def recorded(batch):
        t = batch.input_ids.shape[0]
        seen.append((t, graphs.bucket(t), batch.num_prefills, batch.num_decodes))
        hidden = run(batch)
        assert torch.isfinite(hidden).all()
        return hidden
    graphs.run = recorded
    engine.step_graphs = graphs
    return seen


def test_traced_step_graphs_give_the_eager_tokens():
    """llama-tiny on the CPU (fp32): prompts longer than a step's budget (chunked, attending to
    their cached prefix), prefills joining running decodes and a prefix-cache hit, through the
    pieces with padded buckets, give the eager engine's tokens; the scratch block takes the
    padded rows' K/V and no sequence's block is touched by them."""
    kw = dict(model="llama-tiny", device="cpu", dtype="fp32", kv_cache_tokens=4096, block_size=16,
              max_num_batched_tokens=96)
    reqs = _requests("r", [5, 40, 130, 17, 70, 200], 8, seed=0)
    reqs.append(("shared", reqs[4][1][:48] + [7, 8, 9], reqs[4][2]))     # 3 cached blocks
    eager = run_to_completion(Engine(EngineConfig(**kw)), reqs)
    engine = Engine(EngineConfig(**kw))
    seen = _with_traced_step_graphs(engine, 96)
    assert run_to_completion(engine, reqs) == eager
    assert any(p and d for _, _, p, d in seen), "no step mixed prefill chunks with decodes"
    assert any(t < b for t, b, _, _ in seen), "no step was padded to its bucket"
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks


@pytest.mark.gpu
@pytest.mark.parametrize("weights,sparse,bound", [("bf16", None, 2e-2), ("fp8", None, 5e-2),
                                                  ("nvfp4", None, 2e-2), ("bf16", "magnitude", 2e-2),
                                                  ("fp8", "magnitude", 5e-2)])
def test_gpu_step_graphs_against_the_eager_forward(weights, sparse, bound):
    """llama-3.2-1b shapes, every weight format: each prefill or mixed step replayed through the
    captured pieces, then run eagerly on the same batch (its K/V writes are the same rows again):
    the hidden states agree within the format's rounding (GEMMs at the bucket's M may take other
    kernels; FP8's per-row activation scales let one rounding flip a code by 1/8), and the steps
    cover chunked prompts, prefills beside decodes and padded buckets."""
    engine = Engine(EngineConfig(model="llama-3.2-1b", weights=weights, sparse_ffn=sparse,
                                 kv_cache_tokens=32768, max_num_batched_tokens=2048, seed=0))
    graphs = engine.step_graphs
    assert graphs is not None and len(graphs.pieces) == len(graphs.buckets)
    seen, run = [], graphs.run

    def checked(batch):
        hidden = run(batch).clone()
        eager = engine.model(batch.input_ids, batch.positions, batch)
        err = rel_err(hidden, eager)
        t = batch.input_ids.shape[0]
        seen.append((t, graphs.bucket(t), batch.num_prefills, batch.num_decodes, err))
        return hidden
    graphs.run = checked
    try:
        reqs = _requests("a", [3000, 100, 700], 12, seed=1)
        for rid, ids, params in reqs:
            engine.add_request(rid, ids, params, lambda chunk: None)
        for _ in range(3):
            engine.step()
        late = _requests("b", [50, 333], 4, seed=2)
        for rid, ids, params in late:
            engine.add_request(rid, ids, params, lambda chunk: None)
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
    assert any(p and d for _, _, p, d, _ in seen), seen
    assert any(t < b for t, b, _, _, _ in seen), seen
    assert all(err < bound for *_, err in seen), seen
