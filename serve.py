"""OpenAI-compatible HTTP server for microengine: FastAPI on uvicorn with uvloop.

    python serve.py --model llama            # http://127.0.0.1:8000/v1

Endpoints: /v1/chat/completions and /v1/completions (SSE streaming or not), /v1/embeddings, /v1/models,
/health, /metrics (Prometheus text). The engine runs in its own thread; the event loop only parses,
validates, tokenizes (in a worker thread) and relays stream chunks, so a slow or malformed request never
stalls the others. A client that disconnects aborts its engine requests, which frees their KV blocks at
once. SIGTERM/SIGINT drain: new requests get 503, in-flight ones finish or are aborted within
--shutdown-timeout, then the process exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import uvicorn
import uvloop
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import ContextLengthError
from engine.memory import allocator
from engine.openai_protocol import (
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    EmbeddingRequest,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    error_body,
    parse_request,
    sse,
    usage,
    validation_error,
)

log = logging.getLogger("microengine.serve")

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
_FINISH = {"stop": "stop", "length": "length"}   # the engine's "abort" is never shown as a finish reason


# ---------------------------------------------------------------------------------------------------
# Server state and the gate in front of the app: auth, draining, in-flight count, status counters.

@dataclasses.dataclass
class ServerState:
    llm: object
    model_names: tuple[str, ...]             # names a request's "model" may use; the first is reported
    api_key: str | None
    max_request_bytes: int
    shutdown_timeout: float
    sampling_params: type             # engine.SamplingParams
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    draining: bool = False
    in_flight: int = 0
    responses_by_code: dict = dataclasses.field(default_factory=dict)
    # Tokenization runs on one worker thread: the event loop must never run a long encode itself, and
    # one thread keeps the HF fast tokenizer away from concurrent use by this server.
    worker: ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize"))

    @property
    def model_name(self) -> str:
        return self.model_names[0]


async def _send_json(send, status: int, body: dict, headers: tuple = ()):
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *headers]})
    await send({"type": "http.response.body", "body": payload})


class Gate:
    """Pure ASGI middleware (BaseHTTPMiddleware would buffer streams and hide client disconnects)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        if state.draining:
            self._count(503)
            return await _send_json(send, 503, error_body(
                "The server is shutting down and accepts no new requests.", type="server_error",
                code="server_shutting_down"), ((b"connection", b"close"),))
        if state.api_key is not None and scope["path"] != "/health" and not self._authorized(scope):
            self._count(401)
            return await _send_json(send, 401, error_body(
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key"), ((b"www-authenticate", b"Bearer"),))
        status = 500

        async def send_counting(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        state.in_flight += 1
        try:
            await self.app(scope, receive, send_counting)
        finally:
            state.in_flight -= 1
            self._count(status)

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                          self.state.api_key.encode())
        return False

    def _count(self, status: int):
        codes = self.state.responses_by_code
        codes[status] = codes.get(status, 0) + 1


# ---------------------------------------------------------------------------------------------------
# Request helpers.

async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 past `limit`. An oversized body is still read (up to 16x the limit, without
    keeping it) so the client sees the 413 instead of a connection reset in the middle of its upload."""
    declared = request.headers.get("content-length")
    too_large = declared is not None and declared.isdigit() and int(declared) > limit
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            too_large = True
            chunks.clear()
            if size > 16 * limit:
                break
        elif not too_large:
            chunks.append(chunk)
    if too_large:
        raise APIError(413, f"The request body is larger than the limit of {limit} bytes.",
                       code="request_too_large")
    return b"".join(chunks)


def check_model(state: ServerState, name: str):
    if name not in state.model_names:
        raise APIError(400, f"The model '{name}' does not exist; this server serves '{state.model_name}'.",
                       param="model", code="model_not_found")


def engine_error(exc: ValueError) -> APIError:
    """The engine's ValueErrors start with the parameter name ("temperature: ..."); context overflows
    are ContextLengthError."""
    message = str(exc)
    head, sep, _ = message.partition(":")
    param = head if sep and head.isidentifier() else None
    code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else "invalid_value"
    return APIError(400, message, param=param, code=code)


async def open_streams(state: ServerState, prompts: list[list[int]], req, request_id: str) -> list:
    """One engine stream per (prompt, choice); all or none (a refused one aborts those already open)."""
    if state.draining:
        raise APIError(503, "The server is shutting down.", type="server_error", code="server_shutting_down")

    def admit():
        streams = []
        try:
            for p, prompt in enumerate(prompts):
                for i in range(req.n):
                    params = state.sampling_params(**req.sampling_kwargs(i))
                    streams.append(state.llm.stream(prompt, params, request_id=f"{request_id}-{p}-{i}"))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    try:
        return await off_loop(admit)
    except RuntimeError as exc:     # the engine stopped admitting (shutdown)
        raise APIError(503, str(exc), type="server_error", code="server_shutting_down") from None
    except ValueError as exc:
        err = engine_error(exc)
        if err.param == "prompt" and isinstance(req, ChatCompletionRequest):
            err.param = "messages"
        raise err from None


def off_loop(fn, *args) -> asyncio.Future:
    """Run a call that waits on the engine thread (LLM.stream/metrics block until the next step
    boundary) without blocking the event loop. A daemon thread per call, not a pool: a call caught by
    shutdown must neither hold up the others nor keep the process from exiting."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, exc):
        if future.done():           # the awaiting handler was cancelled
            return
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)

    def run():
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting handler
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="engine-call", daemon=True).start()
    return future


async def merge_streams(streams: list):
    """Yield (choice index, chunk) from several engine streams as chunks arrive."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index, stream):
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
                if tasks[index].done() and tasks[index].exception() is not None:
                    raise tasks[index].exception()
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()


def abort_unfinished(streams: list, choices: list[Choice]):
    for stream, choice in zip(streams, choices):
        if choice.finish_reason is None:
            stream.abort()


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """SSE of engine streams that aborts the unfinished ones however the response ends: done, client
    gone (Starlette cancels the body), or cancelled before the body generator ever started."""

    def __init__(self, events, streams: list, choices: list[Choice]):
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.streams, self.choices = streams, choices

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort_unfinished(self.streams, self.choices)


SHUTDOWN_ABORT = error_body("The request was aborted because the server is shutting down.",
                            type="server_error", code="server_shutting_down")


async def collect(request: Request, streams: list) -> list[Choice] | None:
    """Run the streams to completion for a non-streaming response. Returns None when the client went
    away first (the streams are then aborted)."""
    choices = [Choice() for _ in streams]

    async def gather():
        async for index, chunk in merge_streams(streams):
            choices[index].add(chunk)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:       # this handler was cancelled (server stopping)
        work.cancel()
        abort_unfinished(streams, choices)
        raise
    finally:
        watch.cancel()
    if not work.done():         # the client went away first
        work.cancel()
        abort_unfinished(streams, choices)
        return None
    work.result()
    if any(c.finish_reason == "abort" for c in choices):
        raise APIError(503, SHUTDOWN_ABORT["error"]["message"], type="server_error",
                       code="server_shutting_down")
    return choices


# ---------------------------------------------------------------------------------------------------
# Endpoints.

def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="microengine", docs_url=None, redoc_url=None, openapi_url=None)
    llm = state.llm
    token_text = TokenText(llm.tokenizer)

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type=kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(error_body("Internal server error.", type="server_error"), status_code=500)

    async def in_worker(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(state.worker, fn, *args)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": state.model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(state)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name not in state.model_names:
            raise APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        return model_card(state)

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus_text(await off_loop(llm.metrics), state),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_request(ChatCompletionRequest, await read_body(request, state.max_request_bytes))
        check_model(state, req.model)
        try:
            prompt = await in_worker(llm.encode_chat, req.message_dicts())
        except (ValueError, TemplateError) as exc:   # a template may refuse a conversation (raise_exception)
            raise APIError(400, f"messages: {exc}", param="messages", code="invalid_value") from None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await open_streams(state, [prompt], req, request_id)
        if req.stream:
            choices = [Choice() for _ in streams]
            return EventStream(chat_events(req, streams, choices, request_id), streams, choices)
        choices = await collect(request, streams)
        if choices is None:
            return Response(status_code=499)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": state.model_name, "system_fingerprint": None,
                "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                             "logprobs": chat_logprobs(c.logprobs, token_text) if req.logprobs else None,
                             "finish_reason": _FINISH[c.finish_reason]} for i, c in enumerate(choices)],
                "usage": usage(choices, req.n)}

    async def chat_events(req: ChatCompletionRequest, streams, choices, request_id):
        created = int(time.time())
        include_usage = req.include_usage()
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": state.model_name, "system_fingerprint": None}

        def frame(choice_list):
            return sse({**head, "choices": choice_list, **({"usage": None} if include_usage else {})})

        yield frame([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(len(streams))])
        async for i, chunk in merge_streams(streams):
            choices[i].add(chunk)
            if chunk.finish_reason == "abort":
                yield sse(SHUTDOWN_ABORT)
                break
            lp = chat_logprobs(chunk.logprobs, token_text) if req.logprobs and chunk.logprobs else None
            if chunk.text or lp is not None:
                yield frame([{"index": i, "delta": {"content": chunk.text}, "logprobs": lp,
                              "finish_reason": None}])
            if chunk.finish_reason is not None:
                yield frame([{"index": i, "delta": {}, "logprobs": None,
                              "finish_reason": _FINISH[chunk.finish_reason]}])
        else:
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(choices, req.n)})
        yield SSE_DONE

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await read_body(request, state.max_request_bytes))
        check_model(state, req.model)
        prompts = []
        for p in req.prompts():
            if isinstance(p, list):    # token ids: the engine checks them against the vocabulary
                prompts.append(p)
                continue
            try:
                prompts.append(await in_worker(llm.encode_prompt, p))
            except ValueError as exc:   # an empty prompt
                raise engine_error(exc) from None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await open_streams(state, prompts, req, request_id)
        if req.stream:
            choices = [Choice() for _ in streams]
            return EventStream(completion_events(req, streams, choices, request_id), streams, choices)
        choices = await collect(request, streams)
        if choices is None:
            return Response(status_code=499)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": state.model_name, "system_fingerprint": None,
                "choices": [{"index": i, "text": c.text,
                             "logprobs": completion_logprobs(c.logprobs, token_text, 0)
                             if req.logprobs is not None else None,
                             "finish_reason": _FINISH[c.finish_reason]} for i, c in enumerate(choices)],
                "usage": usage(choices, req.n)}

    async def completion_events(req: CompletionRequest, streams, choices, request_id):
        created = int(time.time())
        include_usage = req.include_usage()
        offsets = [0] * len(streams)
        head = {"id": request_id, "object": "text_completion", "created": created, "model": state.model_name,
                "system_fingerprint": None}

        def frame(choice):
            return sse({**head, "choices": [choice], **({"usage": None} if include_usage else {})})

        async for i, chunk in merge_streams(streams):
            choices[i].add(chunk)
            if chunk.finish_reason == "abort":
                yield sse(SHUTDOWN_ABORT)
                break
            lp = None
            if req.logprobs is not None and chunk.logprobs:
                lp = completion_logprobs(chunk.logprobs, token_text, offsets[i])
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if chunk.text or lp is not None:
                yield frame({"index": i, "text": chunk.text, "logprobs": lp, "finish_reason": None})
            if chunk.finish_reason is not None:
                yield frame({"index": i, "text": "", "logprobs": None,
                             "finish_reason": _FINISH[chunk.finish_reason]})
        else:
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(choices, req.n)})
        yield SSE_DONE

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        req = parse_request(EmbeddingRequest, await read_body(request, state.max_request_bytes))
        check_model(state, req.model)
        if state.draining:
            raise APIError(503, "The server is shutting down.", type="server_error",
                           code="server_shutting_down")
        texts = req.texts()
        counts = [len(ids) for ids in await in_worker(lambda: [llm.encode_prompt(t) for t in texts])]
        for i, count in enumerate(counts):
            if count > llm.max_model_len:
                raise APIError(400, f"input[{i}] has {count} tokens; the context length is "
                                    f"{llm.max_model_len}.", param="input", code="context_length_exceeded")
        # One engine pass per token-budget-sized batch: passes interleave with decode steps, so a large
        # embedding request delays the running streams by one pass at a time, and memory stays bounded.
        budget = max(llm.max_model_len, getattr(llm.config, "max_num_batched_tokens", 0))
        batches, tokens = [[]], 0
        for text, count in zip(texts, counts):
            if batches[-1] and tokens + count > budget:
                batches.append([])
                tokens = 0
            batches[-1].append(text)
            tokens += count
        rows = []
        for batch in batches:
            rows += (await off_loop(llm.embed, batch)).float().tolist()
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(struct.pack(f"<{len(row)}f", *row)).decode()
                 if req.encoding_format == "base64" else row} for i, row in enumerate(rows)]
        total = sum(counts)
        return {"object": "list", "data": data, "model": state.model_name,
                "usage": {"prompt_tokens": total, "total_tokens": total}}

    return app


def model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "microengine",
            "max_model_len": state.llm.max_model_len}


# ---------------------------------------------------------------------------------------------------
# Prometheus text format (written by hand: the engine's metrics are one dict, read when scraped).

_COUNTERS = {"prefix_cache_queries", "prefix_cache_hits", "preemptions", "steps", "requests_finished",
             "requests_aborted"}
_HELP = {
    "running": "requests in the running batch", "waiting": "requests queued for admission",
    "kv_blocks_total": "KV-cache blocks in the pool", "kv_blocks_used": "KV-cache blocks held by requests",
    "kv_blocks_free": "KV-cache blocks free or evictable",
    "prefix_cache_queries": "prompt blocks looked up in the prefix cache",
    "prefix_cache_hits": "prompt blocks found in the prefix cache",
    "prefix_cache_hit_rate": "prefix-cache hits / queries", "preemptions": "requests preempted (recomputed)",
    "steps": "engine steps run", "tokens_per_step": "mean tokens per engine step",
    "host_seconds_per_step": "mean host time per step outside device work and sampling",
    "requests_finished": "requests finished", "requests_aborted": "requests aborted",
    "ttft_seconds": "time to first token", "itl_seconds": "inter-token latency",
}


def prometheus_text(metrics: dict, state: ServerState) -> str:
    lines = []
    for key, value in metrics.items():
        name = f"microengine_{key}"
        if isinstance(value, dict):     # a latency summary: count/sum/p50/p99
            lines += [f"# HELP {name} {_HELP.get(key, key)}", f"# TYPE {name} summary"]
            for key_q, q in (("p50", "0.5"), ("p99", "0.99")):
                if value.get(key_q) is not None:
                    lines.append(f'{name}{{quantile="{q}"}} {_num(value[key_q])}')
            lines += [f"{name}_sum {_num(value.get('sum', 0))}", f"{name}_count {_num(value.get('count', 0))}"]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            counter = key in _COUNTERS
            full = f"{name}_total" if counter else name
            lines += [f"# HELP {full} {_HELP.get(key, key)}", f"# TYPE {full} {'counter' if counter else 'gauge'}",
                      f"{full} {_num(value)}"]
    lines += ["# HELP microengine_http_responses_total HTTP responses sent, by status code",
              "# TYPE microengine_http_responses_total counter"]
    lines += [f'microengine_http_responses_total{{code="{code}"}} {n}'
              for code, n in sorted(state.responses_by_code.items())]
    lines += ["# HELP microengine_http_in_flight HTTP requests being served",
              "# TYPE microengine_http_in_flight gauge", f"microengine_http_in_flight {state.in_flight}"]
    return "\n".join(lines) + "\n"


def _num(x) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


# ---------------------------------------------------------------------------------------------------
# uvicorn with a draining shutdown.

class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: refuse new requests (503), let the engine finish or abort what is in
    flight within the timeout, then stop uvicorn. A second signal stops at once. Exits 0 either way
    (uvicorn's own handler re-raises the signal after serving, which would kill the process)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.drain_task = None

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, lambda signum, _frame: loop.call_soon_threadsafe(self.on_signal, signum))
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def on_signal(self, signum: int):
        if self.drain_task is not None:
            log.warning("second %s: stopping now", signal.Signals(signum).name)
            self.should_exit = self.force_exit = True
            return
        log.info("%s: draining (%d in flight, timeout %.0fs)", signal.Signals(signum).name,
                 self.state.in_flight, self.state.shutdown_timeout)
        self.state.draining = True
        self.drain_task = asyncio.ensure_future(self.drain())

    async def drain(self):
        state = self.state
        deadline = time.monotonic() + state.shutdown_timeout
        try:
            await asyncio.get_running_loop().run_in_executor(None, state.llm.shutdown, state.shutdown_timeout)
        finally:
            # The engine is done; give the handlers a moment to write their last SSE frames.
            while state.in_flight and time.monotonic() < deadline + 2.0:
                await asyncio.sleep(0.02)
            self.should_exit = True


# ---------------------------------------------------------------------------------------------------
# Command line.

ENGINE_HELP = {
    "model": "what to serve: 'llama' (the embedded SmolLM2-135M-Instruct), a shape preset such as "
             "'llama-3.1-8b' (random weights), or a Hugging Face Llama directory",
    "device": "cuda, cuda:N or cpu (default: cuda when there is one)",
    "dtype": "model dtype: bf16, fp16 or fp32 (default: bf16 on cuda, fp32 on cpu)",
    "weights": "linear-layer weight format (default: bf16, or what a compressed-tensors checkpoint "
               "stores, which loads as stored: another format is an error)",
    "sparse_ffn": "prune the FFN weights to 2:4 with this method (alone: magnitude)",
    "fused_kernels": "fused Triton norm/RoPE/SwiGLU kernels; off: PyTorch references (attention "
                     "always uses its Triton kernels on cuda) (default: on)",
    "tune": "on: time the GEMM kernels for this model's shapes at start (cached in "
            "~/.cache/microengine); off: each op's default kernel",
    "tokenizer": "tokenizer directory for shape presets (default: the embedded model's, or "
                 "$MICROENGINE_TOKENIZER)",
    "kv_cache_tokens": "KV-cache size in tokens (default: --kv-cache-memory-fraction of free GPU memory)",
    "kv_cache_memory_fraction": "fraction of free GPU memory for the KV cache",
    "block_size": "tokens per KV-cache block (a power of two)",
    "max_model_len": "context length, prompt plus output (default: the model's, at most 8192)",
    "max_num_seqs": "most sequences in one engine step",
    "max_num_batched_tokens": "token budget of one step (decode tokens plus prefill chunks)",
    "enable_prefix_caching": "reuse the KV blocks of shared prompt prefixes",
    "cuda_graphs": "capture decode steps in CUDA graphs (cuda only)",
    "gpu_memory_limit": "GiB of device memory for weights, KV cache and activations; decoder layers "
                        "that do not fit are streamed from pinned host memory (default: no limit)",
    "overlap": "pipelined steps: the host schedules and uploads step N+1 while step N runs and "
               "reads step N's tokens afterwards; off: every step is serialised",
    "offload": "stream the decoder layers that do not fit from pinned host memory, layer by layer, "
               "overlapped with the compute (the limit: --gpu-memory-limit, else the device's total "
               "memory); the model is loaded onto the device first, so it must fit there to load",
    "seed": "seed for random preset weights and for requests without a seed",
}


def engine_arguments(parser: argparse.ArgumentParser):
    """One option per EngineConfig field, so the CLI can never fall behind the engine."""
    from engine.config import SPARSE_METHODS, WEIGHT_FORMATS, EngineConfig
    group = parser.add_argument_group("engine (EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        text = ENGINE_HELP.get(f.name, f.name.replace("_", " "))
        if default is not None:
            text += f" (default: {default})"
        kw = {"dest": f.name, "default": argparse.SUPPRESS, "help": text}
        annotation = str(f.type)
        if f.name == "weights":
            group.add_argument(flag, choices=WEIGHT_FORMATS, **kw)
        elif f.name == "sparse_ffn":
            group.add_argument(flag, nargs="?", const=SPARSE_METHODS[0], choices=SPARSE_METHODS, **kw)
        elif "bool" in annotation:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif annotation.startswith("int"):
            group.add_argument(flag, type=int, metavar="N", **kw)
        elif annotation.startswith("float"):
            group.add_argument(flag, type=float, metavar="X", **kw)
        else:
            group.add_argument(flag, type=str, **kw)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="microengine OpenAI-compatible server (FastAPI + uvicorn on uvloop).")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port to bind; 0: any free port (default: %(default)s)")
    server.add_argument("--api-key", default=os.environ.get("MICROENGINE_API_KEY"),
                        help="require 'Authorization: Bearer <key>' on every endpoint but /health "
                             "(default: $MICROENGINE_API_KEY, else no auth)")
    server.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: the engine's model name; the --model value is "
                             "accepted too)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM/SIGINT before abort (default: %(default)s)")
    server.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest request body accepted; 413 above (default: %(default)s)")
    server.add_argument("--access-log", action="store_true", help="log every request")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="(default: %(default)s)")
    engine_arguments(parser)
    allocator.add_arguments(parser)
    args = parser.parse_args(argv)
    allocator.configure_from_args(args, parser)     # before CUDA starts; may restart the process
    try:
        graphs = allocator.resolve_cuda_graphs(args.allocator, getattr(args, "cuda_graphs", None))
    except ValueError as e:
        parser.error(str(e))
    if graphs is not None:
        args.cuda_graphs = graphs
    return args


def bind(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    logging.getLogger().setLevel(args.log_level.upper())
    from engine import LLM, SamplingParams
    from engine.config import EngineConfig
    engine_kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    try:
        sock = bind(args.host, args.port)    # before the model loads: a taken port fails in a second
    except OSError as exc:
        print(f"microengine: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    llm = LLM(**engine_kw)
    allocator.apply_release(llm.engine.device)
    names = tuple(dict.fromkeys(n for n in (args.served_model_name, llm.model_name, engine_kw.get("model", "llama"))
                                if n))
    state = ServerState(llm=llm, model_names=names, api_key=args.api_key,
                        max_request_bytes=args.max_request_bytes, shutdown_timeout=args.shutdown_timeout,
                        sampling_params=SamplingParams)
    app = Gate(create_app(state), state)
    config = uvicorn.Config(app, loop="uvloop", lifespan="off", log_level=args.log_level,
                            access_log=args.access_log, timeout_graceful_shutdown=5, timeout_keep_alive=30)
    server = DrainingServer(config, state)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"microengine: serving '{state.model_name}' (max_model_len {llm.max_model_len}) at "
          f"http://{shown}:{port}/v1  [chat/completions, completions, embeddings, models; /health, /metrics]"
          f"{'; API key required' if args.api_key else ''}", flush=True)
    uvloop.run(server.serve(sockets=[sock]))   # serve() (not run()) so the signal handling above is ours
    log.info("shut down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
