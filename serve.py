"""OpenAI-compatible HTTP server for microengine: FastAPI on uvicorn with uvloop.

    python serve.py --model llama            # http://127.0.0.1:8000/v1

Endpoints: /v1/chat/completions and /v1/completions (SSE streaming or not; response_format json_object /
json_schema by constrained decoding), /v1/embeddings, /v1/models, /health, /metrics (Prometheus, through
prometheus_client). The engine runs in its own thread; the event loop only parses, validates, tokenizes
(in a worker thread) and relays stream chunks, so a slow or malformed request never stalls the others. A
client that disconnects aborts its engine requests, which frees their KV blocks at once.

In front of the app: the Host header must name this server (DNS rebinding), POST bodies must be JSON,
slow senders are cut (--header-timeout, --body-timeout), connections are capped (--max-connections), and
past the admission limit (--max-num-seqs running + --max-queued-requests waiting) requests get 429 with
Retry-After. SIGTERM/SIGINT drain: new requests get 503, in-flight ones finish or are aborted within
--shutdown-timeout, then the process exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import hmac
import ipaddress
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

import h11
import uvicorn
import uvloop
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine import ContextLengthError
from engine.memory import allocator
from engine.openai_protocol import (
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    EmbeddingRequest,
    TextOffsets,
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
DEFAULT_MAX_QUEUED_REQUESTS = 128
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 2048
RETRY_AFTER_S = 1          # what a 429 tells the client to wait: the queue turns over in seconds
_FINISH = {"stop": "stop", "length": "length"}   # the engine's "abort" is never shown as a finish reason


# ---------------------------------------------------------------------------------------------------
# Server state and the gate in front of the app: host and content-type checks, auth, draining,
# in-flight count, status counters.

class Admission:
    """Load shedding: at most `limit` engine requests (one per prompt and choice) running or queued.
    Past it a request is refused with 429 before any work is done for it, so the admitted ones keep
    their latency. A request that alone exceeds the limit still runs when nothing else does."""

    def __init__(self, limit: int):
        self.limit = limit
        self.streams: list = []         # engine streams admitted and not yet done
        self.reserved = 0               # requests admitted and still being tokenized
        self.rejected = 0

    def in_flight(self) -> int:
        self.streams = [s for s in self.streams if not s.done]
        return len(self.streams) + self.reserved

    def count(self) -> int:
        """in_flight() without pruning, for a scrape on another thread."""
        return sum(not s.done for s in list(self.streams)) + self.reserved

    @contextlib.contextmanager
    def reserve(self, count: int):
        """Hold `count` places while the request is tokenized; open_streams turns them into streams."""
        busy = self.in_flight()
        if busy and busy + count > self.limit:
            self.rejected += 1
            raise APIError(429, f"The server is at capacity ({busy} requests running or queued, the limit is "
                                f"{self.limit}); retry after {RETRY_AFTER_S}s.", type="rate_limit_error",
                           code="server_overloaded", headers={"retry-after": str(RETRY_AFTER_S)})
        self.reserved += count
        try:
            yield
        finally:
            self.reserved -= count


class HostCheck:
    """Which Host headers a request may carry (DNS rebinding: a web page whose name resolves to this
    machine must not reach a server bound to loopback). Allowed: the bound address, 'localhost' when
    that is a loopback address, and the names given with --allowed-hosts ('*': any). A server bound to
    every interface (0.0.0.0, ::) also takes any IP address, which no rebinding can forge."""

    def __init__(self, bound_host: str, extra: list[str] = ()):
        self.any = "*" in extra
        names = {_host_key(bound_host), *(_host_key(h) for h in extra)}
        try:
            ip = ipaddress.ip_address(bound_host.strip("[]"))
        except ValueError:
            ip = None
        if ip is not None and ip.is_loopback:
            names |= {"localhost", "127.0.0.1", "[::1]"}
        self.any_ip = ip is not None and ip.is_unspecified
        self.names = frozenset(names)

    def allows(self, host: str | None) -> bool:
        if self.any or host is None:    # no Host header: HTTP/1.0, never a browser
            return True
        key = _host_key(host)
        if key in self.names:
            return True
        if self.any_ip:
            try:
                ipaddress.ip_address(key.strip("[]"))
                return True
            except ValueError:
                return False
        return False


def _host_key(host: str) -> str:
    """A Host header's (or host name's) name without its port, lower case; IPv6 in brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1]
    if host.count(":") > 1:             # a bare IPv6 address
        return f"[{host}]"
    return host.rsplit(":", 1)[0] if ":" in host else host


@dataclasses.dataclass
class ServerState:
    llm: object
    model_names: tuple[str, ...]             # names a request's "model" may use; the first is reported
    api_key: str | None
    max_request_bytes: int
    shutdown_timeout: float
    sampling_params: type             # engine.SamplingParams
    admission: Admission = dataclasses.field(default_factory=lambda: Admission(1 << 30))
    hosts: HostCheck = dataclasses.field(default_factory=lambda: HostCheck("127.0.0.1", ["*"]))
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    draining: bool = False
    in_flight: int = 0
    responses_by_code: dict = dataclasses.field(default_factory=dict)
    registry: CollectorRegistry | None = None       # /metrics; made in __post_init__
    # Tokenization runs on one worker thread: the event loop must never run a long encode itself, and
    # one thread keeps the HF fast tokenizer away from concurrent use by this server.
    worker: ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize"))

    def __post_init__(self):
        if self.registry is None:
            self.registry = metrics_registry(self)

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
        if not state.hosts.allows(_header(scope, b"host")):
            self._count(400)
            return await _send_json(send, 400, error_body(
                "The Host header names a host this server does not serve (see --allowed-hosts).",
                code="invalid_host"), ((b"connection", b"close"),))
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
        if scope["method"] == "POST" and not _is_json(_header(scope, b"content-type")):
            # Also what keeps browsers out: a cross-site POST without a CORS preflight cannot be JSON.
            self._count(415)
            return await _send_json(send, 415, error_body(
                f"Unsupported Content-Type {_header(scope, b'content-type')!r}: send the body as "
                "application/json.", code="unsupported_media_type"), ((b"connection", b"close"),))
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
        value = _header(scope, b"authorization")
        if value is None:
            return False
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.state.api_key.encode())

    def _count(self, status: int):
        Gate.count(self.state, status)

    @staticmethod
    def count(state: ServerState, status: int):
        state.responses_by_code[status] = state.responses_by_code.get(status, 0) + 1


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";")[0].strip().lower() == "application/json"


# ---------------------------------------------------------------------------------------------------
# Request helpers.

async def read_body(request: Request, state: ServerState) -> bytes:
    """The body; 413 past --max-request-bytes, 408 if it does not arrive within --body-timeout. An
    oversized body is still read (up to 16x the limit, without keeping it) so the client sees the 413
    instead of a connection reset in the middle of its upload."""
    limit = state.max_request_bytes
    declared = request.headers.get("content-length")
    too_large = declared is not None and declared.isdigit() and int(declared) > limit
    chunks = []

    async def read():
        nonlocal too_large
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                too_large = True
                chunks.clear()
                if size > 16 * limit:
                    break
            elif not too_large:
                chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), state.body_timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {state.body_timeout:g}s.",
                       code="request_timeout", headers={"connection": "close"}) from None
    except ClientDisconnect:
        # The client went away mid-upload: nobody is left to read this, and it is no server error.
        raise APIError(400, "The client closed the connection before the request body was complete.",
                       code="incomplete_body") from None
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
        streams = await off_loop(admit)
        state.admission.streams += streams
        return streams
    except RuntimeError as exc:     # the engine stopped admitting (shutdown)
        raise APIError(503, str(exc), type="server_error", code="server_shutting_down") from None
    except ValueError as exc:
        err = engine_error(exc)
        if err.param == "prompt" and isinstance(req, ChatCompletionRequest):
            err.param = "messages"
        elif err.param in ("json_schema", "json_object"):      # SamplingParams' names for it
            err.param = "response_format"
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
    """Yield (choice index, chunk) from several engine streams as chunks arrive; raises the exception
    the engine failed a stream with."""
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
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer below
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
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


def engine_failure(exc: Exception) -> APIError:
    """A request the engine failed (an error inside the engine thread): a 500 that says so."""
    log.error("the engine failed a request: %s: %s", type(exc).__name__, exc)
    return APIError(500, f"The engine failed while running this request ({type(exc).__name__}: {exc}).",
                    type="server_error", code="engine_error")


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
    try:
        work.result()
    except Exception as exc:  # noqa: BLE001
        abort_unfinished(streams, choices)
        raise engine_failure(exc) from None
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
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

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
        # Off the event loop: the engine's collector waits for the engine thread's next step boundary.
        return Response(await off_loop(generate_latest, state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_request(ChatCompletionRequest, await read_body(request, state))
        check_model(state, req.model)
        with state.admission.reserve(req.n):
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

    async def stream_events(req, streams, choices, head, content, closing, logprobs, opening=None):
        """The server-sent events of a streaming completion, the same for both endpoints: `opening`
        (one frame's choices) first; then, per chunk, a frame with its text (`content(text)`: the
        endpoint's text field) and log-probabilities (`logprobs(i, chunk)`, after the chunk is added
        to its choice) and, when the choice ends, one with its finish reason (`closing`: the empty
        text field); the usage frame if asked; an error event where the engine fails; [DONE]."""
        include_usage = req.include_usage()

        def frame(choice_list):
            return sse({**head, "choices": choice_list, **({"usage": None} if include_usage else {})})

        if opening is not None:
            yield frame(opening)
        try:
            async for i, chunk in merge_streams(streams):
                choices[i].add(chunk)
                if chunk.finish_reason == "abort":
                    yield sse(SHUTDOWN_ABORT)
                    break
                lp = logprobs(i, chunk)
                if chunk.text or lp is not None:
                    yield frame([{"index": i, **content(chunk.text), "logprobs": lp, "finish_reason": None}])
                if chunk.finish_reason is not None:
                    yield frame([{"index": i, **closing, "logprobs": None,
                                  "finish_reason": _FINISH[chunk.finish_reason]}])
            else:
                if include_usage:
                    yield sse({**head, "choices": [], "usage": usage(choices, req.n)})
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            yield sse(engine_failure(exc).body())
        yield SSE_DONE

    def chat_events(req: ChatCompletionRequest, streams, choices, request_id):
        head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": state.model_name, "system_fingerprint": None}

        def logprobs(i, chunk):
            return chat_logprobs(chunk.logprobs, token_text) if req.logprobs and chunk.logprobs else None
        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(len(streams))]
        return stream_events(req, streams, choices, head, lambda text: {"delta": {"content": text}},
                             {"delta": {}}, logprobs, opening)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await read_body(request, state))
        check_model(state, req.model)
        with state.admission.reserve(len(req.prompts()) * req.n):
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
                             "logprobs": completion_logprobs(c.logprobs, token_text, TextOffsets(token_text),
                                                             len(c.text))
                             if req.logprobs is not None else None,
                             "finish_reason": _FINISH[c.finish_reason]} for i, c in enumerate(choices)],
                "usage": usage(choices, req.n)}

    def completion_events(req: CompletionRequest, streams, choices, request_id):
        offsets = [TextOffsets(token_text) for _ in streams]
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": state.model_name, "system_fingerprint": None}

        def logprobs(i, chunk):
            if req.logprobs is None or not chunk.logprobs:
                return None
            final_len = len(choices[i].text) if chunk.finish_reason is not None else None
            return completion_logprobs(chunk.logprobs, token_text, offsets[i], final_len)
        return stream_events(req, streams, choices, head, lambda text: {"text": text}, {"text": ""}, logprobs)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        req = parse_request(EmbeddingRequest, await read_body(request, state))
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
# /metrics through prometheus_client: the server's own counters, and the engine's metrics read from
# the engine thread at each scrape.

# engine.metrics() key -> (Prometheus name, help). Counters get "_total" from prometheus_client.
ENGINE_GAUGES = {
    "running": ("microengine_requests_running", "Requests in the engine's running batch."),
    "waiting": ("microengine_requests_waiting",
                "Requests queued in the engine for a place in the running batch (the queue depth)."),
    "kv_blocks_total": ("microengine_kv_cache_capacity_blocks", "KV-cache blocks in the pool."),
    "kv_blocks_used": ("microengine_kv_cache_used_blocks", "KV-cache blocks held by requests."),
    "kv_blocks_free": ("microengine_kv_cache_free_blocks", "KV-cache blocks free or evictable."),
    "graph_decode_batch_sizes": ("microengine_cuda_graph_decode_batch_sizes",
                                 "Decode batch sizes captured as CUDA graphs (0: decode runs eagerly)."),
    "graph_step_sizes": ("microengine_cuda_graph_step_sizes",
                         "Prefill and mixed step sizes captured as CUDA graph pieces (0: they run eagerly)."),
}
ENGINE_COUNTERS = {
    "requests_finished": ("microengine_requests_finished", "Requests finished (stop or length)."),
    "requests_aborted": ("microengine_requests_aborted", "Requests aborted (client gone, shutdown)."),
    "requests_failed": ("microengine_requests_failed", "Requests failed by an error in the engine."),
    "preemptions": ("microengine_preemptions", "Requests preempted and later recomputed."),
    "prefix_cache_queries": ("microengine_prefix_cache_queries", "Prompt blocks looked up in the prefix cache."),
    "prefix_cache_hits": ("microengine_prefix_cache_hits", "Prompt blocks found in the prefix cache."),
    "steps": ("microengine_engine_steps", "Engine steps run."),
    "step_tokens": ("microengine_engine_step_tokens", "Tokens computed by engine steps (prefill and decode)."),
    "host_seconds": ("microengine_engine_host_seconds",
                     "Host time of the engine steps, outside the waits for the device."),
}
ENGINE_HISTOGRAMS = {
    "ttft_seconds": ("microengine_time_to_first_token_seconds", "Time from arrival to the first output token."),
    "itl_seconds": ("microengine_inter_token_latency_seconds", "Time between consecutive output tokens."),
    "queue_seconds": ("microengine_request_queue_time_seconds",
                      "Time from arrival to joining the running batch."),
}


class EngineCollector:
    """The engine's metrics as Prometheus families; collect() blocks on the engine thread."""

    def __init__(self, llm):
        self.llm = llm

    def collect(self):
        m = self.llm.metrics()
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=m[key])
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=m[key])
        for key, (name, doc) in ENGINE_HISTOGRAMS.items():
            h = m[key]
            buckets = [(floatToGoString(le), n) for le, n in h["buckets"]] + [("+Inf", h["count"])]
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h["sum"])


class ServerCollector:
    """What the server counts itself: HTTP responses by status, in flight, and load shedding."""

    def __init__(self, state: ServerState):
        self.state = state

    def collect(self):
        state = self.state
        responses = CounterMetricFamily("microengine_http_responses", "HTTP responses sent, by status code.",
                                        labels=["code"])
        for code, n in sorted(dict(state.responses_by_code).items()):
            responses.add_metric([str(code)], n)
        yield responses
        yield GaugeMetricFamily("microengine_http_requests_in_flight", "HTTP requests being served.",
                                value=state.in_flight)
        yield CounterMetricFamily("microengine_requests_rejected",
                                  "Requests refused with 429 because the admission limit was reached.",
                                  value=state.admission.rejected)
        yield GaugeMetricFamily("microengine_admitted_requests",
                                "Engine requests admitted by the server and not done (running, queued "
                                "or being tokenized).", value=state.admission.count())
        yield GaugeMetricFamily("microengine_admission_limit_requests",
                                "Most engine requests admitted at once (--max-num-seqs + --max-queued-requests).",
                                value=state.admission.limit)


def metrics_registry(state: ServerState) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ServerCollector(state))
    if state.llm is not None:
        registry.register(EngineCollector(state.llm))
    ProcessCollector(registry=registry)
    return registry


# ---------------------------------------------------------------------------------------------------
# Connections: uvicorn's h11 protocol with a header timeout and a connection limit.

@dataclasses.dataclass
class ConnectionLimits:
    header_timeout: float            # seconds a connection has to send its request headers
    max_connections: int             # connections open at once; past it, 503 and close
    count_response: object = None    # called with the status of each response these guards send


def _raw_response(status: int, reason: str, body: dict) -> bytes:
    """A whole HTTP/1.1 response, for a connection that is closed right after (no h11 state kept)."""
    payload = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n"
            f"connection: close\r\n\r\n").encode() + payload


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, guarded against slow senders and connection floods:
    - a connection whose request headers are not complete within --header-timeout seconds of its
      first byte (or of opening) is answered 408 and closed: uvicorn itself times out only idle
      keep-alive connections, so half a request line held a connection forever;
    - a connection past --max-connections is answered 503 and closed at once.
    The body has its own timeout (--body-timeout, in read_body); h11 caps the headers at 16 KiB."""

    def connection_made(self, transport):
        super().connection_made(transport)
        self._limits: ConnectionLimits = self.config.connection_limits
        self._header_timer = None
        self._refused = False
        if len(self.connections) > self._limits.max_connections:
            # Answered before the request is read, then half-closed: closing outright with the
            # request unread would reset the connection and lose the answer. The client closes its
            # side once it has read it, or the header timeout closes ours.
            self._refuse(503, "Service Unavailable", error_body(
                "Too many open connections; retry later.", type="server_error", code="too_many_connections"),
                close=False)
            self.transport.write_eof()
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return          # a refused connection's request is read and dropped
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_header_timer()      # a request has begun but its headers are not all here
        else:
            self._cancel_header_timer()

    def connection_lost(self, exc):
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self):
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self._limits.header_timeout, self._on_header_timeout)

    def _cancel_header_timer(self):
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self):
        self._header_timer = None
        if self._refused:
            self.transport.close()
        elif self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._refuse(408, "Request Timeout", error_body(
                f"The request headers did not arrive within {self._limits.header_timeout:g}s.",
                code="request_timeout"))

    def _refuse(self, status: int, reason: str, body: dict, close: bool = True):
        self._refused = True
        self.transport.write(_raw_response(status, reason, body))
        if close:
            self.transport.close()
        if self._limits.count_response is not None:
            self._limits.count_response(status)


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
    "lm_head": "the LM head's weight format (default: the weight format's own where its measured top-1 "
               "agreement with a bf16 head is >= 0.97, else bf16; engine/config.py default_lm_head)",
    "fused_kernels": "fused Triton norm/RoPE/SwiGLU kernels; off: PyTorch references (attention "
                     "always uses its Triton kernels on cuda) (default: on)",
    "tensor_parallel_size": "shard the model over N GPUs, one process each, over NCCL; under torchrun "
                            "the ranks it started",
    "tune": "on: time the GEMM kernels for this model's shapes at start (cached in "
            "~/.cache/microengine); off: each op's default kernel",
    "tokenizer": "tokenizer directory for shape presets (default: the embedded model's, or "
                 "$MICROENGINE_TOKENIZER)",
    "kv_cache_tokens": "KV-cache size in tokens (default: --kv-cache-memory-fraction of free GPU memory)",
    "kv_cache_memory_fraction": "fraction of free GPU memory for the KV cache",
    "kv_cache_dtype": "auto: K/V in the model dtype; fp8: e4m3 with a scale per token and KV head, "
                      "twice the tokens in the same memory and half the KV bytes a decode step reads",
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
    from engine.config import KV_CACHE_DTYPES, LM_HEAD_FORMATS, SPARSE_METHODS, WEIGHT_FORMATS, EngineConfig
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
        elif f.name == "lm_head":
            group.add_argument(flag, choices=LM_HEAD_FORMATS, **kw)
        elif f.name == "kv_cache_dtype":
            group.add_argument(flag, choices=KV_CACHE_DTYPES, **kw)
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
    server.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS, metavar="N",
                        help="load shedding: requests (one per prompt and choice) that may wait for a place "
                             "in the running batch beyond --max-num-seqs; past it, 429 with Retry-After "
                             "(default: %(default)s)")
    server.add_argument("--allowed-hosts", action="append", default=[], metavar="NAME[,NAME...]",
                        help="Host header values accepted besides the bound address (and 'localhost' on "
                             "loopback); '*' accepts any; refuses DNS-rebinding requests (default: none)")
    server.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                        help="seconds a connection has to send its request headers; 408 and close after "
                             "(default: %(default)s)")
    server.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                        help="seconds a request has to send its whole body; 408 and close after "
                             "(default: %(default)s)")
    server.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                        help="open connections at once; past it, 503 and close (default: %(default)s)")
    server.add_argument("--access-log", action="store_true", help="log every request")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="(default: %(default)s)")
    engine_arguments(parser)
    allocator.add_arguments(parser)
    args = parser.parse_args(argv)
    args.allowed_hosts = [h.strip() for value in args.allowed_hosts for h in value.split(",") if h.strip()]
    if args.max_queued_requests < 0:
        parser.error("--max-queued-requests must be >= 0")
    if args.max_connections < 1:
        parser.error("--max-connections must be >= 1")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not value > 0:
            parser.error(f"{flag} must be a positive number of seconds")
    allocator.configure_from_args(args, parser)     # before CUDA starts; may restart the process
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
    host, port = sock.getsockname()[:2]
    state = ServerState(llm=llm, model_names=names, api_key=args.api_key,
                        max_request_bytes=args.max_request_bytes, shutdown_timeout=args.shutdown_timeout,
                        sampling_params=SamplingParams,
                        admission=Admission(llm.config.max_num_seqs + args.max_queued_requests),
                        hosts=HostCheck(host, [args.host, *args.allowed_hosts]), body_timeout=args.body_timeout)
    app = Gate(create_app(state), state)
    config = uvicorn.Config(app, loop="uvloop", lifespan="off", log_level=args.log_level, http=GuardedH11Protocol,
                            access_log=args.access_log, timeout_graceful_shutdown=5, timeout_keep_alive=30)
    config.connection_limits = ConnectionLimits(args.header_timeout, args.max_connections,
                                                lambda status: Gate.count(state, status))
    server = DrainingServer(config, state)
    shown = f"[{host}]" if ":" in host else host
    print(f"microengine: serving '{state.model_name}' (max_model_len {llm.max_model_len}) at "
          f"http://{shown}:{port}/v1  [chat/completions, completions, embeddings, models; /health, /metrics]"
          f"{'; API key required' if args.api_key else ''}", flush=True)
    uvloop.run(server.serve(sockets=[sock]))   # serve() (not run()) so the signal handling above is ours
    log.info("shut down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
