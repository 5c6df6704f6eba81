"""The host side of a step (engine/engine.py, engine/batch.py, the scheduler, the pinned ring):
no Python work per token of a prefill, no wait for the device while a step is queued, and the
layout of a step that mixes prefill chunks with decodes."""
from __future__ import annotations

import sys

import pytest
import torch

from engine.batch import PLACEHOLDER, plan_batch
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledSeq, Sequence

HOST_FILES = ("engine/engine.py", "engine/batch.py", "engine/scheduler.py", "engine/sampling.py",
              "engine/memory/", "engine/streams/")


@pytest.fixture(scope="module")
def engine():
    from engine.config import EngineConfig
    from engine.engine import Engine
    # Blocks of 256 tokens: the host's work per KV block (allocation, prefix hashes) stays small
    # beside what a loop over tokens would cost, so the test below sees the latter.
    return Engine(EngineConfig(model="llama-tiny", device="cpu", kv_cache_tokens=8192, block_size=256,
                               max_num_batched_tokens=4096))


def _host_lines(engine, prompt_len: int) -> int:
    """Lines of the engine's host code run by the step that prefills one prompt of prompt_len."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if any(f in frame.f_code.co_filename.replace("\\", "/") for f in HOST_FILES):
            if event == "line":
                count += 1
            return tracer
        return None
    engine.add_request(f"p{prompt_len}", list(range(10, 10 + prompt_len)),
                       SamplingParams(max_tokens=1, temperature=0), lambda chunk: None)
    sys.settrace(tracer)
    try:
        engine.step()
    finally:
        sys.settrace(None)
    while engine.has_work():
        engine.step()
    return count


def test_a_prefill_step_runs_no_python_per_token(engine):
    """16x the tokens: the host runs per sequence and per KV block, never per token (a loop over
    the 960 more tokens would run at least 960 more lines)."""
    _host_lines(engine, 64)                        # warm: first-use paths
    short, long = _host_lines(engine, 64), _host_lines(engine, 1024)
    assert long - short < (1024 - 64) // 4, (short, long)


def test_queuing_a_step_never_waits_for_the_device(engine):
    """On the CPU the engine's streams log every host wait: queuing a step that joins a prefill to
    running decodes waits for nothing; the only waits are for earlier steps' token readbacks."""
    from engine.streams import FakeStreams
    streams = FakeStreams(keep_log=True)
    engine.streams, engine.ring.streams, engine.readback.streams = streams, streams, streams
    for slot in engine.ring.slots:
        for event in (slot.uploaded, slot.consumed):
            event.log = streams.log
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"d{i}", list(range(20 + i, 60)), params, lambda chunk: None)
    engine.step()
    engine.step()                                  # decodes running, one step in flight
    engine.add_request("late", list(range(100, 400)), params, lambda chunk: None)
    launch = engine._launch

    def watched(scheduled):
        before = len(streams.log)
        out = launch(scheduled)
        waits = [e for e in list(streams.log)[before:] if e[0] == "host_wait"]
        assert not waits, waits
        return out
    engine._launch = watched
    try:
        while engine.has_work():
            engine.step()
    finally:
        del engine._launch


def _seq(rid, prompt, outputs, table, computed):
    seq = Sequence(rid, prompt, SamplingParams(), 100, output_ids=list(outputs), block_table=table)
    seq.num_computed = computed
    return seq


def test_the_layout_of_a_mixed_step():
    """Prefill chunks first (a fresh prompt, a chunk after a cached prefix that does not sample),
    then decodes (one of them waiting for the token still on the device)."""
    bs = 4
    fresh = _seq("a", [1, 2, 3, 4, 5, 6], [], [7, 3], 0)
    chunk = _seq("b", list(range(20, 30)), [], [0, 1, 2], 4)          # tokens 4..7 of 10
    decode = _seq("c", [9, 9, 9], [41, 42], [5, 8], 4)                # its last token: 42
    pending = _seq("d", [8, 8], [PLACEHOLDER], [6], 2)
    sched = [ScheduledSeq(decode, 4, 1), ScheduledSeq(fresh, 0, 6), ScheduledSeq(pending, 2, 1),
             ScheduledSeq(chunk, 4, 4)]
    plan = plan_batch(sched, bs, pending={pending: 5})
    f = {k: v.tolist() if hasattr(v, "tolist") else v for k, (v, _) in plan.fields.items()}    # arrays or lists
    assert (plan.num_prefills, plan.num_prefill_tokens, plan.num_decodes) == (2, 10, 2)
    assert plan.prefill_max_len == 6 and plan.prefill_max_prefix > 0
    assert f["input_ids"] == [1, 2, 3, 4, 5, 6, 24, 25, 26, 27, 42, PLACEHOLDER]
    assert f["positions"] == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 4, 2]
    assert f["slot_mapping"] == [28, 29, 30, 31, 12, 13, 4, 5, 6, 7, 32, 26]
    assert f["prefill_offsets"] == [0, 6, 10] and plan.fields["prefill_offsets"][1] == torch.int32
    assert f["context_lens"] == [6, 8, 5, 3]
    assert f["block_tables"] == [[7, 3, 0], [0, 1, 2], [5, 8, 0], [6, 0, 0]]
    assert f["logits_indices"] == [5, 10, 11]          # the chunk does not reach its last token
    assert [s.seq.request_id for s in plan.sampled] == ["a", "c", "d"] and plan.num_sampled == 3
    assert f["fill_rows"] == [11] and f["fill_src"] == [5]
    # the prefill attention kernel's query blocks through each chunk (one each here)
    assert f["prefill_block_ends"] == [1, 2] and plan.fields["prefill_block_ends"][1] == torch.int32


def test_decode_rows_come_longest_context_first():
    """Decodes scheduled in arrival order (contexts 3, 9, 5, 9) are laid out longest first, ties in
    arrival order, and everything per row (tokens, slots, tables, sampled rows, the fill from the
    step in flight) follows its sequence; the prefill chunk stays in front."""
    bs = 4
    prompt = _seq("p", [1, 2, 3], [], [1], 0)
    short = _seq("s", [7, 7], [71], [2], 2)                         # context 3
    long_a = _seq("a", [5] * 8, [PLACEHOLDER], [3, 4, 5], 8)          # context 9, token on the device
    mid = _seq("m", [6] * 4, [61], [6, 9], 4)                         # context 5
    long_b = _seq("b", [4] * 8, [41], [10, 11, 12], 8)                # context 9
    sched = [ScheduledSeq(short, 2, 1), ScheduledSeq(prompt, 0, 3), ScheduledSeq(long_a, 8, 1),
             ScheduledSeq(mid, 4, 1), ScheduledSeq(long_b, 8, 1)]
    plan = plan_batch(sched, bs, pending={long_a: 2})
    f = {k: v.tolist() if hasattr(v, "tolist") else v for k, (v, _) in plan.fields.items()}
    assert [s.seq.request_id for s in plan.sampled] == ["p", "a", "b", "m", "s"]
    assert f["context_lens"] == [3, 9, 9, 5, 3]
    assert f["input_ids"] == [1, 2, 3, PLACEHOLDER, 41, 61, 71]
    assert f["positions"] == [0, 1, 2, 8, 8, 4, 2]
    assert f["slot_mapping"] == [4, 5, 6, 20, 48, 36, 10]
    assert f["block_tables"] == [[1, 0, 0], [3, 4, 5], [10, 11, 12], [6, 9, 0], [2, 0, 0]]
    assert f["logits_indices"] == [2, 3, 4, 5, 6]
    assert f["fill_rows"] == [3] and f["fill_src"] == [2]


def test_the_prefill_kernels_query_blocks_are_counted_on_the_host():
    """Chunks of 2, BLOCK_M, BLOCK_M + 1 and 3 * BLOCK_M tokens: 1, 1, 2 and 3 query blocks."""
    from engine.kernels.attention import PREFILL_BLOCK_M as m
    lens = [2, m, m + 1, 3 * m]
    seqs = [_seq(str(i), list(range(10, 10 + n)), [], list(range(-(-n // 4))), 0) for i, n in enumerate(lens)]
    plan = plan_batch([ScheduledSeq(s, 0, n) for s, n in zip(seqs, lens)], 4)
    assert plan.fields["prefill_block_ends"][0] == [1, 2, 4, 7]
