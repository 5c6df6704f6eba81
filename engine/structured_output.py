"""Constrained decoding: outputs that are JSON following a schema (SamplingParams.json_schema) or any
JSON object (json_object), through xgrammar.

A schema compiles once (cached) to a grammar over the tokenizer's vocabulary; each constrained request
gets a matcher that tracks its output. Before each sampling step the engine asks the matchers for a
packed bitmask of the tokens allowed next (engine.sampling.apply_token_bitmask masks the logits with
it), and each sampled token is fed back to its matcher. A matcher needs every earlier token, so the
engine serialises the steps of constrained requests, as it does for penalties.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import torch

from engine.sampling import SamplingParams

_ANY_OBJECT = '{"type": "object"}'
_CACHE_SIZE = 64                # compiled schemas kept: compiling takes milliseconds, a grammar memory
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")   # "[time] file.cc:123: " on xgrammar's errors


class Grammars:
    """Compiles and caches the grammars of one tokenizer; thread-safe (compile runs on the caller's
    thread, so a bad schema is refused there; matchers are made on the engine thread)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        try:
            import xgrammar
        except ImportError:
            raise ValueError("json_schema: constrained decoding needs the xgrammar package "
                             "(pip install xgrammar)") from None
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.words = (vocab_size + 31) // 32       # int32 words per bitmask row
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, bool], object] = OrderedDict()

    def compile(self, params: SamplingParams):
        """The compiled grammar of a constrained request; ValueError naming json_schema if the schema
        cannot be compiled."""
        if params.json_schema is None:
            key = (_ANY_OBJECT, False)
        else:
            schema = params.json_schema
            if isinstance(schema, str):
                schema = json.loads(schema)
            key = (json.dumps(schema), True)     # key order kept: properties are generated in it
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
            try:
                # strict_mode: no properties beyond those the schema lists (OpenAI's strict schemas);
                # for json_object every object is allowed.
                grammar = self.compiler.compile_json_schema(key[0], strict_mode=key[1])
            except (RuntimeError, ValueError, TypeError) as e:
                message = _CPP_PREFIX.sub("", str(e)).strip()
                raise ValueError(f"json_schema: this schema is not supported: {message}") from None
            self._cache[key] = grammar
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return grammar

    def matcher(self, params: SamplingParams):
        return self.xgr.GrammarMatcher(self.compile(params))

    def bitmask(self, matchers: list) -> torch.Tensor:
        """[len(matchers), words] int32: the tokens each row may take next (all, for a None row)."""
        mask = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        for row, m in enumerate(matchers):
            if m is not None:
                m.fill_next_token_bitmask(mask, row)
        return mask
