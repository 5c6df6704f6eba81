"""Continuous batching over the paged KV cache: batched == alone, preemption, prefix cache, aborts.

Greedy tokens computed in different batches are compared with tests/ties.py: equal, or parted at a
near-tie that rounding at another batch shape may flip (a CPU BLAS need not round the same at every
M). Bitwise batch invariance is not a property the engine promises."""
import dataclasses
import random

import pytest
import torch
from ties import assert_same_greedy

from engine import LLM, ContextLengthError, SamplingParams
from engine.quality import eval_text
from tests.cute_ptx import SANITIZER, run_under_memcheck
from tests.numerics import rel_err

# logprobs=2: the top two tokens at each step, to tell a near-tie from a fault.
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)


def _prompts(tokenizer, lengths, seed=0):
    ids = tokenizer.encode(eval_text(), add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for n in lengths:
        start = rng.randrange(0, len(ids) - n)
        out.append(ids[start:start + n])
    return out


@pytest.fixture(scope="module")
def prompts16(llm):
    return _prompts(llm.tokenizer, [1, 2, 7, 15, 16, 17, 31, 33, 64, 100, 128, 150, 199, 250, 299, 300])


@pytest.fixture(scope="module")
def alone(llm, prompts16):
    return [llm.generate([p], GREEDY)[0] for p in prompts16]


def test_batched_equals_alone(llm, prompts16, alone):
    together = llm.generate(prompts16, GREEDY)
    assert_same_greedy(together, alone)
    m = llm.metrics()
    assert m["kv_blocks_used"] == 0 and m["running"] == 0 and m["waiting"] == 0
    assert m["graph_decode_batch_sizes"] == m["graph_step_sizes"] == 0     # the CPU captures none


def test_tuning_comes_before_the_kv_cache_is_sized(monkeypatch):
    # The KV cache is sized from the memory free after tuning, so the timing's buffers (up to the
    # largest step's activations) never have to fit beside a cache that took the device's memory.
    from engine import engine as engine_module
    order = []
    tune, size = engine_module.Engine._tune, engine_module.Engine._num_kv_blocks
    monkeypatch.setattr(engine_module.Engine, "_tune", lambda self: order.append("tune") or tune(self))
    monkeypatch.setattr(engine_module.Engine, "_num_kv_blocks", lambda self: order.append("size") or size(self))
    LLM("llama-tiny", device="cpu", kv_cache_tokens=256).shutdown(timeout=1)
    assert order == ["tune", "size"]


def test_small_pool_preempts_and_recomputes(prompts16, alone):
    # 48 blocks x 16 = 768 tokens for ~2,100 tokens of prompts plus outputs: preemption is certain.
    # A small step budget also chunks the long prompts.
    small = LLM("llama", device="cpu", dtype="fp32", kv_cache_tokens=768, max_num_batched_tokens=128)
    try:
        outs = small.generate(prompts16, GREEDY)
        assert_same_greedy(outs, alone)
        m = small.metrics()
        assert m["preemptions"] > 0
        assert m["kv_blocks_free"] == m["kv_blocks_total"] and m["kv_blocks_used"] == 0
        # A request that could never fit the pool is refused at once, not queued forever.
        with pytest.raises(ContextLengthError, match="KV blocks"):
            small.generate([list(range(100, 700))], SamplingParams(max_tokens=400))
    finally:
        small.shutdown(timeout=1)


def test_prefix_cache_reuses_blocks(llm):
    base = _prompts(llm.tokenizer, [40], seed=3)[0]            # 2 full blocks + 8 tokens
    second = base[:32] + _prompts(llm.tokenizer, [9], seed=4)[0]
    before = llm.metrics()
    llm.generate([base], GREEDY)
    out = llm.generate([second], GREEDY)[0]
    after = llm.metrics()
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 2
    assert out.num_cached_tokens == 32          # the two shared blocks (a 41-token prompt has no third)
    nocache = LLM("llama", device="cpu", dtype="fp32", enable_prefix_caching=False)
    try:
        [alone] = nocache.generate([second], GREEDY)
        assert_same_greedy([alone], [out])
        assert nocache.metrics()["prefix_cache_hits"] == 0 and alone.num_cached_tokens == 0
    finally:
        nocache.shutdown(timeout=1)


def test_cached_tokens_count_the_first_admission_only():
    """A sequence's num_cached_tokens: the prompt tokens the prefix cache served when it was first
    admitted. After a preemption it re-matches blocks it computed itself; those do not count."""
    from engine.memory.kv_cache import BlockPool
    from engine.scheduler import Scheduler, Sequence
    sched = Scheduler(BlockPool(16, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    params = SamplingParams(max_tokens=4)
    first = Sequence("first", list(range(1, 11)), params, 4)           # 2 full blocks of 4 + 2 tokens
    sched.add(first)
    [item] = sched.schedule()
    sched.advance(item)                                                 # its 2 full blocks published
    assert first.num_cached_tokens == 0
    second = Sequence("second", list(range(1, 9)) + [90, 91, 92], params, 4)   # shares those 8 tokens
    sched.add(second)
    [item] = sched.schedule()
    assert (item.start, second.num_cached_tokens) == (8, 8)
    sched.advance(item)
    sched._preempt(first)
    [item] = sched.schedule()                   # re-admitted: its own 2 blocks are found again
    assert item.seq is first and item.start == 8 and first.num_cached_tokens == 0


def test_abort_frees_blocks(llm):
    stream = llm.stream(list(range(200, 300)), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    it = iter(stream)
    for _ in range(3):
        next(it)
    assert llm.metrics()["kv_blocks_used"] > 0
    stream.abort()
    rest = list(it)
    assert rest[-1].finish_reason == "abort"
    m = llm.metrics()
    assert m["kv_blocks_used"] == 0 and m["running"] == 0


def test_context_limit_is_named(llm):
    with pytest.raises(ContextLengthError, match=f"max_model_len.*{llm.max_model_len}"):
        llm.generate([[7] * llm.max_model_len], SamplingParams(max_tokens=1))
    with pytest.raises(ContextLengthError, match="max_tokens"):
        llm.generate([[7] * 10], SamplingParams(max_tokens=llm.max_model_len))


def test_logits_through_the_cache_match_one_pass(llm):
    """LLM.logits(cache_chunk=n) computes each position as serving does, through the paged KV cache n
    tokens a step (n = 1: decode steps): with the cache in the model dtype, the one pass's logits up
    to fp32 rounding. Its blocks go back to the pool; a bad chunk is refused by name."""
    from engine.quality import eval_token_windows
    ids = eval_token_windows(llm.tokenizer, 200, 1)[0]
    one = llm.logits(ids)
    for chunk, n in ((1, 40), (16, 200), (100, 200)):
        got = llm.logits(ids[:n], cache_chunk=chunk)
        assert rel_err(got, one[:n]) < 1e-4, chunk
    assert llm.metrics()["kv_blocks_used"] == 0
    with pytest.raises(ValueError, match="cache_chunk"):
        llm.logits(ids, cache_chunk=0)
    with pytest.raises(TypeError, match="cache_chunk"):
        llm.logits(ids, cache_chunk="16")
    with pytest.raises(ValueError, match="token_ids"):
        llm.logits([5] * (llm.max_model_len + 1), cache_chunk=16)
    assert llm.metrics()["kv_blocks_used"] == 0


def test_fp8_kv_cache():
    """kv_cache_dtype='fp8': e4m3 K/V with an fp32 scale per token and KV head (132 bytes per 128
    values, against 512 in fp32 and 256 in bf16), read through the cache close to the model-dtype
    cache (measured on this model: 1.3e-2 relative logit error, 97.7% top-1 agreement over 256
    tokens in chunks of 16), and it generates."""
    from engine.memory.kv_cache import KVCache
    from engine.quality import eval_token_windows
    assert KVCache.bytes_per_token(30, 3, 128, torch.bfloat16, fp8=True) == 2 * 30 * 3 * 132
    assert KVCache.bytes_per_token(30, 3, 128, torch.bfloat16) == 2 * 30 * 3 * 256
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("llama", device="cpu", kv_cache_dtype="int8")
    ref = LLM("llama", device="cpu", dtype="fp32", kv_cache_tokens=4096)
    fp8 = LLM("llama", device="cpu", dtype="fp32", kv_cache_tokens=4096, kv_cache_dtype="fp8")
    try:
        cache = fp8.engine.kv_cache
        assert cache.k.dtype == torch.float8_e4m3fn and cache.k_scale.dtype == torch.float32
        ids = eval_token_windows(ref.tokenizer, 256, 1)[0]
        want, got = ref.logits(ids), fp8.logits(ids, cache_chunk=16)
        assert rel_err(got, want) < 0.05
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.9
        out = fp8.generate([ids[:50]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1))[0]
        assert len(out.token_ids) == 8 and all(-1e4 < t.logprob <= 0 for t in out.logprobs)
        assert fp8.metrics()["kv_blocks_used"] == 0
    finally:
        ref.shutdown(timeout=1)
        fp8.shutdown(timeout=1)


def test_block_pool_refcounts_and_eviction():
    from engine.memory.kv_cache import BlockPool, block_hash
    pool = BlockPool(4, 16)
    a, b = pool.allocate(), pool.allocate()
    toks = tuple(range(16))
    h = block_hash(None, toks)
    pool.publish(a, h, toks)
    assert pool.lookup(h, toks) == a and pool.ref_count[a] == 2
    assert pool.lookup(h, tuple(range(1, 17))) is None          # verified against the tokens
    pool.release(a)
    pool.release(a)
    assert pool.num_free == 3                                     # cached but free
    assert pool.lookup(h, toks) == a and pool.num_free == 2       # revived from the free list
    pool.release(a)
    pool.release(b)
    for _ in range(4):
        pool.allocate()                                           # the pool reclaims cached blocks
    assert pool.lookup(h, toks) is None


@pytest.mark.gpu
def test_batched_equals_alone_gpu():
    """The same on the GPU path (fp32, so that only a near-tie can part the tokens)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = LLM("llama-tiny", device="cuda", dtype="fp32")
    try:
        prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([1, 5, 16, 17, 40, 129, 300, 77])]
        p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
        alone = [gpu.generate([q], p)[0] for q in prompts]
        assert_same_greedy(gpu.generate(prompts, p), alone)
    finally:
        gpu.shutdown(timeout=1)


@pytest.mark.gpu
def test_gpu_failed_graph_capture_runs_eagerly_and_says_so(monkeypatch, caplog):
    """Where a decode graph cannot be captured, the engine logs why, runs decode eagerly with the
    tokens the graphs give, and its metrics (and /metrics) say which steps replay as graphs."""
    import logging
    from engine import cuda_graphs
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate([1, 17, 130])]
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    kw = {"device": "cuda", "dtype": "fp32", "kv_cache_tokens": 4096}
    graphs = LLM("llama-tiny", **kw)
    try:
        m = graphs.metrics()
        assert m["graph_decode_batch_sizes"] > 0 and m["graph_step_sizes"] > 0
        want = graphs.generate(prompts, p)
    finally:
        graphs.shutdown(timeout=1)

    def fail(self):
        raise RuntimeError("injected capture failure")
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "capture", fail)
    with caplog.at_level(logging.WARNING, logger="microengine"):
        eager = LLM("llama-tiny", **kw)
    try:
        assert "decode steps run eagerly" in caplog.text and "injected capture failure" in caplog.text
        m = eager.metrics()
        assert m["graph_decode_batch_sizes"] == 0 and m["graph_step_sizes"] > 0
        assert_same_greedy(eager.generate(prompts, p), want)
    finally:
        eager.shutdown(timeout=1)


# The engine's configurations, each with its own kernels on every path: prefill, decode, attention.
MEMCHECK_CONFIGS = {"bf16": {}, "fp8": {"weights": "fp8"}, "nvfp4": {"weights": "nvfp4"},
                    "2:4": {"sparse_ffn": "magnitude"}, "2:4+fp8": {"sparse_ffn": "magnitude", "weights": "fp8"},
                    "fp8 KV cache": {"kv_cache_dtype": "fp8"}}


@pytest.mark.gpu
@pytest.mark.skipif(SANITIZER is None, reason="needs compute-sanitizer (the CUDA toolkit)")
@pytest.mark.parametrize("name", list(MEMCHECK_CONFIGS))
def test_every_kernel_stays_inside_its_tensors_gpu(name):
    """The engine under compute-sanitizer's memcheck, each tensor its own allocation: prompts of
    3 to 300 tokens (chunked past a 256-token step, partial tiles and pages everywhere), decode,
    and two prompts that hit the prefix cache. No read or write may leave its tensor. Graphs and
    tuning off: capture needs torch's caching allocator, which memcheck runs without, and tuning
    would only time kernels that run here anyway."""
    run_under_memcheck(f"""
        import torch
        from engine import LLM, SamplingParams
        llm = LLM("llama-tiny", device="cuda", tune="off", cuda_graphs=False, kv_cache_tokens=2048,
                  max_num_batched_tokens=256, **{MEMCHECK_CONFIGS[name]!r})
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (3, 40, 130, 300)]
        p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, p)
        outs += llm.generate([prompts[2] + prompts[1], prompts[3][:200]], p)
        assert [len(o.token_ids) for o in outs] == [6] * 6
        llm.shutdown()
        """)


@pytest.mark.gpu
def test_fused_kernels_on_and_off_give_the_same_tokens_gpu():
    """llama-3.2-1b shapes: the fused norm/RoPE/SwiGLU kernels against their references, whole model.
    fp32, because random weights give near-flat logits whose greedy ties bf16 rounding would flip;
    a tie closer than fp32 rounding may still part them (tests/ties.py)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = LLM("llama-3.2-1b", device="cuda", dtype="fp32", kv_cache_tokens=16384, cuda_graphs=False)
    try:
        prompts = [list(range(11 + i, 11 + i + n)) for i, n in enumerate([1, 9, 64, 300])]
        p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
        fused = gpu.generate(prompts, p)
        gpu.engine.model.set_fused_kernels(False)
        reference = gpu.generate(prompts, p)
        assert_same_greedy(fused, reference)
    finally:
        gpu.shutdown(timeout=1)


def _limit_streaming_three_of_four_layers(engine, kv_tokens: int) -> float:
    """A gpu_memory_limit (GiB) under which 3 of llama-tiny's 4 (equal) layers stream: that needs
    the non-layer weights, KV cache and activations + 1 resident layer + 2 buffers = base + 3
    layers; 3.5 layers is less than the 4 that all-resident needs."""
    from engine.streams import layer_stream_bytes
    base = engine._non_layer_bytes() + kv_tokens * engine.kv_bytes_per_token() + engine._activation_reserve()
    return (base + 3.5 * layer_stream_bytes(engine.model.layers[0])) / 2**30


def _resident_tokens_and_streaming_limit(kw: dict, prompts, params) -> tuple[list, float]:
    """llama-tiny's tokens with every layer resident (LLM keywords kw), and the memory limit under
    which 3 of its layers stream with kw's KV cache."""
    resident = LLM("llama-tiny", **kw)
    try:
        want = [o.token_ids for o in resident.generate(prompts, params)]
        return want, _limit_streaming_three_of_four_layers(resident.engine, kw["kv_cache_tokens"])
    finally:
        resident.shutdown(timeout=1)


def test_layers_streamed_under_a_memory_limit_give_the_same_tokens():
    """gpu_memory_limit below what the model needs: some decoder layers live in (pinned) host memory
    and stream through two buffers; the output does not change. On the CPU the streamer runs on
    no-op streams: this checks the planning and the hooks; the overlap itself is a GPU matter."""
    kw = dict(device="cpu", dtype="fp32", kv_cache_tokens=2048, max_num_batched_tokens=256, max_num_seqs=16)
    prompts = [list(range(20, 20 + n)) for n in (5, 40, 90)]
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want, limit_gib = _resident_tokens_and_streaming_limit(kw, prompts, p)
    streamed = LLM("llama-tiny", gpu_memory_limit=limit_gib, **kw)
    try:
        assert streamed.engine.streamer is not None
        assert len(streamed.engine.streamer.order) == 3
        assert [o.token_ids for o in streamed.generate(prompts, p)] == want
    finally:
        streamed.shutdown(timeout=1)
    with pytest.raises(ValueError, match="too small even with every layer streamed"):
        LLM("llama-tiny", gpu_memory_limit=0.001, **kw)


def test_layers_are_placed_one_at_a_time_under_a_memory_limit(monkeypatch):
    """Under a memory limit the model is read into host memory and each decoder layer is moved to
    the device, converted, and (if it streams) handed to pinned host memory before the next one is
    moved: the device never holds the whole model. Here with fp8 weights, converted per layer, the
    tokens equal those of the resident fp8 model."""
    from engine.streams import LayerStreamer
    kw = dict(device="cpu", dtype="fp32", weights="fp8", kv_cache_tokens=2048, max_num_batched_tokens=256,
              max_num_seqs=16)
    prompts = [list(range(30, 30 + n)) for n in (7, 60)]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want, limit_gib = _resident_tokens_and_streaming_limit(kw, prompts, p)
    events = []
    move, adopt = torch.nn.Module.to, LayerStreamer.adopt

    def spy_move(module, device):
        if type(module).__name__ in ("LlamaDecoderLayer", "Embedding", "RMSNorm", "Linear"):
            events.append(("move", module.self_attn.layer_idx if hasattr(module, "self_attn") else None))
        return move(module, device)

    def spy_adopt(self, i):
        assert self.layers[i].mlp.gate_up_proj.backend.name != "dense", "adopted before conversion"
        events.append(("adopt", i))
        adopt(self, i)
    monkeypatch.setattr(torch.nn.Module, "to", spy_move)
    monkeypatch.setattr(LayerStreamer, "adopt", spy_adopt)
    streamed = LLM("llama-tiny", gpu_memory_limit=limit_gib, **kw)
    try:
        order = streamed.engine.streamer.order
        assert len(order) == 3
        layer_events = [ev for ev in events if ev != ("move", None)]
        expect = []
        for i in range(4):
            expect.append(("move", i))
            if i in order:
                expect.append(("adopt", i))
        assert layer_events == expect
        assert [o.token_ids for o in streamed.generate(prompts, p)] == want
    finally:
        streamed.shutdown(timeout=1)


# ----------------------------------------------------------------------------- pipelined steps

def _mixed_requests(tokenizer):
    """Greedy and seeded sampling, stop strings, EOS, logprobs and penalties, in one batch."""
    prompts = _prompts(tokenizer, [5, 30, 17, 64, 9, 120], seed=7)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=11),
              SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=5, logprobs=3),
              SamplingParams(max_tokens=12, temperature=0, stop=[" the", "\n"]),
              SamplingParams(max_tokens=1, temperature=0),
              SamplingParams(max_tokens=18, temperature=0, frequency_penalty=0.5, presence_penalty=0.3)]
    return prompts, params


def _assert_same_outputs(got, want):
    """Tokens, text, finish reasons and the top tokens' ids equal; log-probability values within
    1e-4. Overlapped steps keep a request that finished on a stop string in the step after it (its
    token is dropped), so one step may hold one more row than its serialised twin, and a BLAS may
    round a GEMM over another number of rows differently."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert (g.logprobs is None) == (w.logprobs is None)
        for a, b in zip(g.logprobs or [], w.logprobs or [], strict=True):
            assert (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top])
            assert abs(a.logprob - b.logprob) < 1e-4
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


def test_overlapped_steps_give_what_serialised_steps_give(llm):
    """The default engine reads each step's tokens one step late and feeds them to the next step
    from the device; the same batch with overlap off must come out the same. Two batches, each run
    both ways: with the penalised request (while it runs, steps serialise) and without it (every
    step overlaps)."""
    prompts, params = _mixed_requests(llm.tokenizer)
    batches = [(prompts, params), (prompts[:-1], params[:-1])]
    serial = LLM("llama", device="cpu", dtype="fp32", overlap=False)
    try:
        want = [serial.generate(p, q) for p, q in batches]
    finally:
        serial.shutdown(timeout=1)
    assert llm.engine.config.overlap
    for (p, q), w in zip(batches, want):
        _assert_same_outputs(llm.generate(p, q), w)
    assert llm.metrics()["kv_blocks_used"] == 0


def test_a_step_hands_out_the_tokens_of_the_step_before():
    from engine.config import EngineConfig
    from engine.engine import Engine
    engine = Engine(EngineConfig(model="llama-tiny", device="cpu", dtype="fp32", kv_cache_tokens=1024))
    got, aborted = [], []
    engine.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                       got.append)
    engine.add_request("b", list(range(40, 50)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                       aborted.append)
    assert engine.step() == 30 and got == []             # prefill queued; its tokens not read yet
    assert engine.in_flight is not None
    engine.step()                                        # decode queued, the prefill's tokens read
    assert [c.completion_tokens for c in got] == [1]
    engine.abort("b")                                    # while its next token is in flight
    assert aborted[-1].finish_reason == "abort" and aborted[-1].completion_tokens == 1
    engine.step()
    assert len(got) == 2 and len(aborted) == 2           # nothing more for the aborted request
    assert engine.step() == 0                            # "a" awaits its last token: nothing to run
    assert [c.completion_tokens for c in got] == [1, 2, 3] and got[-1].finish_reason == "length"
    assert not engine.has_work() and engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks


def steady_state_without_sync(engine, kinds, requests: int = 12) -> None:
    """Run 40-token requests of each sampling kind through the engine, with the 30 steps after
    the warm-up (a newcomer's prefill joining at step 10) under sync_debug_mode "error"."""
    outs = {}
    for i in range(requests):
        outs[f"r{i}"] = []
        engine.add_request(f"r{i}", list(range(5 + i, 40 + 3 * i)), kinds[i % len(kinds)], outs[f"r{i}"].append)
    for _ in range(6):              # prefills, first decodes, graph buckets and allocations warmed
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(30):
            if step == 10:          # a newcomer's prefill joins the running decodes
                outs["late"] = []
                engine.add_request("late", list(range(300, 377)), kinds[0], outs["late"].append)
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while engine.has_work():
        engine.step()
    assert all(len([c for c in chunks if c.token_ids]) == 40 for chunks in outs.values())


@pytest.mark.gpu
def test_gpu_step_loop_steady_state_never_synchronises():
    """Under torch.cuda.set_sync_debug_mode("error") any hidden host-device synchronisation raises:
    the pipelined step loop must run decode steps (CUDA graphs), prefills joining them and sampling
    of every kind without one."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    engine = Engine(EngineConfig(model="llama-tiny", device="cuda", dtype="bf16", kv_cache_tokens=8192))
    kinds = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=40, temperature=0.9, top_p=0.8, top_k=50, ignore_eos=True),
             SamplingParams(max_tokens=40, temperature=0.7, seed=3, ignore_eos=True, logprobs=2)]
    steady_state_without_sync(engine, kinds)
    assert engine.ring.host_waits == 0
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks


@pytest.mark.gpu
def test_gpu_overlap_and_offload_give_the_same_tokens():
    """fp32 on the GPU: pipelined steps, serialised steps and decoder layers streamed from pinned
    host memory under a memory limit all give the same greedy and seeded tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([1, 5, 17, 40, 129, 300])]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=9, ignore_eos=True)] * 3
    kw = {"device": "cuda", "dtype": "fp32", "kv_cache_tokens": 8192}
    results, limit = [], None
    for extra in ({}, {"overlap": False}, "offload"):
        if extra == "offload":
            extra = {"gpu_memory_limit": limit}
        gpu = LLM("llama-tiny", **kw, **extra)
        try:
            e = gpu.engine
            if limit is None:
                limit = _limit_streaming_three_of_four_layers(e, 8192)
            if "gpu_memory_limit" in extra:
                assert e.streamer is not None and len(e.streamer.order) == 3
            results.append([o.token_ids for o in gpu.generate(prompts, params)])
        finally:
            gpu.shutdown(timeout=1)
    assert results[0] == results[1] == results[2]


@pytest.mark.gpu
def test_gpu_model_larger_than_the_memory_limit_loads_and_runs_within_it():
    """llama-3.2-1b shapes in fp32 (4.9 GB of weights) under a 3.6 GiB device memory limit: the model
    never fits the device at once, loads layer by layer, and neither the load nor generation
    allocates more than the limit; the tokens equal the resident model's (both eager), or part at a
    near-tie (tests/ties.py: with random weights the logits are near-flat, and in bf16 a rounding
    difference between the two placements parted them once in a run of the whole file)."""
    import gc
    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(device="cuda", dtype="fp32", kv_cache_tokens=4096, max_num_batched_tokens=2048, max_num_seqs=16,
              cuda_graphs=False)
    prompts = [list(range(100 + i, 100 + i + n)) for i, n in enumerate([3, 50, 200])]
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    resident = LLM("llama-3.2-1b", **kw)
    try:
        want = resident.generate(prompts, p)
        model = resident.engine.model
        weight_bytes = sum(t.nbytes for t in model.state_dict().values())
    finally:
        resident.shutdown(timeout=1)
    del resident, model
    gc.collect()
    torch.cuda.empty_cache()
    limit = 3.6 * 2**30
    assert weight_bytes > limit
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    streamed = LLM("llama-3.2-1b", gpu_memory_limit=limit / 2**30, **kw)
    try:
        assert streamed.engine.streamer is not None
        got = streamed.generate(prompts, p)
        peak = torch.cuda.max_memory_allocated() - before
        assert peak <= limit, f"peak {peak / 2**30:.2f} GiB over the {limit / 2**30:.2f} GiB limit"
        assert_same_greedy(got, want)
    finally:
        streamed.shutdown(timeout=1)


def test_engine_reads_each_steps_tokens_after_queuing_the_next():
    """The engine's own step loop on logging fake streams: step N+1's upload and compute are queued
    before the host waits for step N's tokens, that wait is the host's only one, and step N's token
    reaches the request's sink right after it, before step N+2 is queued: one token per step."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.memory.host_ring import PinnedRing
    from engine.streams import FakeStreams, TokenReadback
    engine = Engine(EngineConfig(model="llama-tiny", device="cpu", dtype="fp32", kv_cache_tokens=1024))
    s = engine.streams = FakeStreams()
    engine.ring, engine.readback = PinnedRing(3, 1 << 12, s), TokenReadback(s, num_slots=2)
    out = []

    def sink(chunk):
        out.append(chunk)
        s.log.append(("sink", chunk.completion_tokens))

    engine.add_request("a", list(range(10, 40)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       sink)
    while engine.has_work():
        s.log.append(("step",))
        engine.step()
    assert [c.completion_tokens for c in out] == [1, 2, 3, 4, 5, 6]
    steps = [i for i, e in enumerate(s.log) if e == ("step",)]
    for n in range(1, 6):           # the step call that queues step n reads step n - 1's tokens
        part = s.log[steps[n]:steps[n + 1]]
        kinds = [e[0] for e in part]
        assert kinds.count("host_wait") == 1
        wait = kinds.index("host_wait")
        assert part[wait] == ("host_wait", f"d2h{(n - 1) % 2}")
        assert ("copy", "h2d", f"inputs{n % 3}") in part[:wait]      # step n's inputs went up first
        assert ("copy", "d2h", f"tokens{n}") in part[:wait]          # and its tokens were sent
        sinks = [e for e in part if e[0] == "sink"]
        assert sinks == [("sink", n)] and part.index(sinks[0]) > wait   # step n - 1's token, once read


# The formats of the GEMMs before and after the norms handed off on llama-tiny. 2:4: the dense
# o_proj hands to the 2:4 gate/up where the SwiGLU kernel follows it (the 9-token prefill); the 2:4
# down_proj (K = 704) has no sparse-MMA configuration, so the norm after it stays.
HANDOFFS = {("bf16", None): ({"DenseWeight"}, {"DenseWeight"}),
            ("bf16", "magnitude"): ({"DenseWeight"}, {"Sparse24Weight"})}


@pytest.mark.gpu
@pytest.mark.parametrize("weights,sparse_ffn", list(HANDOFFS))
def test_gpu_norm_handoff_gives_the_norm_kernels_tokens(weights, sparse_ffn, monkeypatch):
    """Decode on Hopper hands each RMSNorm between two GEMMs that can off (models/llama.py
    `NormedRows`; dense: the streaming kernel; 2:4: the sparse-MMA kernel, beside the dense attention
    GEMMs): against the same engine with every norm on the norm kernel, the greedy tokens of four
    prompts decoding together in CUDA graphs agree up to near-ties, and the logits of a 9-token
    prompt (its prefill takes the hand-off too) differ by bf16 rounding. Tuning off, so that both
    engines run the same kernels."""
    import models.llama
    torch.manual_seed(0)
    prompts = [torch.randint(10, 1000, (n,)).tolist() for n in (9, 30, 64, 100)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    producers, consumers = set(), set()
    real_after, real_project = models.llama.NormedRows.after, models.llama.NormedRows.project
    monkeypatch.setattr(models.llama.NormedRows, "after",
                        staticmethod(lambda *a: producers.add(type(a[0].backend).__name__) or real_after(*a)))
    monkeypatch.setattr(models.llama.NormedRows, "project", lambda self, consumer, swiglu=False: consumers.add(
        type(consumer.backend).__name__) or real_project(self, consumer, swiglu))
    results = {}
    for handoff in (True, False):
        if not handoff:
            monkeypatch.setattr(models.llama, "norm_handoff", lambda *a, **k: False)
        llm = LLM("llama-tiny", device="cuda", dtype="bf16", tune="off", kv_cache_tokens=4096, seed=3,
                  weights=weights, sparse_ffn=sparse_ffn)
        try:
            results[handoff] = (llm.logits(prompts[0]), llm.generate(prompts, params))
        finally:
            llm.shutdown(timeout=1)
        if handoff:
            assert (producers, consumers) == HANDOFFS[weights, sparse_ffn]
            producers.clear()
            consumers.clear()
    (logits, outs), (ref_logits, ref_outs) = results[True], results[False]
    assert rel_err(logits, ref_logits) < 2e-2
    assert_same_greedy(outs, ref_outs, tol=0.05)   # random weights in bf16: ties are loose


@pytest.mark.gpu
@pytest.mark.parametrize("weights,prompt_len,bound", [("fp8", 40, 0.06), ("nvfp4", 40, 0.03), ("nvfp4", 200, 0.06)])
def test_gpu_quantised_model_paths_match_their_reference(weights, prompt_len, bound, monkeypatch):
    """The whole model with FP8 / NVFP4 weights on the GPU kernels (fused norms quantising the
    activations, CuTe DSL / Triton GEMMs) against the same model with every quantised GEMM and every
    norm sent to its PyTorch reference: the same quantised math, so only rounding may differ (a
    wiring mistake, such as a scale in the wrong layout, lands near 1). NVFP4's reference is sm_90's
    numerics (`sm90_reference_kernels`): a prompt of 200 tokens takes the FP8 path, its activations
    quantised by the norms and the SwiGLU. The step path's first token agrees with the whole-prompt
    pass, and decode steps (CUDA graphs) give finite log-probabilities. The bounds of e4m3
    activations are wider: e4m3 keeps 3 mantissa bits, so where the fused norm and the reference
    round a bf16 input differently a code moves by up to 1/8, and such flips compound over the
    layers; the bounds stay under the FP8 model's own distance from the dense model."""
    from engine.formats import fp8, nvfp4
    from engine.kernels import select
    torch.manual_seed(0)
    prompt = torch.randint(10, 1000, (prompt_len,)).tolist()
    gpu = LLM("llama-tiny", device="cuda", dtype="bf16", weights=weights, kv_cache_tokens=4096, seed=3)
    try:
        kernels = gpu.logits(prompt)
        out = gpu.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                    logprobs=5))[0]
        # Every quantised GEMM on its reference: each op's table left with the reference alone.
        for table in (fp8.FP8_GEMM, nvfp4.NVFP4_GEMM):
            for arch in table:
                monkeypatch.setitem(table, arch, [k for k in table[arch] if k.reference])
        monkeypatch.setitem(nvfp4.NVFP4_GEMM, 9, nvfp4.sm90_reference_kernels())
        monkeypatch.setattr(select, "_CHOSEN", {})
        gpu.engine.model.set_fused_kernels(False)
        reference = gpu.logits(prompt)
    finally:
        gpu.shutdown(timeout=1)
    assert torch.isfinite(kernels).all()
    assert rel_err(kernels, reference) < bound
    lp = kernels[-1].float().log_softmax(-1)
    first = out.logprobs[0]
    assert first.token_id in lp.topk(3).indices.tolist()      # ties aside, the same first token
    assert abs(lp[first.token_id].item() - first.logprob) < 0.05
    assert len(out.logprobs) == 8 and all(-1e4 < t.logprob <= 0 for t in out.logprobs)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 128])
def test_gpu_fp8_kv_cache_against_the_model_dtype_cache(monkeypatch, head_dim):
    """bf16 on the GPU kernels, with CUDA graphs: an FP8 cache written by RoPE's launch (prefill) and
    the decode kernel (decode), read by the prefill kernel's prefix tiles and the decode kernel,
    against the bf16 cache, through the cache in chunks of 16 and in decode steps; served steps
    (the decode graphs) give finite log-probabilities and start where the whole-prompt pass does.
    Heads of 32 decode on the Triton kernel, heads of 128 on the Gluon one (sm_89+)."""
    from models import presets
    name = "llama-tiny"
    if head_dim != presets.SHAPE_PRESETS[name].head_dim:
        name = f"llama-tiny-hd{head_dim}"
        monkeypatch.setitem(presets.SHAPE_PRESETS, name,
                            dataclasses.replace(presets.SHAPE_PRESETS["llama-tiny"], head_dim=head_dim))
    torch.manual_seed(0)
    prompt = torch.randint(10, 1000, (300,)).tolist()
    kw = dict(device="cuda", dtype="bf16", kv_cache_tokens=8192, seed=3)
    ref = LLM(name, **kw)
    fp8 = LLM(name, kv_cache_dtype="fp8", **kw)
    try:
        assert fp8.engine.kv_cache.k.dtype == torch.float8_e4m3fn
        for chunk, n in ((16, 300), (1, 48)):
            want, got = ref.logits(prompt[:n], cache_chunk=chunk), fp8.logits(prompt[:n], cache_chunk=chunk)
            assert torch.isfinite(got).all()
            assert rel_err(got, want) < 0.05, chunk
        whole = fp8.logits(prompt)[-1].float().log_softmax(-1)
        out = fp8.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1))[0]
        assert out.logprobs[0].token_id in whole.topk(3).indices.tolist()
        assert len(out.logprobs) == 8 and all(-1e4 < t.logprob <= 0 for t in out.logprobs)
    finally:
        ref.shutdown(timeout=1)
        fp8.shutdown(timeout=1)


@pytest.mark.gpu
def test_gpu_preemption_prefix_cache_abort_and_limits():
    """The CPU tests above on the GPU path (llama-tiny, fp32, tokens compared up to near-ties):
    a pool too small for all requests preempts and recomputes with unchanged outputs and no leaked
    block; chunked prefills attend to their paged prefix; a shared 2-block prefix is served from the
    cache with unchanged output; an abort frees its blocks; impossible requests are refused."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([1, 2, 7, 15, 16, 17, 31, 33, 64, 100,
                                                                     128, 150, 199, 250, 299, 300])]
    big = LLM("llama-tiny", device="cuda", dtype="fp32", kv_cache_tokens=16384)
    try:
        want = big.generate(prompts, GREEDY)
        base = list(range(500, 540))                        # 2 full blocks + 8 tokens
        second = base[:32] + list(range(900, 909))
        big.generate([base], GREEDY)
        before = big.metrics()["prefix_cache_hits"]
        cached = big.generate([second], GREEDY)
        assert big.metrics()["prefix_cache_hits"] - before >= 2
        stream = big.stream(list(range(200, 300)), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        it = iter(stream)
        for _ in range(3):
            next(it)
        stream.abort()
        assert list(it)[-1].finish_reason == "abort"
        m = big.metrics()
        assert m["kv_blocks_used"] == 0 and m["running"] == 0
    finally:
        big.shutdown(timeout=1)
    small = LLM("llama-tiny", device="cuda", dtype="fp32", kv_cache_tokens=768, max_num_batched_tokens=128,
                enable_prefix_caching=False)
    try:
        assert_same_greedy(small.generate(prompts, GREEDY), want)
        assert_same_greedy(small.generate([second], GREEDY), cached)
        m = small.metrics()
        assert m["preemptions"] > 0 and m["kv_blocks_free"] == m["kv_blocks_total"]
        with pytest.raises(ContextLengthError, match="KV blocks"):
            small.generate([list(range(100, 700))], SamplingParams(max_tokens=400))
        with pytest.raises(ContextLengthError, match="max_model_len"):
            small.generate([[7] * small.max_model_len], SamplingParams(max_tokens=1))
    finally:
        small.shutdown(timeout=1)
