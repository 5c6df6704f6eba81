"""engine/streams and the stream-ordered memory pieces: the pinned input ring's slot accounting, the
offload planner, the step's stream plumbing (fake streams on the CPU, CUDA streams under
sync-debug mode on the GPU), layer-weight streaming with every weight format, the allocator switch."""
import dataclasses
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from engine.batch import build_prefill_only
from engine.formats import WeightFormat
from engine.memory import allocator
from engine.memory.host_ring import PinnedRing
from engine.streams import (
    FakeStreams,
    LayerStreamer,
    OffloadPlan,
    StepStreams,
    TokenReadback,
    layer_stream_bytes,
    plan_offload,
)
from engine.streams.offload import find_tensors
from models.llama import LlamaForCausalLM
from models.presets import SHAPE_PRESETS
from tests.numerics import rel_err


def first(log, entry, after=-1):
    """Index of the first occurrence of `entry` in `log` after position `after`."""
    return next(i for i in range(after + 1, len(log)) if log[i] == entry)


# ----------------------------------------------------------------------------- offload planner

def test_plan_keeps_everything_when_it_fits():
    plan = plan_offload([100] * 8, resident_bytes=50, gpu_memory_limit=850, kv_bytes=0)
    assert plan == OffloadPlan(list(range(8)), [], 0)


def test_plan_offloads_fewest_layers_spread_out():
    n, layer, resident, kv = 32, 1000, 3000, 5000
    limit = resident + kv + 20 * layer        # room for 18 resident layers + 2 buffers
    plan = plan_offload([layer] * n, resident, limit, kv)
    k = len(plan.offloaded_layers)
    assert k == 14 and plan.buffer_bytes == 2 * layer
    assert sorted(plan.resident_layers + plan.offloaded_layers) == list(range(n))
    assert resident + kv + layer * len(plan.resident_layers) + plan.buffer_bytes <= limit
    # one fewer streamed layer would not fit
    assert resident + kv + layer * (n - k + 1) + 2 * layer > limit
    gaps = [b - a for a, b in zip(plan.offloaded_layers, plan.offloaded_layers[1:])]
    assert max(gaps) - min(gaps) <= 1       # evenly spread: resident compute between the copies


def test_plan_uneven_layers_buffer_fits_largest_streamed():
    sizes = [10, 40, 10, 40, 10, 40]
    plan = plan_offload(sizes, 0, 130, 0)
    assert plan.buffer_bytes == 2 * max(sizes[i] for i in plan.offloaded_layers)
    assert sum(sizes[i] for i in plan.resident_layers) + plan.buffer_bytes <= 130


def test_plan_limit_below_double_buffer_names_the_numbers():
    with pytest.raises(ValueError) as e:
        plan_offload([700] * 4, resident_bytes=300, gpu_memory_limit=1500, kv_bytes=200)
    msg = str(e.value)
    for number in ("1500", "300", "200", "2 x 700", "1900"):
        assert number in msg


# ----------------------------------------------------------------------------- pinned ring

def test_ring_wraps_and_never_reuses_a_slot_before_its_upload_completed():
    s = FakeStreams(auto_complete=False)
    ring = PinnedRing(3, 256, s)
    seen = []
    for step in range(8):
        slot = ring.acquire()
        seen.append(slot.index)
        ids = torch.randint(0, 1000, (5 + step,))
        slot.put("input_ids", ids, torch.int64)
        slot.put("ctx", [step, step + 1], torch.int32)
        dev = ring.upload(slot)
        assert torch.equal(dev["input_ids"], ids) and dev["ctx"].tolist() == [step, step + 1]
        ring.release(slot)
    assert seen == [0, 1, 2, 0, 1, 2, 0, 1]
    # Each reuse of a slot found its upload event pending (never completed here), so the host waited
    # on that event before the slot was written again.
    log = s.log
    assert ring.host_waits == 5
    for i in range(3):
        copies = [j for j, e in enumerate(log) if e == ("copy", "h2d", f"inputs{i}")]
        for a, b in itertools.pairwise(copies):
            assert log[a:b].count(("host_wait", f"uploaded{i}")) == 1


def test_ring_does_not_block_when_uploads_have_finished():
    s = FakeStreams(auto_complete=True)
    ring = PinnedRing(2, 64, s)
    for _ in range(5):
        slot = ring.acquire()
        slot.put("x", [1, 2, 3], torch.int64)
        ring.upload(slot)
        ring.release(slot)
    assert ring.host_waits == 0 and not any(e[0] == "host_wait" for e in s.log)


def test_ring_slot_must_be_released_before_reuse():
    ring = PinnedRing(2, 64, FakeStreams())
    ring.acquire()
    ring.acquire()
    with pytest.raises(RuntimeError, match="released"):
        ring.acquire()


def test_ring_grows_when_a_step_needs_more_room():
    ring = PinnedRing(2, 64, FakeStreams())
    slot = ring.acquire()
    small = torch.randint(0, 100, (4,))
    tables = torch.randint(0, 100, (37, 11), dtype=torch.int32)   # far beyond 64 bytes
    big = torch.randint(0, 100, (300,))
    slot.put("small", small, torch.int64)
    slot.put("tables", tables.tolist(), torch.int32)
    slot.put("big", big, torch.int64)
    assert slot.host.numel() >= 4 * 8 + 37 * 11 * 4 + 300 * 8
    dev = ring.upload(slot)
    assert torch.equal(dev["small"], small) and torch.equal(dev["tables"], tables)
    assert torch.equal(dev["big"], big)
    assert dev["tables"].dtype == torch.int32 and dev["tables"].shape == (37, 11)


# ----------------------------------------------------------------------------- step plumbing

def test_step_plumbing_orders_upload_compute_readback():
    """Upload waits for its slot to be free, compute waits for the upload, D2H waits for compute,
    and the host reads step N's tokens only after step N+1 is queued and N's D2H event fired."""
    s = FakeStreams(auto_complete=False)
    ring, readback = PinnedRing(2, 128, s), TokenReadback(s, num_slots=2)
    weights = torch.randn(16, 32)
    pending, got, expect = None, [], []
    for step in range(6):
        s.log.append(("step", step))
        slot = ring.acquire()
        ids = torch.randint(0, 32, (3 + step % 2,))
        slot.put("input_ids", ids, torch.int64)
        dev = ring.upload(slot)
        with s.on(s.compute):
            s.kernel(f"forward{step}")
            tokens = torch.argmax(weights[:, dev["input_ids"]], dim=0)
        ring.release(slot)
        expect.append(tokens.tolist())
        ticket = readback.send(tokens)
        if pending is not None:
            got.append(pending.result().tolist())
        pending = ticket
    got.append(pending.result().tolist())
    assert got == expect
    log = s.log
    for step in range(6):
        i = step % 2
        start = first(log, ("step", step))
        up = first(log, ("copy", "h2d", f"inputs{i}"), first(log, ("wait", "h2d", f"consumed{i}"), start))
        rec_up = first(log, ("record", "h2d", f"uploaded{i}"), up)
        fwd = first(log, ("kernel", "compute", f"forward{step}"))
        assert first(log, ("wait", "compute", f"uploaded{i}"), rec_up) < fwd
        released = first(log, ("record", "compute", f"consumed{i}"), fwd)
        d2h = first(log, ("copy", "d2h", f"tokens{step}"))
        assert first(log, ("wait", "d2h", "sampled"), released) < d2h
        fired = first(log, ("record", "d2h", f"d2h{i}"), d2h)
        read = first(log, ("host_wait", f"d2h{i}"), fired)
        if step < 5:   # read while the next step is already queued
            assert fwd < first(log, ("kernel", "compute", f"forward{step + 1}")) < read


def test_readback_refuses_to_overwrite_an_unread_slot():
    s = FakeStreams()
    readback = TokenReadback(s, num_slots=2)
    readback.send(torch.arange(3))
    readback.send(torch.arange(3))
    with pytest.raises(RuntimeError, match="never read"):
        readback.send(torch.arange(3))


# ----------------------------------------------------------------------------- weight streaming

class _AliasedBackend(WeightFormat):
    """A weight format whose buffers are views into one packed buffer, and a strided view."""

    def __init__(self, n, k):
        super().__init__(n, k)
        self.register_buffer("packed", torch.randn(n * k + 40))
        self.register_buffer("values", self.packed[40:].view(n, k))
        self.register_buffer("head", self.packed[:40])
        self.register_buffer("rows", torch.rand(n) + 0.5)
        self.register_buffer("extra", torch.randn(n)[::2])       # a strided view

    def forward(self, x, x_scale=None):
        w = self.values * self.rows[:, None] + self.head.sum()
        return x @ w.t() + self.extra.repeat_interleave(2)[: self.out_features]


def test_find_tensors_takes_every_buffer_once():
    b = _AliasedBackend(8, 6)
    found = find_tensors(b)
    assert [id(t) for t in found] == [id(b.packed), id(b.values), id(b.head), id(b.rows), id(b.extra)]


def _tiny_model(formats):
    torch.manual_seed(0)
    cfg = dataclasses.replace(SHAPE_PRESETS["llama-tiny"], num_layers=len(formats))
    model = LlamaForCausalLM(cfg, device="cpu", dtype=torch.float32)
    for p in model.state_dict(keep_vars=True).values():   # parameters and the Linears' weight buffers
        p.data.normal_(0, 0.05)
    for layer, fmt in zip(model.layers, formats):
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj):
            if fmt == "aliased":
                lin.backend = _AliasedBackend(lin.out_features, lin.in_features)
            else:
                lin.convert(fmt)
    return model


def test_streamed_layers_match_resident_with_every_weight_format():
    formats = ["fp8", "nvfp4", "2:4", "2:4+fp8", "aliased", "bf16"]
    model = _tiny_model(formats)
    batch = build_prefill_only([torch.randint(0, 1000, (n,)).tolist() for n in (7, 3, 12)],
                               torch.device("cpu"))
    ref = model(batch.input_ids, batch.positions, batch)
    sizes = [layer_stream_bytes(layer) for layer in model.layers]
    streamed = [0, 1, 2, 4, 5]           # every format streams; layer 3 stays resident
    plan = OffloadPlan([3], streamed, 2 * max(sizes[i] for i in streamed))
    s = FakeStreams(auto_complete=False)
    streamer = LayerStreamer(model.layers, plan, s)
    host = streamer.host
    inside = {}

    def in_range(t, buf):
        start = buf.data_ptr()
        return t.numel() == 0 or start <= t.data_ptr() < start + buf.numel()

    for i in plan.offloaded_layers:   # while a streamed layer runs, all its tensors sit in a buffer
        def check(module, args, i=i):
            inside[i] = all(any(in_range(t, b) for b in streamer.buffers) for t in find_tensors(module))
        model.layers[i].register_forward_pre_hook(check)
    for _ in range(3):    # the prefetch order wraps around from one forward into the next
        out = model(batch.input_ids, batch.positions, batch)
        assert rel_err(out, ref) < 1e-6 and not out.isnan().any()
    assert all(inside[i] for i in plan.offloaded_layers)
    assert sum(h.numel() for h in host.values()) == sum(sizes[i] for i in streamed)
    # A buffer is refilled only after the layer that used it recorded `done`, and a layer computes
    # only after waiting for its buffer's `ready`, recorded after the copy into it.
    log = s.log
    for j, e in enumerate(log):
        if e[0] == "copy":
            b = int(e[2][-1])
            assert log[j - 1] == ("wait", "h2d", f"done{b}") and log[j + 1] == ("record", "h2d", f"ready{b}")
        if e == ("wait", "compute", "ready0") or e == ("wait", "compute", "ready1"):
            b = e[2][-1]
            last_copy = max(k for k in range(j) if log[k][0] == "copy" and log[k][2].endswith(f"buf{b}"))
            assert log[last_copy + 1] == ("record", "h2d", f"ready{b}")
    copies = sum(1 for e in log if e[0] == "copy")
    assert copies == 2 + 3 * len(plan.offloaded_layers)


def test_no_norm_is_handed_into_a_streamed_layer(request):
    """The RMSNorm hand-off across layers reads the next layer's norm weight while the layer before
    runs; a streamed layer's weights exist on the device only while it runs itself, so its input
    norm runs in it (models/llama.py). The other norms still hand off, and the output is the
    resident model's."""
    model = _tiny_model(["bf16"] * 6)
    batch = build_prefill_only([torch.randint(0, 1000, (n,)).tolist() for n in (5, 9)], torch.device("cpu"))
    ref = model(batch.input_ids, batch.positions, batch)      # every norm a kernel
    handed = request.getfixturevalue("norm_handoff_on_cpu")
    resident = model(batch.input_ids, batch.positions, batch)
    assert len(handed) == 2 * 6 - 1 and rel_err(resident, ref) < 1e-5
    sizes = [layer_stream_bytes(layer) for layer in model.layers]
    streamed = [1, 2, 4]
    plan = OffloadPlan([0, 3, 5], streamed, 2 * max(sizes[i] for i in streamed))
    LayerStreamer(model.layers, plan, FakeStreams())
    handed.clear()
    out = model(batch.input_ids, batch.positions, batch)
    inputs = {id(model.layers[i].input_layernorm): i for i in range(6)}
    into = sorted(inputs[id(n)] for n in handed if id(n) in inputs)
    assert into == [3, 5]               # the input norms of the resident layers after layer 0
    assert len(handed) - len(into) == 6   # every post-attention norm
    assert rel_err(out, ref) < 1e-5


def test_streamer_without_prefetch_serialises_copy_and_compute():
    model = _tiny_model(["bf16", "fp8", "bf16", "bf16", "nvfp4"])
    batch = build_prefill_only([torch.randint(0, 1000, (n,)).tolist() for n in (5, 9)],
                               torch.device("cpu"))
    ref = model(batch.input_ids, batch.positions, batch)
    sizes = [layer_stream_bytes(layer) for layer in model.layers]
    streamed = [0, 1, 3, 4]
    plan = OffloadPlan([2], streamed, 2 * max(sizes[i] for i in streamed))
    s = FakeStreams(auto_complete=False)
    for i, layer in enumerate(model.layers):    # hooks registered first run first: the "kernel"
        layer.register_forward_hook(lambda m, a, o, i=i: s.kernel(f"layer{i}"))
    streamer = LayerStreamer(model.layers, plan, s, prefetch=False)
    assert streamer.copied_bytes == 0 and not any(e[0] == "copy" for e in s.log)   # nothing ahead
    for _ in range(2):
        out = model(batch.input_ids, batch.positions, batch)
        assert rel_err(out, ref) < 1e-6
    log = s.log
    copies = [j for j, e in enumerate(log) if e[0] == "copy"]
    assert len(copies) == 2 * len(streamed)
    assert streamer.copied_bytes == 2 * sum(sizes[i] for i in streamed)
    for j in copies:
        layer, b = log[j][2].split("->")
        b = b[-1]
        # the copy waits for the compute queued so far, and the layer waits for the copy
        assert log[j - 3:j] == [("record", "compute", "issued"), ("wait", "h2d", "issued"),
                                ("wait", "h2d", f"done{b}")]
        assert log[j + 1:j + 3] == [("record", "h2d", f"ready{b}"), ("wait", "compute", f"ready{b}")]
        # no other copy is queued before this layer's own kernel
        kernel = first(log, ("kernel", "compute", layer), j)
        assert not any(log[k][0] == "copy" for k in range(j + 1, kernel))
    # back to prefetching between forwards: same output, and copies run ahead of the compute again
    streamer.prefetch = True
    start = len(log)
    for _ in range(2):
        assert rel_err(model(batch.input_ids, batch.positions, batch), ref) < 1e-6
    def next_kernel(j):
        return next((e[2] for e in log[j:] if e[0] == "kernel"), None)

    # without prefetch the next kernel after a copy is always the copied layer's; with it, not
    assert all(next_kernel(j) == log[j][2].split("->")[0] for j in copies)
    assert any(log[j][0] == "copy" and next_kernel(j) not in (None, log[j][2].split("->")[0])
               for j in range(start, len(log)))


def test_streamer_refuses_layers_on_another_device():
    layer = torch.nn.Linear(4, 4)
    plan = OffloadPlan([], [0], 2 * layer_stream_bytes(layer))
    with pytest.raises(ValueError, match="move it to the device first"):
        LayerStreamer([layer], plan, FakeStreams(), device="meta")


# ----------------------------------------------------------------------------- allocator

def test_configure_allocator_sets_the_environment(monkeypatch):
    monkeypatch.setenv(allocator.ENV, "expandable_segments:False,backend:native")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")
    monkeypatch.setattr(allocator, "_release", "dedicated")
    allocator.configure_allocator("cudaMallocAsync", "shared")
    assert os.environ[allocator.ENV] == "backend:cudaMallocAsync,expandable_segments:False"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert allocator._release == "shared"
    with pytest.raises(ValueError, match="needs the cudaMallocAsync"):
        allocator.configure_allocator("native", "shared")
    with pytest.raises(ValueError, match="not one of"):
        allocator.configure_allocator("cudaMalloc", "dedicated")


def test_configure_allocator_after_torch_loaded_another_backend_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setenv(allocator.ENV, "")
    monkeypatch.delenv(allocator.REEXEC_MARK, raising=False)
    with pytest.raises(RuntimeError, match="too late"):
        allocator.configure_allocator("cudaMallocAsync", "dedicated")
    allocator.configure_allocator("native", "dedicated")      # what is in use already: fine

    class Restarted(Exception):
        pass

    def execv(path, argv):
        raise Restarted(path, argv)

    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(Restarted) as e:
        allocator.configure_allocator("cudaMallocAsync", "dedicated", reexec=True)
    assert e.value.args == (sys.executable, sys.orig_argv)
    assert os.environ[allocator.ENV] == "backend:cudaMallocAsync"
    # in the restarted process torch still loaded "native" (it ignored the variable): no second restart
    with pytest.raises(RuntimeError, match="too late"):
        allocator.configure_allocator("cudaMallocAsync", "dedicated", reexec=True)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_step_loop_has_no_hidden_synchronisation():
    dev = torch.device("cuda")
    s = StepStreams(dev)
    ring, readback = PinnedRing(3, 1 << 12, s), TokenReadback(s, num_slots=2)
    vocab, hidden = 4096, 512
    emb = torch.randn(vocab, hidden, device=dev)
    w = torch.randn(vocab, hidden, device=dev) / hidden ** 0.5
    torch.cuda.synchronize()
    inputs = [torch.randint(0, vocab, (1 + (7 * step) % 64,)) for step in range(40)]
    got, pending = [], None

    def step(ids):
        slot = ring.acquire()
        slot.put("input_ids", ids, torch.int64)
        slot.put("positions", torch.arange(len(ids)), torch.int64)
        d = ring.upload(slot)
        with s.on(s.compute):
            h = torch.nn.functional.embedding(d["input_ids"], emb) + d["positions"][:, None].float()
            tokens = torch.argmax(h @ w.t(), dim=-1)
        ring.release(slot)
        return readback.send(tokens)

    for n, ids in enumerate(inputs):
        if n == 5:   # after warm-up (pinned buffers, device twins, kernels): the steady state
            torch.cuda.set_sync_debug_mode("error")
        try:
            ticket = step(ids)
            if pending is not None:
                got.append(pending.result().clone())
        finally:
            torch.cuda.set_sync_debug_mode(0)
        pending = ticket
    got.append(pending.result().clone())
    torch.cuda.synchronize()
    for ids, tok in zip(inputs, got):
        ref = torch.argmax((emb[ids.to(dev)] + torch.arange(len(ids), device=dev)[:, None].float()) @ w.t(), -1)
        assert torch.equal(tok, ref.cpu())
    assert ring.host_waits <= 3


@pytest.mark.gpu
def test_gpu_streamed_layers_match_resident():
    dev = torch.device("cuda")
    torch.manual_seed(1)
    cfg = SHAPE_PRESETS["llama-tiny"]
    model = LlamaForCausalLM(cfg, device=dev, dtype=torch.bfloat16)
    for p in model.state_dict(keep_vars=True).values():
        p.data.normal_(0, 0.05)
    model.layers[1].mlp.gate_up_proj.convert("fp8")
    model.layers[2].mlp.down_proj.convert("nvfp4")
    model.layers[3].mlp.gate_up_proj.convert("2:4")  # at 12 tokens its decode kernels and the MMA-order
    model.layers[3].mlp.down_proj.convert("2:4")     # metadata they read (buffers of the backend) stream too
    batch = build_prefill_only([torch.randint(0, 1000, (n,)).tolist() for n in (9, 33, 4)], dev)
    small = build_prefill_only([torch.randint(0, 1000, (n,)).tolist() for n in (5, 3, 4)], dev)
    streamed = [1, 2, 3]
    # No norm hands off into a streamed layer (test_no_norm_is_handed_into_a_streamed_layer): the
    # resident reference is told which layers will stream, so that it runs the same kernels.
    for i in streamed:
        model.layers[i].streamed = True
    ref = model(batch.input_ids, batch.positions, batch).float()
    ref_small = model(small.input_ids, small.positions, small).float()
    sparse = model.layers[3].mlp.gate_up_proj.backend
    assert sparse.meta_mma_4 is not None and all(any(t is m for t in find_tensors(model.layers[3]))
                                                 for m in (sparse.meta_mma_4, sparse.meta_mma_8))
    sizes = [layer_stream_bytes(layer) for layer in model.layers]
    plan = OffloadPlan([0], streamed, 2 * max(sizes[1:]))
    s = StepStreams(dev)
    # the device storages of the streamed layers' tensors, by address (empty placeholders own none)
    old = {t.untyped_storage().data_ptr(): (f"layer {i}: {tuple(t.shape)} {t.dtype}", t.untyped_storage().nbytes())
           for i in streamed for t in find_tensors(model.layers[i]) if t.untyped_storage().nbytes()}
    torch.cuda.synchronize()
    # The allocator's own record of what the construction freed (not memory_allocated before and
    # after, which other tests' lazily built caches move in a long pytest process).
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        streamer = LayerStreamer(model.layers, plan, s)
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    # the streamed layers' device copies are freed; two buffers of the largest layer take their place.
    # (After other GPU tests in the same process, the NVFP4 layer's 4-byte tensor scale has been
    # seen to stay referenced, by what is not known: a few scalars are let through, named.)
    freed = {e["addr"] for e in trace if e["action"] == "free_requested"}
    kept = [(what, n) for ptr, (what, n) in old.items() if ptr not in freed]
    assert sum(n for _, n in kept) < 64 * 1024, kept
    assert [b.numel() for b in streamer.buffers] == [max(sizes[1:])] * 2
    assert all(h.is_pinned() for h in streamer.host.values())
    for _ in range(3):
        with s.on(s.compute):
            out = torch.full_like(ref, float("nan"))
            out.copy_(model(batch.input_ids, batch.positions, batch))
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert rel_err(out, ref) < 1e-3      # same kernels on the same bytes: exact unless a kernel is not deterministic
    order = plan.offloaded_layers
    assert streamer.copied_bytes == sizes[order[0]] + sizes[order[1]] + 3 * sum(sizes[i] for i in order)
    with s.on(s.compute):
        out = model(small.input_ids, small.positions, small).float()
    torch.cuda.synchronize()
    assert rel_err(out, ref_small) < 1e-3
    streamer.prefetch = False           # copy and compute serialised: the same result
    for _ in range(2):
        with s.on(s.compute):
            out = model(batch.input_ids, batch.positions, batch).float()
        torch.cuda.synchronize()
        assert rel_err(out, ref) < 1e-3


@pytest.mark.gpu
def test_gpu_allocator_backend_is_cudamallocasync_when_requested():
    # torch reads PYTORCH_ALLOC_CONF when it loads: the process starts with it set (as serve.py's
    # re-exec or the user's environment does); configure_allocator then only checks and records.
    env = dict(os.environ, PYTORCH_ALLOC_CONF="backend:cudaMallocAsync")
    code = ("from engine.memory import allocator as a; a.configure_allocator('cudaMallocAsync', 'shared');"
            "import torch; x = torch.empty(1 << 20, device='cuda'); a.apply_release('cuda');"
            "print(a.allocator_backend(), a.release_threshold('cuda'));"
            "a.set_release_threshold('cuda', True); print(a.release_threshold('cuda'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cudaMallocAsync", "0", str(2 ** 64 - 1)]


# Greedy tokens of 8 prompts whose outputs end at different lengths, so decode replays the graphs of
# batch 8, 4, 2 and 1 (the first prompt alone before them); fp32, so that only a near-tie can part
# two runs (tests/ties.py).
_GRAPH_TOKENS = """
import json, torch
from engine import LLM, SamplingParams
torch.backends.cuda.matmul.allow_tf32 = False
llm = LLM("llama-3.2-1b", device="cuda", dtype="fp32", kv_cache_tokens=16384, max_num_seqs=8, seed=0)
graphs, replays = llm.engine.graphs, []
run = graphs.run
graphs.run = lambda batch: replays.append(batch.num_decodes) or run(batch)
prompts = [list(range(7 + i, 7 + i + n)) for i, n in enumerate([1, 9, 33, 64, 100, 130, 257, 300])]
params = [SamplingParams(max_tokens=4 + 6 * i, temperature=0, ignore_eos=True, logprobs=2) for i in range(8)]
# One prompt alone first: the batch-1 graph replays before any step of batch 8, whose capture came
# first and may own memory the others use (cuBLAS's workspace: engine/kernels/platform.capture).
outs = llm.generate(prompts[:1], params[:1]) + llm.generate(prompts, params)
llm.shutdown(timeout=1)
print(json.dumps({"backend": torch.cuda.get_allocator_backend(), "replayed": sorted(set(replays)),
                  "tokens": [o.token_ids for o in outs], "top": [[lp.top for lp in o.logprobs] for o in outs]}))
"""


def _graph_tokens(backend: str) -> dict:
    env = dict(os.environ, PYTORCH_ALLOC_CONF=f"backend:{backend}")
    out = subprocess.run([sys.executable, "-c", _GRAPH_TOKENS], capture_output=True, text=True, env=env,
                         check=False, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_gpu_cudamallocasync_with_graphs_gives_the_native_tokens():
    """The stream-ordered allocator with CUDA-graph decode (engine/kernels/platform.capture): every
    graph captures and replays, and the tokens are the native allocator's."""
    from ties import parting
    got, want = _graph_tokens("cudaMallocAsync"), _graph_tokens("native")
    assert (got["backend"], want["backend"]) == ("cudaMallocAsync", "native")
    assert got["replayed"] == want["replayed"] and {1, 2, 4, 8} <= set(got["replayed"])
    assert len(got["tokens"]) == len(want["tokens"]) == 9
    for tokens, reference, top in zip(got["tokens"], want["tokens"], want["top"]):
        parting(tokens, reference, top)
