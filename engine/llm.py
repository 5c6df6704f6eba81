"""LLM: the public, embeddable API. generate(), chat(), stream() (sync and async), embed().

The engine runs on one background thread that owns the model and the GPU; callers on any thread (or
asyncio loop) hand it requests through a queue and get tokens back through their RequestStream.
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.engine import Engine, StreamChunk
from engine.kernels.norms import l2_norm
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


class RequestStream:
    """The tokens of one request as they come: `for chunk in stream` or `async for chunk in stream`."""

    def __init__(self, llm: "LLM", request_id: str, prompt_ids: list[int]):
        self.llm, self.request_id, self.prompt_ids = llm, request_id, prompt_ids
        self._lock = threading.Lock()
        self._buffer: deque[StreamChunk] = deque()
        self._ready = threading.Condition(self._lock)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aqueue: asyncio.Queue | None = None
        self.finished = False

    def _put(self, chunk: StreamChunk) -> None:       # called on the engine thread
        with self._lock:
            if self._aqueue is not None:
                self._loop.call_soon_threadsafe(self._aqueue.put_nowait, chunk)
            else:
                self._buffer.append(chunk)
                self._ready.notify()

    def __iter__(self):
        while True:
            with self._lock:
                while not self._buffer:
                    self._ready.wait()
                chunk = self._buffer.popleft()
            yield chunk
            if chunk.finish_reason is not None:
                self.finished = True
                return

    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._aqueue = asyncio.Queue()
            while self._buffer:
                self._aqueue.put_nowait(self._buffer.popleft())
        try:
            while True:
                chunk = await self._aqueue.get()
                yield chunk
                if chunk.finish_reason is not None:
                    self.finished = True
                    return
        finally:
            if not self.finished:       # the consumer went away (client disconnect, cancel)
                self.abort()

    def abort(self) -> None:
        self.llm.abort(self.request_id)

    def result(self) -> RequestOutput:
        """Wait for the whole output (sync)."""
        ids, text, lps, reason = [], [], [], None
        for chunk in self:
            ids += chunk.token_ids
            text.append(chunk.text)
            if chunk.logprobs:
                lps += chunk.logprobs
            reason = chunk.finish_reason
        return RequestOutput(self.request_id, self.prompt_ids, ids, "".join(text), reason, lps or None)


class LLM:
    def __init__(self, model: str = "llama", device=None, dtype=None, config: EngineConfig | None = None,
                 **config_fields):
        if config is None:
            config = EngineConfig(model=model, device=device, dtype=dtype, **config_fields)
        self.config = config
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
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
            self._thread.join(timeout=10)

    # ---------------------------------------------------------------- the engine thread

    def _run(self):
        engine = self.engine
        while not self._stopped:
            while True:
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    break
                try:
                    command()
                except Exception:  # noqa: BLE001 - a bad command must not stop the engine
                    log.exception("engine command failed")
            if engine.has_work():
                try:
                    engine.step()
                except Exception:  # noqa: BLE001
                    # A failed step (out of memory, a kernel error) ends the requests it held,
                    # with finish_reason "abort", and the engine keeps serving the rest.
                    log.exception("engine step failed; aborting the requests in flight")
                    for rid in list(engine.requests):
                        engine.abort(rid)
            else:
                self._wake.wait(0.05)
                self._wake.clear()

    def _call(self, fn):
        """Run fn on the engine thread (between steps) and return its result."""
        if self._stopped:
            raise RuntimeError("the engine has shut down")
        fut: Future = Future()

        def command():
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                fut.set_exception(e)

        self._inbox.put(command)
        self._wake.set()
        return fut.result()

    # ---------------------------------------------------------------- prompts

    def encode_prompt(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt: must be a non-empty string")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not isinstance(messages, list) or not messages:
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
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError("prompt: must be a non-empty string or a non-empty list of token ids")

    # ---------------------------------------------------------------- requests

    def stream(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> RequestStream:
        if not self._accepting:
            raise RuntimeError("the engine is shutting down and accepts no new requests")
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt)
        rid = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, rid, ids)
        # Refusals come from static limits, so they are raised here, on the caller's thread; the
        # request itself joins the engine at its next step boundary without the caller waiting.
        self.engine.validate(ids, params)
        self._inbox.put(lambda: self.engine.add_request(rid, ids, params, stream._put))
        self._wake.set()
        return stream

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("params: one SamplingParams, or one per prompt")
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
        return [s.result() for s in streams]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.encode_chat(messages)], params)[0]

    def abort(self, request_id: str) -> None:
        self._inbox.put(lambda: self.engine.abort(request_id))
        self._wake.set()

    # ---------------------------------------------------------------- whole-sequence passes

    def embed(self, texts: list[str]) -> torch.Tensor:
        """Mean-pooled final hidden state of each text, L2-normalised: [n, hidden] fp32."""
        ids = [self.encode_prompt(t) for t in texts]
        hidden = self._call(lambda: self.engine.hidden_states(ids))
        return torch.stack([l2_norm(h.float().mean(0)) for h in hidden]).cpu()

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence: [len, vocab] fp32 (for scoring, perplexity)."""
        def run():
            hidden = self.engine.hidden_states([list(token_ids)])[0]
            return self.engine.model.compute_logits(hidden)
        return self._call(run).cpu()

    def metrics(self) -> dict:
        return self._call(self.engine.metrics)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting; let in-flight requests finish for up to `timeout` seconds, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._call(self.engine.has_work) and time.monotonic() < deadline:
            time.sleep(0.05)

        def abort_all():
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
        self._call(abort_all)
        LLM._stop_thread(weakref.ref(self))
