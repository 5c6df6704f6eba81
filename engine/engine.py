"""The step loop: schedule -> pack inputs -> upload -> forward -> sample -> read back -> emit.

`Engine` is single-threaded; engine/llm.py runs it on a background thread and feeds it requests.
Each step's outputs go to the request's sink (a callable taking a StreamChunk).

Steps are pipelined over three streams (engine/streams): the inputs of step N+1 are packed into a
pinned slot and uploaded on the copy stream while step N computes; step N's sampled tokens come back
through pinned memory on the D2H stream and are read only once step N+1 is queued. Step N+1's
decode rows take the tokens step N sampled straight from the device (the host holds a placeholder
until it reads them), so the host never waits for the GPU in the steady state. The cost is a lag of
one step in seeing a finish: a sequence that sampled its EOS in step N has computed one more token
in step N+1, which is dropped. `overlap=False` reads each step's tokens at once instead.

With tensor parallelism (config.tensor_parallel_size > 1, engine/parallel.py) every rank builds
this Engine on its shards, in the same order (so their collectives pair up: the KV cache size,
calibration, graph capture). Rank 0 then schedules and samples; before each forward it sends the
step's packed inputs to the other ranks, which run `replay_step` (the same upload and forward, and
the sampled tokens of the step before broadcast from rank 0's device) and never sample.
"""
from __future__ import annotations

import bisect
import gc
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from engine.batch import PLACEHOLDER, BatchPlan, build_prefill_only, plan_batch
from engine.config import EngineConfig, resolve_device, resolve_dtype, resolve_formats
from engine.kernels.attention import compile_step_kernels
from engine.kernels.platform import triton_runs
from engine.kernels.select import m_bucket
from engine.kernels.tuner import Tuner
from engine.linear import convert_model, input_channel_norms, tune_model
from engine.memory.host_ring import PinnedRing
from engine.parallel import (ParallelError, check_size, from_environment, init_group, leave_group, rank_device,
                             start_workers)
from engine.memory.kv_cache import KVCache
from engine.quality import calibration_windows
from engine.sampling import Sampler, SamplingParams, TokenLogprob
from engine.scheduler import ScheduledSeq, Scheduler, Sequence, Status
from engine.streams import FakeStreams, StepStreams, TokenReadback
from engine.streams.streams import Ticket
import models.loader

log = logging.getLogger("microengine")

CPU_KV_TOKENS = 16384          # the CPU has no "free device memory" to size from
OFFLOAD_KV_TOKENS = 16384      # KV cache size planned into gpu_memory_limit when none is given
WORKERS_EXIT_S = 30.0          # how long rank 0's close() waits for the other ranks to exit (then kills them)


@dataclass
class StreamChunk:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0          # of prompt_tokens, those whose KV came from the prefix cache


# Histogram bucket bounds (seconds) of the latencies, as Prometheus exports them (serve.py /metrics).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class LatencySummary:
    """Count and sum of all samples, a cumulative histogram over `buckets`, and percentiles over the
    most recent samples."""

    def __init__(self, buckets: tuple[float, ...], window: int = 10000):
        self.count, self.total = 0, 0.0
        self.bounds = buckets
        self.counts = [0] * len(buckets)    # per bucket, not cumulative
        self.recent: deque[float] = deque(maxlen=window)

    def add(self, x: float) -> None:
        self.count += 1
        self.total += x
        self.recent.append(x)
        i = bisect.bisect_left(self.bounds, x)
        if i < len(self.counts):
            self.counts[i] += 1

    def summary(self) -> dict:
        ys = sorted(self.recent)
        pct = lambda q: ys[min(len(ys) - 1, int(len(ys) * q))] if ys else 0.0  # noqa: E731
        cumulative = list(itertools.accumulate(self.counts))
        return {"count": self.count, "sum": self.total, "p50": pct(0.5), "p99": pct(0.99),
                "buckets": list(zip(self.bounds, cumulative))}     # (upper bound, samples <= it)


class _Detokenizer:
    """Incremental detokenization that never splits a multi-byte character, and holds back the
    text that could still turn out to be the start of a stop string."""

    def __init__(self, tokenizer, stops):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.stops = stops
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the stop string if the text now contains one (text cut before it)."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            start = max(0, len(self.text) - self.holdback)
            self.text += delta
            for s in self.stops:
                at = self.text.find(s, start)
                if at != -1:
                    self.text = self.text[:at]
                    return s
        return None

    def take(self, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        out, self.emitted = self.text[self.emitted:end], end
        return out


@dataclass(eq=False)
class Request:
    seq: Sequence
    sink: object
    detok: _Detokenizer | None
    generator: torch.Generator | None
    arrival_time: float
    matcher: object | None = None        # the grammar's state, for a constrained request
    scheduled_time: float | None = None  # when it first joined a step
    last_token_time: float | None = None

    @property
    def serial(self) -> bool:
        """Whether its next step needs all its earlier tokens on the host (penalties, a grammar)."""
        return bool(self.seq.params.presence_penalty or self.seq.params.frequency_penalty
                    or self.matcher is not None)


@dataclass(eq=False)
class InFlight:
    """A step whose sampled tokens are still on their way back."""
    ticket: Ticket
    rows: list[tuple[Request, int]]     # per sampled row: its request, and the index in output_ids
    tokens: torch.Tensor                # the sampled tokens on the device (the next step reads them)

    @property
    def row_of(self) -> dict[Sequence, int]:
        """Sequence -> its row in `tokens`."""
        return {req.seq: i for i, (req, _) in enumerate(self.rows)}


class Engine:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, tp_init: str | None = None):
        """tp_rank, tp_init: set in a worker that rank 0 spawned (engine/parallel.py)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # Under a memory limit the model may not fit the device: it is loaded into host memory and
        # the decoder layers go to the device one at a time (_place_layers).
        layerwise = config.gpu_memory_limit is not None or config.offload
        if layerwise and config.sparse_ffn == "wanda":
            raise ValueError("sparse_ffn='wanda' calibrates on the whole resident model: it does not combine "
                             "with offload / gpu_memory_limit (use sparse_ffn='magnitude')")
        self.tp, self.workers, self._driving = None, None, False
        # Under torchrun (even one process: the distributed path at world size 1) ranks join its group.
        env = from_environment() if tp_init is None else None
        if config.tensor_parallel_size > 1 or env is not None:
            if layerwise:
                raise ValueError("tensor_parallel_size: shards the model over GPUs; it does not combine with "
                                 "offload / gpu_memory_limit")
            self._join_group(config.tensor_parallel_size, tp_rank, tp_init, env)
            try:
                self._build(config, layerwise)
            except BaseException:
                self._abandon_group()
                raise
        else:
            self._build(config, layerwise)
        self._driving = self.tp is not None and self.tp.rank == 0    # from now on rank 0 leads

    def _build(self, config: EngineConfig, layerwise: bool) -> None:
        # Non-blocking CUDA streams on the GPU; on the CPU the same plumbing runs on no-op streams.
        self.streams = StepStreams(self.device) if self.device.type == "cuda" else FakeStreams(keep_log=False)
        loaded = models.loader.load_model(config.model, torch.device("cpu") if layerwise else self.device,
                                          self.dtype, seed=config.seed, tokenizer=config.tokenizer,
                                          draw_device=self.device, tp=self.tp)
        self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        # A compressed-tensors checkpoint's layers are already in their formats (loaded as stored).
        self.config = config = resolve_formats(config, loaded.checkpoint)
        self.stored_formats = loaded.checkpoint is not None
        self.model.set_fused_kernels(config.fused_kernels is not False)
        self.model_config = cfg = self.model.config
        self.streamer = None
        if layerwise:
            self.streamer = self._place_layers()
        elif not self.stored_formats and (config.weights != "bf16" or config.sparse_ffn):
            norms = None
            if config.sparse_ffn == "wanda":
                windows = calibration_windows(self.tokenizer)
                norms = input_channel_norms(self.model, lambda: self.hidden_states(windows, check=False))
            convert_model(self.model, config.weights, config.sparse_ffn, norms)
        if not layerwise:   # (_place_layers converts it on the device)
            self.model.set_lm_head(config.lm_head)
        self.eos_ids = set(cfg.eos_token_ids)
        self.max_model_len = min(config.max_model_len or min(cfg.max_position_embeddings, 8192),
                                 cfg.max_position_embeddings)
        self._tune()    # first: the KV cache is sized from what tuning leaves free
        num_blocks = self._num_kv_blocks()
        if self.tp is not None:     # rank 0 schedules for all: every rank must hold its blocks
            num_blocks = self.tp.agree_min(num_blocks)
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, config.block_size, self.model.num_local_kv_heads,
                                cfg.head_dim, self.dtype, self.device, fp8=config.kv_cache_fp8)
        self.scheduler = Scheduler(self.kv_cache.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.enable_prefix_caching)
        self.sampler = Sampler(self.device, config.seed)
        self.graphs = self.step_graphs = None
        if self.device.type == "cuda":   # compiled now, not in the middle of a serving step
            compile_step_kernels(*self.kv_cache.layer(0), self.model.layers[0].self_attn.num_heads, self.dtype,
                                 self.kv_cache.scratch_block)
        # Streamed layers swap their weights in forward hooks, which a captured graph would skip.
        if self.device.type == "cuda" and config.cuda_graphs and self.streamer is None:
            self._capture_graphs()
            if self.tp is not None:     # every rank replays graphs, or none does
                if not self.tp.agree_min(self.graphs is not None):
                    self.graphs = None
                if not self.tp.agree_min(self.step_graphs is not None):
                    self.step_graphs = None
        self.ring = PinnedRing(3, 1 << 16, self.streams)
        self.readback = TokenReadback(self.streams, num_slots=2)
        self.in_flight: InFlight | None = None
        self.num_serial = 0         # requests whose steps must not overlap (Request.serial)
        self.requests: dict[str, Request] = {}
        self.stats = {"steps": 0, "step_tokens": 0, "finished": 0, "aborted": 0, "failed": 0, "host_s": 0.0}
        self.ttft, self.itl = LatencySummary(TTFT_BUCKETS), LatencySummary(ITL_BUCKETS)
        self.queue_time = LatencySummary(QUEUE_BUCKETS)
        self._grammars = None       # engine.structured_output.Grammars, made on first use
        self._grammars_lock = threading.Lock()      # validate() runs on the callers' threads
        if self.device.type == "cuda":
            # Loading, conversion and graph capture ran on the default stream; the step streams
            # do not sync with it, so everything it queued must be done first (once).
            torch.cuda.synchronize(self.device)

    def _join_group(self, size: int, rank: int, init_method: str | None, env) -> None:
        """Become rank `rank` of the tensor-parallel group: spawn the other ranks (rank 0, unless
        torchrun started every rank: `env`, its (rank, world, local rank)), then join the process
        group on this rank's device."""
        local = rank
        if env is not None:     # torchrun: every rank runs the caller's code
            rank, world, local = env
            if world != size:
                raise ValueError(f"tensor_parallel_size: {size}, but torchrun started {world} processes")
        elif init_method is None:       # rank 0 starts the others on this machine's GPUs
            check_size(size, self.device)
            self.workers, init_method = start_workers(self.config, size)
        self.device = rank_device(self.device, local)
        try:
            def join():
                return init_group(rank, size, self.device, init_method)
            # A spawned worker that dies before it joins is an error at once, not at the timeout.
            self.tp = self.workers.while_alive(join) if self.workers is not None else join()
        except BaseException:
            if self.workers is not None:
                self.workers.join(0)
            raise
        log.info("tensor parallel rank %d of %d on %s", rank, size, self.device)

    def _abandon_group(self) -> None:
        """Building failed on this rank: the spawned ranks are killed, not waited for."""
        if self.workers is not None:
            self.workers.join(timeout=0)
        tp, self.tp = self.tp, None
        leave_group(tp)

    def close(self) -> None:
        """Leave the process group; rank 0 first stops the other ranks, and returns once they have
        exited (no process is left behind).

        NCCL destroys a communicator collectively: a rank's teardown returns only when every rank
        tears down. So the ranks leave together: rank 0 sends stop and leaves at once, while the
        others do the same, and joins them afterwards (a rank that has not exited by WORKERS_EXIT_S
        is killed, which also ends the teardown). Each rank first drops its CUDA graphs, whose
        captured all-reduces belong to the communicator, and lets the device drain."""
        if self.tp is None:
            return
        tp, self.tp, self._driving = self.tp, None, False
        intact = True
        try:
            if tp.rank == 0:
                tp.send(("stop",))
        except ParallelError:
            intact = False  # a rank is already gone; the others see the broken group and exit
        self.graphs = self.step_graphs = None
        gc.collect()
        if intact and self.device.type == "cuda":   # (a collective with a dead rank would never end)
            torch.cuda.synchronize(self.device)
        if self.workers is None:
            leave_group(tp)
            return
        leaving = threading.Thread(target=leave_group, args=(tp,), name="microengine-leave-group", daemon=True)
        leaving.start()
        self.workers.join(timeout=WORKERS_EXIT_S)
        leaving.join(WORKERS_EXIT_S)
        if leaving.is_alive():
            log.warning("rank 0 could not leave the process group within %.0f s of its ranks' exit",
                        WORKERS_EXIT_S)

    def idle(self) -> None:
        """Called by the engine thread when it has nothing to run: keeps idle ranks in touch."""
        if self._driving:
            self.tp.keepalive()

    def kv_bytes_per_token(self) -> int:
        """Bytes a token's K and V take in this engine's cache (this rank's KV heads), scales included."""
        cfg = self.model_config
        return KVCache.bytes_per_token(cfg.num_layers, self.model.num_local_kv_heads, cfg.head_dim, self.dtype,
                                       fp8=self.config.kv_cache_fp8)

    def _activation_reserve(self) -> int:
        """Room for the largest step's activations (the gate/up output dominates, kept twice over for
        SwiGLU), the step graphs' static buffers (q/k/v, attention output, residual, hidden) and
        the step's fp32 logits."""
        c, cfg = self.config, self.model_config
        elt = torch.empty(0, dtype=self.dtype).element_size()
        static = cfg.num_heads * cfg.head_dim * 2 + cfg.num_kv_heads * cfg.head_dim * 2 + 2 * cfg.hidden_size
        act = c.max_num_batched_tokens * (4 * cfg.intermediate_size + 6 * cfg.hidden_size + static) * elt
        return act + 2 * c.max_num_seqs * cfg.vocab_size * 4

    def _num_kv_blocks(self) -> int:
        c = self.config
        if c.kv_cache_tokens is not None:
            tokens = c.kv_cache_tokens
        elif c.gpu_memory_limit is not None:
            tokens = OFFLOAD_KV_TOKENS      # what the memory limit was planned around
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            tokens = int((free * c.kv_cache_memory_fraction - self._activation_reserve())
                         // self.kv_bytes_per_token())
        else:
            tokens = CPU_KV_TOKENS
        blocks = tokens // c.block_size
        if blocks < 1:
            raise ValueError("KV cache: no room for even one block; lower the model size or "
                             "raise kv_cache_memory_fraction / kv_cache_tokens")
        return blocks

    def _non_layer_bytes(self) -> int:
        """The weights outside the decoder layers: embeddings, final norm, LM head."""
        m = self.model
        head = 0 if m.lm_head is None else m.lm_head.backend.weight_bytes()
        return head + sum(t.nbytes for t in (m.embed_tokens.weight, m.norm.weight))

    def _place_layers(self):
        """Move a model loaded into host memory to the device under gpu_memory_limit: the weights
        outside the decoder layers first, then each layer in turn (moved, converted to its weight
        format); the layers the plan streams go on to pinned host memory before the next one comes,
        so the device never holds more than the resident layers plus one (engine/streams/offload.py).
        On the CPU the streamer runs on no-op streams, which exercises the same plumbing."""
        from engine.streams import LayerStreamer, layer_stream_bytes, plan_offload
        c, model = self.config, self.model
        for name, module in model.named_children():
            if name != "layers":
                module.to(self.device)
        model.inv_freq = model.inv_freq.to(self.device)
        model.set_lm_head(c.lm_head)

        def place(i):
            model.layers[i].to(self.device)
            if not self.stored_formats:
                convert_model(model, c.weights, c.sparse_ffn, layers=[i])

        place(0)    # Llama's layers are alike: the first one, converted, sizes the plan
        n = len(model.layers)
        kv = (c.kv_cache_tokens or OFFLOAD_KV_TOKENS) * self.kv_bytes_per_token() + self._activation_reserve()
        if c.gpu_memory_limit is not None:
            limit = int(c.gpu_memory_limit * 2**30)
        elif self.device.type == "cuda":
            limit = torch.cuda.mem_get_info(self.device)[1]     # offload: the whole device
        else:
            limit = None    # offload without a limit: the CPU has no device memory to fit
        plan = None
        if limit is not None:
            plan = plan_offload([layer_stream_bytes(model.layers[0])] * n, self._non_layer_bytes(), limit, kv)
            log.info("device memory limit %.2f GiB: %d of %d decoder layers streamed from pinned host memory",
                     limit / 2**30, len(plan.offloaded_layers), n)
        streamer = None
        if plan is not None and plan.offloads:
            streamer = LayerStreamer(model.layers, plan, self.streams, device=self.device, adopt=False)
        for i in range(n):
            if i:
                place(i)
            if streamer is not None and i in plan.offloaded_layers:
                streamer.adopt(i)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()    # the layer's device copy is gone: give its memory back
        return streamer

    def _tune(self) -> None:
        """Tune the GEMM kernels for every M bucket the engine will run (decode batches up to
        max_num_seqs, prefill steps up to max_num_batched_tokens), before serving: on disk after the
        first start (engine/kernels/tuner.py). It runs before the KV cache is sized from the free
        memory, its scratch given back first, so that the timing's buffers never compete with the
        cache. Streamed layers are not tuned (their weights move)."""
        if self.device.type != "cuda" or self.streamer is not None:
            return
        c = self.config
        top = m_bucket(max(c.max_num_seqs, c.max_num_batched_tokens))
        tuner = Tuner(enabled=c.tune == "on")
        t0 = time.perf_counter()
        tune_model(self.model, tuner, [1 << i for i in range(top.bit_length())])
        torch.cuda.empty_cache()
        if tuner.timed:
            tuner.save()
            log.info("tuned %d kernel candidates in %.1f s (cache: %s)", tuner.timed,
                     time.perf_counter() - t0, tuner.path)

    def _capture_graphs(self) -> None:
        """Decode steps whole, the other steps in pieces around their attention (engine/cuda_graphs.py),
        in one memory pool; the step graphs first, the largest being the pool's peak."""
        from engine.cuda_graphs import DecodeGraphs, StepGraphs
        if not triton_runs(self.model.embed_tokens.weight):
            return      # the reference attention syncs with the host: nothing to capture
        c, scratch = self.config, self.kv_cache.scratch_block
        t0 = time.perf_counter()
        steps = StepGraphs(self.model, self.kv_cache, c.max_num_batched_tokens, scratch)
        try:
            steps.capture()
            self.step_graphs = steps
        except RuntimeError as e:   # a backend that cannot be captured: such steps run eagerly
            log.warning("CUDA graph capture failed, prefill steps run eagerly: %s", e)
            torch.cuda.synchronize()
        max_blocks = -(-self.max_model_len // c.block_size)
        graphs = DecodeGraphs(self.model, self.kv_cache, min(c.max_num_seqs, 512), max_blocks, scratch,
                              pool=steps.pool)
        try:
            graphs.capture()
            self.graphs = graphs
        except RuntimeError as e:   # a backend that cannot be captured: run decode eagerly
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s", e)
            torch.cuda.synchronize()
        # Counted from what is kept: a capture that failed part-way leaves graphs nothing replays.
        log.info("captured CUDA graphs in %.1f s: %d step sizes up to %d tokens, %d decode batch sizes",
                 time.perf_counter() - t0, len(self.step_graphs.pieces) if self.step_graphs else 0,
                 c.max_num_batched_tokens, len(self.graphs.graphs) if self.graphs else 0)

    # ---------------------------------------------------------------- requests

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Refuse what can never run (it depends only on static limits, so any thread may call it);
        returns the effective max_tokens."""
        max_tokens = self.scheduler.check(len(prompt_ids), params.max_tokens)
        bad = [t for t in prompt_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary "
                             f"(0..{self.model_config.vocab_size - 1})")
        if params.constrained:
            self.grammars().compile(params)     # a schema it cannot compile is refused here
        return max_tokens

    def grammars(self):
        with self._grammars_lock:
            if self._grammars is None:
                from engine.structured_output import Grammars
                self._grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_ids)
            return self._grammars

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink) -> None:
        max_tokens = self.validate(prompt_ids, params)
        if request_id in self.requests:
            sink(StreamChunk(request_id, [], "", "abort", len(prompt_ids), 0))
            raise ValueError(f"request_id: {request_id!r} is already running")
        seq = Sequence(request_id, list(prompt_ids), params, max_tokens)
        detok = _Detokenizer(self.tokenizer, params.stop_list) if params.detokenize else None
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        matcher = self.grammars().matcher(params) if params.constrained else None
        req = self.requests[request_id] = Request(seq, sink, detok, gen, time.perf_counter(), matcher)
        self.num_serial += req.serial
        self.scheduler.add(seq)

    def _drop(self, req: Request, reason: str) -> None:
        """The request leaves: its blocks go back to the pool at once."""
        self.scheduler.finish(req.seq, reason)
        del self.requests[req.seq.request_id]
        self.num_serial -= req.serial

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        # A step still in flight may write this sequence's KV into the freed blocks; the next owner
        # of those blocks writes them in a later step, on the same stream, so after it.
        self._drop(req, "abort")
        self.stats["aborted"] += 1
        req.sink(self._chunk(req, [], "", "abort", None, len(req.seq.output_ids) - req.seq.num_pending))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def fail_running(self) -> list[str]:
        """After a step raised: drop the requests that were running or in flight (their KV cache may
        be half-written), without telling their sinks, and reset the step pipeline so the engine goes
        on serving the waiting ones. Returns the dropped request ids; the caller fails them."""
        ids = [seq.request_id for seq in self.scheduler.running]
        if self.in_flight is not None:
            ids += [req.seq.request_id for req, _ in self.in_flight.rows]
        self.in_flight = None
        for slot in self.ring.slots:       # a step that raised between acquire and release
            slot.in_use = False
        self.readback.tickets = [None] * self.readback.num_slots     # tickets that will never be read
        dropped = []
        for rid in dict.fromkeys(ids):
            req = self.requests.get(rid)
            if req is not None:
                self._drop(req, "error")
                self.stats["failed"] += 1
                dropped.append(rid)
        return dropped

    # ---------------------------------------------------------------- the step

    def step(self) -> int:
        """Queue one step on the GPU and hand out the tokens of the step before it; returns the
        number of tokens the new step computes (0 if there was nothing to schedule)."""
        t_start, self._waited = time.perf_counter(), 0.0
        # Penalties and grammars need every earlier token on the host: such steps are serialised.
        overlap = self.config.overlap and not self.num_serial
        if self.in_flight is not None and not overlap:
            self._finish(self.in_flight)
        scheduled = self.scheduler.schedule()
        previous, num_tokens = self.in_flight, 0
        if scheduled:
            self.in_flight = self._launch(scheduled)
            num_tokens = sum(item.num_tokens for item in scheduled)
            self.stats["steps"] += 1
            self.stats["step_tokens"] += num_tokens
        if previous is not None:        # its tokens, read while the step just queued runs
            self._finish(previous)
        if self.in_flight is not None and not overlap:
            self._finish(self.in_flight)
        # Host time of the step: all of it but the waits for the device (the readback events).
        self.stats["host_s"] += time.perf_counter() - t_start - self._waited
        return num_tokens

    def _launch(self, scheduled: list[ScheduledSeq]) -> InFlight:
        """Pack, upload, run and sample one step on the compute stream; returns without waiting."""
        s = self.streams
        prev = self.in_flight
        plan = plan_batch(scheduled, self.config.block_size, prev.row_of if prev is not None else None)
        reqs = [self.requests[item.seq.request_id] for item in plan.sampled]
        params = [r.seq.params for r in reqs]
        slot = self.ring.acquire()
        for name, (data, dtype) in {**plan.fields, **Sampler.fields(params)}.items():
            slot.put(name, data, dtype)
        if any(r.matcher is not None for r in reqs):     # serial steps: every matcher is up to date
            slot.put("token_bitmask", self.grammars().bitmask([r.matcher for r in reqs]), torch.int32)
        if self._driving:
            self.tp.send(("step", plan.shape(), *slot.contents()))
        now = time.perf_counter()
        for item in scheduled:
            req = self.requests[item.seq.request_id]
            if req.scheduled_time is None:
                req.scheduled_time = now
                self.queue_time.add(now - req.arrival_time)
        with s.on(s.compute):
            dev = self.ring.upload(slot)
            batch = plan.batch(dev, self.kv_cache)
            if plan.num_fills:      # tokens the previous step sampled, straight from the device
                batch.input_ids.index_copy_(0, dev["fill_rows"], prev.tokens.index_select(0, dev["fill_src"]))
                if self.tp is not None:
                    self.tp.broadcast(batch.input_ids)
            logits = self._forward(batch, bool(plan.sampled))
            out = []
            if plan.sampled:
                out = self.sampler.sample(logits, params, [r.generator for r in reqs],
                                          [r.seq.output_ids for r in reqs], dev)
        self.ring.release(slot)
        for item in scheduled:
            self.scheduler.advance(item)
        rows = []
        for req in reqs:                # the new tokens hold their places until they are read
            seq = req.seq
            rows.append((req, len(seq.output_ids)))
            seq.output_ids.append(PLACEHOLDER)
            seq.num_pending += 1
        tokens = out[0] if out else torch.empty(0, dtype=torch.int64, device=self.device)
        ticket = self.readback.send(out or [tokens])
        return InFlight(ticket, rows, tokens)

    def _forward(self, batch, sampled: bool) -> torch.Tensor | None:
        """The step's logits of its sampled rows: a decode graph's replay, the step graphs' pieces
        around eager attention, or the model run eagerly."""
        if self.graphs is not None and batch.num_prefills == 0 and batch.num_decodes <= self.graphs.max_batch:
            return self.graphs.run(batch)      # every decode row samples, in order
        if self.step_graphs is not None and batch.input_ids.shape[0] <= self.step_graphs.max_tokens:
            hidden = self.step_graphs.run(batch)
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden[batch.logits_indices]) if sampled else None

    def replay_step(self, shape: tuple, fields: dict, data: bytes) -> None:
        """A worker rank: the forward of the step rank 0 sent (its inputs, uploaded the same way)."""
        s = self.streams
        plan = BatchPlan.from_shape(shape)
        slot = self.ring.acquire()
        slot.restore(fields, data)
        with s.on(s.compute):
            dev = self.ring.upload(slot)
            batch = plan.batch(dev, self.kv_cache)
            if plan.num_fills:
                self.tp.broadcast(batch.input_ids)
            self._forward(batch, plan.num_sampled > 0)
        self.ring.release(slot)

    def _finish(self, step: InFlight) -> None:
        """Read a step's tokens back (waiting for its copy only) and hand them to the requests."""
        if self.in_flight is step:
            self.in_flight = None
        t = time.perf_counter()
        host = step.ticket.result()
        self._waited += time.perf_counter() - t
        tokens = host[0].tolist()
        params = [req.seq.params for req, _ in step.rows]
        logprobs = Sampler.logprobs_on_host(params, tokens, *host[1:]) if len(host) > 1 else [None] * len(tokens)
        now = time.perf_counter()
        for (req, index), token, lp in zip(step.rows, tokens, logprobs):
            seq = req.seq
            if seq.status is Status.FINISHED:
                continue    # aborted, or it finished on the token before this one
            seq.num_pending -= 1
            seq.output_ids[index] = token
            self._emit(req, index, token, lp, now)

    def _emit(self, req: Request, index: int, token: int, logprob, now: float) -> None:
        """Token `index` of the request's output is known: stream it, and end the request if it is
        the last one."""
        seq, params = req.seq, req.seq.params
        if req.last_token_time is None:
            self.ttft.add(now - req.arrival_time)
        else:
            self.itl.add(now - req.last_token_time)
        req.last_token_time = now
        reason = None
        if req.matcher is not None and (not req.matcher.accept_token(token) or req.matcher.is_terminated()):
            reason = "stop"     # the grammar is complete (a refused token cannot be sampled: it is masked)
        elif not params.ignore_eos and token in self.eos_ids:
            reason = "stop"
        elif params.stop_token_ids and token in params.stop_token_ids:
            reason = "stop"
        elif req.detok is not None and req.detok.add(token) is not None:
            reason = "stop"
        elif index + 1 >= seq.max_tokens:
            reason = "length"
        text = req.detok.take(final=reason is not None) if req.detok else ""
        if reason is not None:
            del seq.output_ids[index + 1:]      # a token sampled after the last one is dropped
            seq.num_pending = 0
            self._drop(req, reason)
            self.stats["finished"] += 1
        else:
            self.scheduler.publish(seq)         # blocks that waited for this token
        req.sink(self._chunk(req, [token], text, reason, None if logprob is None else [logprob], index + 1))

    @staticmethod
    def _chunk(req, token_ids, text, reason, logprobs, completion_tokens):
        return StreamChunk(req.seq.request_id, token_ids, text, reason, len(req.seq.prompt_ids),
                           completion_tokens, logprobs, req.seq.num_cached_tokens or 0)

    # ---------------------------------------------------------------- whole-sequence passes

    def hidden_states(self, token_lists: list[list[int]], check: bool = True) -> list[torch.Tensor]:
        """Final-norm hidden states of whole sequences (no KV kept), one [len, hidden] per sequence."""
        return self.sequence_pass(token_lists, False, check)

    def sequence_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits at every position of one sequence (no KV kept): [len, vocab]."""
        return self.sequence_pass([list(token_ids)], True)[0]

    def cached_logits(self, token_ids: list[int], cache_chunk: int) -> torch.Tensor:
        """fp32 logits at every position of one sequence, computed as serving computes them: through
        the paged KV cache, `cache_chunk` tokens a step, each step attending to the prefix as the cache holds
        it (what kv_cache_dtype changes; a chunk of 1 is a decode step). Its blocks come from the pool
        and go back to it; the steps run on the compute stream after whatever is queued there."""
        if not token_ids or len(token_ids) > self.max_model_len:
            raise ValueError(f"token_ids: need 1..{self.max_model_len} tokens (got {len(token_ids)})")
        most = self.config.max_num_batched_tokens
        if not isinstance(cache_chunk, int) or isinstance(cache_chunk, bool) or not 1 <= cache_chunk <= most:
            raise ValueError(f"cache_chunk: must be an int in 1..{most} (got {cache_chunk!r})")
        if self.tp is not None:
            raise ValueError("cached_logits: not with tensor parallelism (the other ranks would need the steps)")
        bs, pool = self.config.block_size, self.kv_cache.pool
        need = -(-len(token_ids) // bs)
        if need > pool.num_free:
            raise ValueError(f"token_ids: {len(token_ids)} tokens need {need} free KV blocks, {pool.num_free} are free")
        seq = Sequence("cached_logits", list(token_ids), SamplingParams(max_tokens=1), 1)
        seq.block_table = [pool.allocate() for _ in range(need)]
        out = []
        try:
            with self.streams.on(self.streams.compute):
                for start in range(0, len(token_ids), cache_chunk):
                    plan = plan_batch([ScheduledSeq(seq, start, min(cache_chunk, len(token_ids) - start))], bs)
                    dev = {name: torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)
                           for name, (data, dtype) in plan.fields.items()}
                    batch = plan.batch(dev, self.kv_cache)
                    out.append(self.model.compute_logits(self.model(batch.input_ids, batch.positions, batch)))
                logits = torch.cat(out)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).wait_stream(self.streams.compute)
        finally:
            for block in seq.block_table:
                pool.release(block)
        return logits

    def sequence_pass(self, token_lists: list[list[int]], logits: bool, check: bool = True) -> list[torch.Tensor]:
        """One forward over whole sequences: per sequence its hidden states, or its logits."""
        for toks in token_lists if check else ():
            if not toks or len(toks) > self.max_model_len:
                raise ValueError(f"input: each sequence needs 1..{self.max_model_len} tokens "
                                 f"(got {len(toks)})")
        if self._driving:
            self.tp.send(("hidden", token_lists, logits, False))
        # Runs on the caller's current stream (its results are used there), ordered after the steps
        # queued so far and before the ones queued later: streamed layers' buffers rely on that.
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.streams.compute)
        batch = build_prefill_only(token_lists, self.device)
        out = self.model(batch.input_ids, batch.positions, batch)
        if logits:
            out = self.model.compute_logits(out)
        if cuda:
            self.streams.compute.wait_stream(torch.cuda.current_stream(self.device))
        return list(out.split([len(t) for t in token_lists]))

    def metrics(self) -> dict:
        pool, s = self.kv_cache.pool, self.stats

        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used,
            "kv_blocks_free": pool.num_free, "prefix_cache_queries": pool.queries,
            "prefix_cache_hits": pool.hits,
            "prefix_cache_hit_rate": pool.hits / pool.queries if pool.queries else 0.0,
            "preemptions": self.scheduler.num_preemptions, "steps": s["steps"],
            "tokens_per_step": s["step_tokens"] / s["steps"] if s["steps"] else 0.0,
            "host_seconds_per_step": s["host_s"] / s["steps"] if s["steps"] else 0.0,
            "step_tokens": s["step_tokens"], "host_seconds": s["host_s"],
            "requests_finished": s["finished"], "requests_aborted": s["aborted"], "requests_failed": s["failed"],
            "ttft_seconds": self.ttft.summary(), "itl_seconds": self.itl.summary(),
            "queue_seconds": self.queue_time.summary(),
            # What replays as CUDA graphs: 0 where graphs are off or their capture failed (the
            # engine then runs those steps eagerly, several times slower at decode, and logs why).
            "graph_decode_batch_sizes": len(self.graphs.graphs) if self.graphs is not None else 0,
            "graph_step_sizes": len(self.step_graphs.pieces) if self.step_graphs is not None else 0,
        }
