"""LLM: the public, embeddable API. generate(), chat(), stream() (sync and async), embed().

The engine runs on one background thread that owns the model and the GPU; callers on any thread (or
asyncio loop) hand it requests through a queue and get tokens back through their RequestStream. An
error on that thread fails the requests it concerns with that exception; no caller waits forever.
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.engine import WORKERS_EXIT_S, Engine
from engine.kernels.norms import l2_norm
from engine.parallel import serve_steps
from engine.sampling import SamplingParams, TokenLogprob
from engine.scheduler import ContextLengthError  # noqa: F401  (re-exported)

log = logging.getLogger("microengine")


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0      # prompt tokens whose KV came from the prefix cache, not computed


class _Failure:
    """Put in a stream in place of a chunk: the engine failed the request with this exception."""
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class _Mailbox:
    """Chunks bound for the streams consumed on one event loop. The engine thread posts a step's
    chunks one by one and wakes the loop only when the mailbox was empty: one call_soon_threadsafe
    (a write to the loop's self-pipe, and a wake-up of its thread) per batch, not per token. At a few
    hundred streams a step, per-token wake-ups cost the engine thread a system call each and wake the
    loop's thread to contend with it for the interpreter lock through the step."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list = []      # (asyncio.Queue, chunk) in the order posted

    def post(self, queue: asyncio.Queue, item) -> None:    # on the engine thread
        with self._lock:
            wake = not self._items
            self._items.append((queue, item))
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:    # the loop is closed: no one is left to read these streams
                with self._lock:
                    self._items.clear()

    def _deliver(self) -> None:                             # on the loop
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


class RequestStream:
    """The tokens of one request as they come: `for chunk in stream` or `async for chunk in stream`.
    If the engine fails the request, iterating raises the exception it failed with."""

    def __init__(self, llm: "LLM", request_id: str, prompt_ids: list[int]):
        self.llm, self.request_id, self.prompt_ids = llm, request_id, prompt_ids
        self._lock = threading.Lock()
        self._buffer: deque = deque()
        self._ready = threading.Condition(self._lock)
        self._mailbox: _Mailbox | None = None    # set when an async consumer starts
        self._aqueue: asyncio.Queue | None = None
        self.finished = False       # the consumer has seen the last chunk
        self.done = False           # the engine is done with it: last chunk or failure delivered

    def _put(self, item) -> None:       # a StreamChunk or a _Failure; called on the engine thread
        with self._lock:
            if self.done:
                return
            self.done = isinstance(item, _Failure) or item.finish_reason is not None
            if self._mailbox is not None:
                self._mailbox.post(self._aqueue, item)
            else:
                self._buffer.append(item)
                self._ready.notify()

    def _fail(self, exc: BaseException) -> None:
        self._put(_Failure(exc))

    def _end(self, item) -> bool:
        """Whether `item` ends the stream; raises the engine's exception for a failure."""
        if isinstance(item, _Failure):
            self.finished = True
            raise item.exc
        if item.finish_reason is not None:
            self.finished = True
            return True
        return False

    def __iter__(self):
        while True:
            with self._lock:
                while not self._buffer:
                    self._ready.wait()
                item = self._buffer.popleft()
            if isinstance(item, _Failure):
                self._end(item)
            yield item
            if self._end(item):
                return

    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        with self._lock:
            self._mailbox = self.llm._mailbox(asyncio.get_running_loop())
            self._aqueue = asyncio.Queue()
            while self._buffer:
                self._aqueue.put_nowait(self._buffer.popleft())
        try:
            while True:
                item = await self._aqueue.get()
                if isinstance(item, _Failure):
                    self._end(item)
                yield item
                if self._end(item):
                    return
        finally:
            if not self.finished:       # the consumer went away (client disconnect, cancel)
                self.abort()

    def abort(self) -> None:
        self.llm.abort(self.request_id)

    def result(self) -> RequestOutput:
        """Wait for the whole output (sync)."""
        ids, text, lps, reason, cached = [], [], [], None, 0
        for chunk in self:
            ids += chunk.token_ids
            text.append(chunk.text)
            if chunk.logprobs:
                lps += chunk.logprobs
            reason, cached = chunk.finish_reason, chunk.cached_tokens
        return RequestOutput(self.request_id, self.prompt_ids, ids, "".join(text), reason, lps or None, cached)


class LLM:
    """The engine on a background thread. Every call fails rather than waits forever: a request
    that the engine thread cannot add, or whose step raises, fails with that exception (raised from
    its stream, generate() or chat()), and if the thread itself stops, everything still pending
    fails with a RuntimeError."""

    def __init__(self, model: str = "llama", device=None, dtype=None, config: EngineConfig | None = None,
                 **config_fields):
        if config is None:
            config = EngineConfig(model=model, device=device, dtype=dtype, **config_fields)
        self.config = config
        self.engine = Engine(config)
        if self.engine.tp is not None and self.engine.tp.rank != 0:
            # Under torchrun every rank runs the caller's program: ranks > 0 serve rank 0's steps here
            # and leave when it stops; the program's code after this line runs on rank 0 only.
            try:
                serve_steps(self.engine)
            finally:
                self.engine.close()
            raise SystemExit(0)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self._ids = itertools.count()
        # Commands for the engine thread: (run, fail) pairs; `fail(exc)` is called instead of `run()`
        # if the thread stops first. The lock orders queueing against the thread's final drain.
        self._lock = threading.Lock()
        self._inbox: deque[tuple] = deque()
        self._streams: dict[str, RequestStream] = {}     # requests the engine has not finished
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}
        self._closed: BaseException | None = None        # why the engine thread stopped
        self._wake = threading.Event()
        self._accepting = True
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="microengine", daemon=True)
        self._thread.start()
        # Stop the engine thread before the interpreter tears torch down under it.
        atexit.register(LLM._stop_thread, weakref.ref(self))

    @staticmethod
    def _stop_thread(ref) -> None:
        self = ref()
        if self is not None and not self._stopped:
            self._stopped = True
            self._wake.set()
            # The thread's last act is Engine.close(), which waits up to WORKERS_EXIT_S for the other
            # ranks to exit (then kills them) and as long again for rank 0 to leave the group:
            # shutdown returns once they are gone.
            self._thread.join(timeout=2 * WORKERS_EXIT_S + 20)

    # ---------------------------------------------------------------- the engine thread

    def _run(self):
        engine = self.engine
        error: BaseException | None = None
        try:
            while not self._stopped:
                while True:
                    with self._lock:
                        if not self._inbox:
                            break
                        run, fail = self._inbox.popleft()
                    try:
                        run()
                    except Exception as exc:  # noqa: BLE001 - fails the command's caller, not the engine
                        fail(exc)
                if engine.has_work():
                    try:
                        engine.step()
                    except Exception as exc:  # noqa: BLE001
                        if engine.tp is not None:
                            # A rank whose step failed may have left the others inside a collective:
                            # the ranks are out of step, so the engine stops and fails every caller.
                            raise
                        # A failed step (out of memory, a kernel error) fails the requests it held
                        # with its exception; the engine goes on serving the rest.
                        log.exception("engine step failed; failing the requests it held")
                        for rid in engine.fail_running():
                            self._fail_request(rid, exc)
                else:
                    engine.idle()
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - reported to every caller below
            log.exception("the engine thread stopped")
            error = exc
        finally:
            self._close(error)
            engine.close()

    def _close(self, error: BaseException | None) -> None:
        """The engine thread is ending: fail the commands it will never run and the requests it will
        never finish."""
        reason = RuntimeError("the engine has shut down" if error is None else
                              f"the engine thread stopped: {type(error).__name__}: {error}")
        if error is not None:
            reason.__cause__ = error
        with self._lock:
            self._closed = reason
            commands, self._inbox = list(self._inbox), deque()
            streams, self._streams = list(self._streams.values()), {}
        for _, fail in commands:
            fail(reason)
        for stream in streams:
            stream._fail(reason)

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        """The mailbox of the streams consumed on `loop` (those of closed loops are dropped)."""
        with self._lock:
            box = self._mailboxes.get(loop)
            if box is None:
                for closed in [lp for lp in self._mailboxes if lp.is_closed()]:
                    del self._mailboxes[closed]
                box = self._mailboxes[loop] = _Mailbox(loop)
        return box

    def _fail_request(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._fail(exc)

    def _submit(self, run, fail) -> None:
        """Queue `run` for the engine thread; `fail(exc)` is called instead if it never runs."""
        with self._lock:
            closed = self._closed
            if closed is None:
                self._inbox.append((run, fail))
        if closed is not None:
            fail(closed)
        self._wake.set()

    def _call(self, fn):
        """Run fn on the engine thread (between steps) and return its result."""
        if self._stopped:
            raise RuntimeError("the engine has shut down")
        fut: Future = Future()

        def run():
            fut.set_result(fn())

        self._submit(run, fut.set_exception)
        return fut.result()

    # ---------------------------------------------------------------- prompts

    def encode_prompt(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt: must be a string (got {type(prompt).__name__})")
        if not prompt:
            raise ValueError("prompt: must be a non-empty string")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not isinstance(messages, list):
            raise TypeError(f"messages: must be a list of {{'role', 'content'}} dicts "
                            f"(got {type(messages).__name__})")
        if not messages:
            raise ValueError("messages: must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), str):
                raise ValueError("messages: each message needs a role (system, user or assistant) and "
                                 "string content")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode_prompt(prompt)
        if isinstance(prompt, (list, tuple)) and all(_is_token_id(t) for t in prompt):
            if not prompt:
                raise ValueError("prompt: must be a non-empty string or a non-empty list of token ids")
            return list(prompt)
        raise TypeError(f"prompt: must be a string or a list of token ids (got {_describe(prompt)})")

    # ---------------------------------------------------------------- requests

    def stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> RequestStream:
        if not self._accepting:
            raise RuntimeError("the engine is shutting down and accepts no new requests")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: must be a SamplingParams (got {type(params).__name__})")
        ids = self._prompt_ids(prompt)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id: must be a string (got {type(request_id).__name__})")
        rid = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, rid, ids)
        # Refusals come from static limits, so they are raised here, on the caller's thread; the
        # request itself joins the engine at its next step boundary without the caller waiting.
        self.engine.validate(ids, params)
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request_id: {rid!r} is already running")
            self._streams[rid] = stream

        def sink(chunk):               # on the engine thread
            if chunk.finish_reason is not None:
                with self._lock:
                    self._streams.pop(rid, None)
            stream._put(chunk)

        self._submit(lambda: self.engine.add_request(rid, ids, params, sink),
                     lambda exc: self._fail_request(rid, exc))
        return stream

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either; params: one SamplingParams
        for all, or one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(_is_token_id(t) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts: must be a string, a list of token ids, or a list of those "
                            f"(got {_describe(prompts)})")
        if isinstance(params, (list, tuple)):
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"params: one SamplingParams, or one per prompt ({len(prompts)}); "
                                 f"got a list of {len(params_list)}")
        else:
            params_list = [SamplingParams() if params is None else params] * len(prompts)
        for p in params_list:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params: must be a SamplingParams or a list of them (got {_describe(params)})")
        # Validate every prompt before queueing any, so a bad one does not leave others running.
        ids = [self._prompt_ids(p) for p in prompts]
        streams = []
        try:
            for toks, p in zip(ids, params_list):
                streams.append(self.stream(toks, p))
        except Exception:
            for s in streams:
                s.abort()
            raise
        try:
            return [s.result() for s in streams]
        except BaseException:       # one failed (or the caller was interrupted): stop the others
            for s in streams:
                s.abort()
            raise

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.encode_chat(messages)], params)[0]

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self.engine.abort(request_id), lambda exc: None)

    # ---------------------------------------------------------------- whole-sequence passes

    def embed(self, texts: str | list[str]) -> torch.Tensor:
        """Mean-pooled final hidden state of each text, L2-normalised: [n, hidden] fp32. A string is
        one text (n = 1)."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise TypeError(f"texts: must be a string or a list of strings (got {_describe(texts)})")
        if not texts or not all(texts):
            raise ValueError("texts: must be a non-empty string or a non-empty list of non-empty strings")
        ids = [self.encode_prompt(t) for t in texts]
        hidden = self._call(lambda: self.engine.hidden_states(ids))
        fused = self.engine.config.fused_kernels is not False   # this engine's switch, not the process's
        return torch.stack([l2_norm(h.float().mean(0), fused=fused) for h in hidden]).cpu()

    def logits(self, token_ids: list[int], cache_chunk: int | None = None) -> torch.Tensor:
        """Logits at every position of one sequence: [len, vocab] fp32 (for scoring, perplexity).
        cache_chunk: computed as serving computes them, through the paged KV cache this many tokens a
        step, each step reading the prefix as the cache stores it (an FP8 KV cache's effect); None:
        one pass that keeps no cache."""
        if not isinstance(token_ids, (list, tuple)) or not all(_is_token_id(t) for t in token_ids):
            raise TypeError(f"token_ids: must be a list of token ids (got {_describe(token_ids)})")
        if cache_chunk is not None and (not isinstance(cache_chunk, int) or isinstance(cache_chunk, bool)):
            raise TypeError(f"cache_chunk: must be an int or None (got {_describe(cache_chunk)})")
        if cache_chunk is None:
            return self._call(lambda: self.engine.sequence_logits(token_ids)).cpu()
        return self._call(lambda: self.engine.cached_logits(list(token_ids), cache_chunk)).cpu()

    def metrics(self) -> dict:
        return self._call(self.engine.metrics)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting; let in-flight requests finish for up to `timeout` seconds, abort the rest."""
        self._accepting = False

        def abort_all():
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
        try:
            deadline = time.monotonic() + timeout
            while self._call(self.engine.has_work) and time.monotonic() < deadline:
                time.sleep(0.05)
            self._call(abort_all)
        except RuntimeError:
            if self._closed is None:
                raise
            # The engine thread had already stopped and failed everything pending: nothing to drain.
        LLM._stop_thread(weakref.ref(self))


def _is_token_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _describe(x) -> str:
    """A short description of a bad argument for an error message."""
    if isinstance(x, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in x})
        return f"a {type(x).__name__} of {', '.join(kinds)}" if kinds else f"an empty {type(x).__name__}"
    return type(x).__name__
