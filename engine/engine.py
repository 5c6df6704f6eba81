"""The step loop: schedule -> build batch -> forward -> sample -> emit.

`Engine` is single-threaded and synchronous; engine/llm.py runs it on a background thread and feeds
it requests. Each step's outputs go to the request's sink (a callable taking a StreamChunk).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from engine.batch import build_batch, build_prefill_only
from engine.config import EngineConfig, resolve_device, resolve_dtype
from engine.kernels.norms import set_fused_kernels, triton_available
from engine.linear import convert_model, input_channel_norms
from engine.memory.kv_cache import KVCache
from engine.quality import calibration_windows
from engine.sampling import Sampler, SamplingParams, TokenLogprob
from engine.scheduler import Scheduler, Sequence
import models.loader  # module import: models.llama imports engine.kernels, so this cycles

log = logging.getLogger("microengine")

CPU_KV_TOKENS = 16384          # the CPU has no "free device memory" to size from
OFFLOAD_KV_TOKENS = 16384      # KV cache size planned into gpu_memory_limit when none is given


@dataclass
class StreamChunk:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None


class LatencySummary:
    """Count and sum of all samples; percentiles over the most recent ones."""

    def __init__(self, window: int = 10000):
        self.count, self.total = 0, 0.0
        self.recent: deque[float] = deque(maxlen=window)

    def add(self, x: float) -> None:
        self.count += 1
        self.total += x
        self.recent.append(x)

    def summary(self) -> dict:
        ys = sorted(self.recent)
        pct = lambda q: ys[min(len(ys) - 1, int(len(ys) * q))] if ys else 0.0  # noqa: E731
        return {"count": self.count, "sum": self.total, "p50": pct(0.5), "p99": pct(0.99)}


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
    last_token_time: float | None = None


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # A process-wide switch: engines in one process share the setting of the last one built.
        set_fused_kernels(config.fused_kernels)
        loaded = models.loader.load_model(config.model, self.device, self.dtype, seed=config.seed,
                                          tokenizer=config.tokenizer)
        self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        self.model_config = cfg = self.model.config
        if config.weights != "bf16" or config.sparse_ffn:
            norms = None
            if config.sparse_ffn == "wanda":
                windows = calibration_windows(self.tokenizer)
                norms = input_channel_norms(self.model, lambda: self.hidden_states(windows, check=False))
            convert_model(self.model, config.weights, config.sparse_ffn, norms)
        self.streamer = self._stream_layers() if config.gpu_memory_limit is not None else None
        self.eos_ids = set(cfg.eos_token_ids)
        self.max_model_len = min(config.max_model_len or min(cfg.max_position_embeddings, 8192),
                                 cfg.max_position_embeddings)
        self.kv_cache = KVCache(cfg.num_layers, self._num_kv_blocks(), config.block_size,
                                cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.scheduler = Scheduler(self.kv_cache.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.enable_prefix_caching)
        self.sampler = Sampler(self.device, config.seed)
        self.graphs = None
        # Streamed layers swap their weights in forward hooks, which a captured graph would skip.
        if self.device.type == "cuda" and config.cuda_graphs and self.streamer is None:
            self._capture_graphs()
        self.requests: dict[str, Request] = {}
        self.stats = {"steps": 0, "step_tokens": 0, "finished": 0, "aborted": 0, "host_s": 0.0}
        self.ttft, self.itl = LatencySummary(), LatencySummary()

    def _kv_bytes_per_token(self) -> int:
        cfg = self.model_config
        return KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)

    def _activation_reserve(self) -> int:
        """Room for the largest step's activations (the gate/up output dominates, kept twice over for
        SwiGLU) and for its fp32 logits."""
        c, cfg = self.config, self.model_config
        elt = torch.empty(0, dtype=self.dtype).element_size()
        act = c.max_num_batched_tokens * (4 * cfg.intermediate_size + 6 * cfg.hidden_size) * elt
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
                         // self._kv_bytes_per_token())
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
        return sum(t.nbytes for t in (m.embed_tokens.weight, m.norm.weight,
                                      *(() if m.lm_head is None else (m.lm_head.weight,))))

    def _stream_layers(self):
        """Plan which decoder layers fit in gpu_memory_limit beside the KV cache, and stream the rest
        from pinned host memory (engine/streams/offload.py). On the CPU the streamer runs on no-op
        streams, which exercises the same plumbing."""
        from engine.streams import FakeStreams, LayerStreamer, StepStreams, layer_stream_bytes, plan_offload
        c, model = self.config, self.model
        sizes = [layer_stream_bytes(layer) for layer in model.layers]
        kv = (c.kv_cache_tokens or OFFLOAD_KV_TOKENS) * self._kv_bytes_per_token() + self._activation_reserve()
        plan = plan_offload(sizes, self._non_layer_bytes(), int(c.gpu_memory_limit * 2**30), kv)
        log.info("gpu_memory_limit %.2f GiB: %d of %d decoder layers streamed from pinned host memory",
                 c.gpu_memory_limit, len(plan.offloaded_layers), len(sizes))
        if not plan.offloads:
            return None
        streams = StepStreams(self.device) if self.device.type == "cuda" else FakeStreams()
        streamer = LayerStreamer(model.layers, plan, streams, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()    # the streamed layers' device copies are gone
        return streamer

    def _capture_graphs(self) -> None:
        from engine.cuda_graphs import DecodeGraphs
        if not triton_available(self.model.embed_tokens.weight):
            return      # the reference attention syncs with the host: nothing to capture
        max_blocks = -(-self.max_model_len // self.config.block_size)
        graphs = DecodeGraphs(self.model, self.kv_cache, min(self.config.max_num_seqs, 512),
                              max_blocks, self.kv_cache.scratch_block)
        try:
            graphs.capture()
        except RuntimeError as e:   # a backend that cannot be captured: run decode eagerly
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s", e)
            torch.cuda.synchronize()
            return
        self.graphs = graphs

    # ---------------------------------------------------------------- requests

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Refuse what can never run (it depends only on static limits, so any thread may call it);
        returns the effective max_tokens."""
        max_tokens = self.scheduler.check(len(prompt_ids), params.max_tokens)
        bad = [t for t in prompt_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary "
                             f"(0..{self.model_config.vocab_size - 1})")
        return max_tokens

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
        self.requests[request_id] = Request(seq, sink, detok, gen, time.perf_counter())
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.finish(req.seq, "abort")
        self.stats["aborted"] += 1
        req.sink(self._chunk(req, [], "", "abort", None))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---------------------------------------------------------------- the step

    def step(self) -> int:
        """Run one step; returns the number of tokens it computed."""
        t_start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return 0
        batch = build_batch(scheduled, self.kv_cache, self.device)
        if self.graphs is not None and batch.num_prefills == 0 and batch.num_decodes <= self.graphs.max_batch:
            logits = self.graphs.run(batch)      # every decode row samples, in order
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch)
            logits = self.model.compute_logits(hidden[batch.logits_indices]) if batch.sampled else None
        t_launched = time.perf_counter()
        token_ids, logprobs = [], []
        if batch.sampled:
            reqs = [self.requests[s.seq.request_id] for s in batch.sampled]
            token_ids, logprobs = self.sampler(logits, [r.seq.params for r in reqs],
                                               [r.generator for r in reqs],
                                               [r.seq.output_ids for r in reqs])
        for item in scheduled:
            self.scheduler.advance(item)
        now = time.perf_counter()
        for item, tok, lp in zip(batch.sampled, token_ids, logprobs):
            self._emit(self.requests[item.seq.request_id], tok, lp, now)
        self.stats["steps"] += 1
        self.stats["step_tokens"] += batch.num_tokens
        # Host time of the step outside the device's work and the sampler: scheduling, building the
        # batch, launching the forward (one graph replay when captured), and the bookkeeping after.
        self.stats["host_s"] += (t_launched - t_start) + (time.perf_counter() - now)
        return batch.num_tokens

    def _emit(self, req: Request, token: int, logprob, now: float) -> None:
        seq, params = req.seq, req.seq.params
        seq.output_ids.append(token)
        if req.last_token_time is None:
            self.ttft.add(now - req.arrival_time)
        else:
            self.itl.add(now - req.last_token_time)
        req.last_token_time = now
        reason = None
        if not params.ignore_eos and token in self.eos_ids:
            reason = "stop"
        elif params.stop_token_ids and token in params.stop_token_ids:
            reason = "stop"
        elif req.detok is not None and req.detok.add(token) is not None:
            reason = "stop"
        elif len(seq.output_ids) >= seq.max_tokens:
            reason = "length"
        text = req.detok.take(final=reason is not None) if req.detok else ""
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self.requests[seq.request_id]
            self.stats["finished"] += 1
        req.sink(self._chunk(req, [token], text, reason, None if logprob is None else [logprob]))

    @staticmethod
    def _chunk(req, token_ids, text, reason, logprobs):
        seq = req.seq
        return StreamChunk(seq.request_id, token_ids, text, reason, len(seq.prompt_ids),
                           len(seq.output_ids), logprobs)

    # ---------------------------------------------------------------- whole-sequence passes

    def hidden_states(self, token_lists: list[list[int]], check: bool = True) -> list[torch.Tensor]:
        """Final-norm hidden states of whole sequences (no KV kept), one [len, hidden] per sequence."""
        for toks in token_lists if check else ():
            if not toks or len(toks) > self.max_model_len:
                raise ValueError(f"input: each sequence needs 1..{self.max_model_len} tokens "
                                 f"(got {len(toks)})")
        batch = build_prefill_only(token_lists, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        return list(hidden.split([len(t) for t in token_lists]))

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
            "requests_finished": s["finished"], "requests_aborted": s["aborted"],
            "ttft_seconds": self.ttft.summary(), "itl_seconds": self.itl.summary(),
        }
