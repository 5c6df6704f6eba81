"""The OpenAI API for serve.py: request models and their validation, and the pieces of responses
(choices, usage, logprobs, SSE frames). serve.py does the HTTP and drives the engine.

Every request is parsed from raw bytes by pydantic in strict mode with unknown fields forbidden, so a
parameter this server does not implement (tools, logit_bias, echo, ...) is refused with a 400 that names
it instead of being silently ignored. Errors carry OpenAI's body:
{"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import codecs
import functools
import json
import math
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_N = 16                  # choices per request: each one is a separate engine request
MAX_STOP_SEQUENCES = 4      # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_EMBEDDING_INPUTS = 2048
_INT64_MAX = 2**63 - 1


class APIError(Exception):
    """An error answered with OpenAI's error body and the given HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    """Strict JSON types (no "1" for 1, no 1.0 for an int), no unknown fields, no NaN/inf.

    A key whose value is null means "not given" (the spec allows null for most parameters, and many
    clients send every key): it is dropped before validation, so the parameter takes its default (a
    required one is then missing), unless the field itself accepts null. Unknown keys set to null are
    dropped too rather than refused.
    """
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            keep = _nullable_keys(cls)
            return {k: v for k, v in data.items() if v is not None or k in keep}
        return data


@functools.cache
def _nullable_keys(cls: type[BaseModel]) -> frozenset[str]:
    """The JSON keys (aliases included) whose field accepts null as a value of its own."""
    keys = set()
    for name, info in cls.model_fields.items():
        annotation = info.annotation
        if annotation is type(None) or type(None) in typing.get_args(annotation):
            keys |= {name, info.alias or name}
    return frozenset(keys)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None          # a participant's name; passed to the chat template, which may use it

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


StopField = str | list[str] | None


class JSONSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """text (free), json_object (any JSON object) or json_schema (JSON following the schema); the
    last two through constrained decoding (engine/structured_output.py)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_format(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise _field_error("response_format.json_schema", "required when type is 'json_schema'")
        if self.type != "json_schema" and self.json_schema is not None:
            raise _field_error("response_format.json_schema", "only allowed when type is 'json_schema'")
        return self

    def sampling_kwargs(self) -> dict:
        if self.type == "json_schema" and self.json_schema.schema_ is not None:
            return {"json_schema": self.json_schema.schema_}
        if self.type == "text":
            return {}
        return {"json_object": True}        # json_object, or a json_schema without a schema


class _SamplingRequest(_Strict):
    """The sampling parameters common to chat and text completions."""
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)                 # extension (vLLM's): 0 or -1 = off
    seed: int | None = Field(None, ge=-(2**63), le=_INT64_MAX - MAX_N)
    stop: StopField = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    ignore_eos: bool = False                     # extension (vLLM's): fixed-length outputs for benchmarks
    user: str | None = None                      # accepted for API compatibility; only logged
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_common(self):
        if isinstance(self.stop, list):
            if len(self.stop) > MAX_STOP_SEQUENCES:
                raise _field_error("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
            stops = self.stop
        else:
            stops = [] if self.stop is None else [self.stop]
        for s in stops:
            if not s:
                raise _field_error("stop", "stop sequences must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise _field_error("stop", f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        if self.stream_options is not None and not self.stream:
            raise _field_error("stream_options", "only allowed when stream is true")
        return self

    def stop_list(self) -> list[str] | None:
        if self.stop is None or self.stop == []:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_kwargs(self, choice_index: int) -> dict:
        """SamplingParams keyword arguments for the engine request of one choice (seed + index)."""
        return dict(
            max_tokens=self.output_limit(), temperature=self.temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0), seed=None if self.seed is None else self.seed + choice_index,
            stop=self.stop_list(), ignore_eos=self.ignore_eos, logprobs=self.engine_logprobs(),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            **(self.response_format.sampling_kwargs() if self.response_format is not None else {}))

    def output_limit(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise _field_error("top_logprobs", "requires logprobs to be true")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise _field_error("max_tokens", "max_tokens and max_completion_tokens disagree; give one")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict]:
        # "developer" is OpenAI's newer name for the system role; chat templates know only "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                 **({"name": m.name} if m.name is not None else {})} for m in self.messages]


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)     # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_prompt(self):
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise _field_error("prompt", "must not be an empty list")
            if isinstance(self.prompt[0], list) and any(not p for p in self.prompt):
                raise _field_error("prompt", "token-id prompts must not be empty")
        return self

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string, a token-id list, or a list of either."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)


class EmbeddingRequest(_Strict):
    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None

    @model_validator(mode="after")
    def _check_input(self):
        texts = self.texts()
        if not texts:
            raise _field_error("input", "must not be an empty list")
        if len(texts) > MAX_EMBEDDING_INPUTS:
            raise _field_error("input", f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        if any(not t for t in texts):
            raise _field_error("input", "inputs must not be empty strings")
        return self

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class _FieldError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _field_error(param: str, message: str) -> _FieldError:
    return _FieldError(param, message)


def parse_request(model_cls: type[_Strict], raw: bytes):
    """Validate a JSON body into `model_cls`; raise APIError(400) that names the offending parameter."""
    if not raw.strip():
        raise APIError(400, "The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        return model_cls.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False)) from None


# Union members show up in pydantic's error locations as type tags ("str", "list[int]", ...).
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "ChatMessage", "TextPart",
              "StreamOptions", "ResponseFormat", "JSONSchemaFormat"}


def _param_name(loc: tuple) -> str | None:
    parts: list[str] = []
    for seg in loc:
        if isinstance(seg, int):
            parts.append(f"[{seg}]")
        elif seg in _TYPE_TAGS or "[" in seg or seg.startswith("function-"):
            continue
        else:
            parts.append(("." if parts else "") + seg)
    return "".join(parts) or None


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic/FastAPI validation error, as OpenAI's 400 error."""
    if not errors:
        return APIError(400, "Invalid request.")
    # A union (e.g. content: str | list[TextPart]) fails once per member; the deepest location is the
    # most specific message ("messages[0].content[0].type" rather than "messages[0].content").
    head = errors[0].get("loc", ())[:1]
    err = max((e for e in errors if e.get("loc", ())[:1] == head), key=lambda e: len(e.get("loc", ())))
    kind = err.get("type", "")
    loc = tuple(s for s in err.get("loc", ()) if s != "body")
    param = _param_name(loc)
    ctx_error = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_error, _FieldError):
        return APIError(400, f"{ctx_error.param}: {ctx_error}", param=ctx_error.param, code="invalid_value")
    if kind == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request ({err.get('msg')}).",
                        code="invalid_json")
    if kind == "model_type" and param is None:
        return APIError(400, "The request body must be a JSON object.", code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"Unsupported parameter: '{param}' is not supported by this server.",
                        param=param, code="unsupported_parameter")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param,
                        code="missing_required_parameter")
    is_range = kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal",
                        "too_short", "too_long", "literal_error", "finite_number")
    given = err.get("input")
    shown = repr(given) if isinstance(given, (int, float, str, bool)) and len(repr(given)) < 80 \
        else type(given).__name__
    return APIError(400, f"Invalid value for '{param}': {err.get('msg')} (got {shown}).", param=param,
                    code="invalid_value" if is_range else "invalid_type")


# ---------------------------------------------------------------------------------------------------
# Responses.

class Choice:
    """What has come back for one choice so far (text kept as parts: += on a long output is quadratic)."""
    __slots__ = ("parts", "completion_tokens", "prompt_tokens", "cached_tokens", "finish_reason", "logprobs")

    def __init__(self):
        self.parts, self.completion_tokens, self.prompt_tokens, self.cached_tokens = [], 0, 0, 0
        self.finish_reason, self.logprobs = None, []

    def add(self, chunk):
        if chunk.text:
            self.parts.append(chunk.text)
        self.completion_tokens, self.prompt_tokens = chunk.completion_tokens, chunk.prompt_tokens
        self.cached_tokens = chunk.cached_tokens
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.parts)


def usage(choices: list[Choice], n: int) -> dict:
    # The prompt is counted once per prompt, not once per choice (OpenAI's convention for n > 1), and
    # so are its tokens served from the prefix cache (those of the choice that counts it).
    prompt = sum(c.prompt_tokens for c in choices[::n])
    cached = sum(c.cached_tokens for c in choices[::n])
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class TokenText:
    """Token id -> its bytes and its text, for logprobs. A byte-level token may hold part of a UTF-8
    character: its bytes are the real ones, and its text is OpenAI's "bytes:\\xNN..." form."""

    def __init__(self, tokenizer):
        self._table = token_bytes_table(tokenizer)      # once, at startup: it reads the whole vocabulary
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))

    def bytes(self, token_id: int) -> bytes:
        return self._table[token_id] if 0 <= token_id < len(self._table) else b""

    def text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def special(self, token_id: int) -> bool:
        """Special tokens (end of text, ...) are left out of the output text."""
        return token_id in self._special


def token_bytes_table(tokenizer) -> list[bytes]:
    """The bytes each token stands for. Byte-level BPE (GPT-2, Llama 3, SmolLM) maps each byte to a
    printable character; SentencePiece-style vocabularies write bytes as <0xNN> and spaces as U+2581;
    for any other tokenizer a token's own decoded text is the best there is."""
    n = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    added = {i: content for content, i in tokenizer.get_added_vocab().items()}
    kinds = _decoder_kinds(tokenizer)
    table = []
    for i, piece in enumerate(pieces):
        if i in added or piece is None:
            table.append((added.get(i) or "").encode())
        elif "ByteLevel" in kinds:
            decoder = _byte_decoder()
            try:
                table.append(bytes(decoder[c] for c in piece))
            except KeyError:
                table.append(piece.encode())
        elif "ByteFallback" in kinds and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            table.append(bytes([int(piece[3:5], 16)]))
        elif "ByteFallback" in kinds or "Metaspace" in kinds:
            table.append(piece.replace("\u2581", " ").encode())
        else:
            table.append(tokenizer.decode([i]).encode())
    return table


def _decoder_kinds(tokenizer) -> set[str]:
    """The types in a fast tokenizer's decoder ("ByteLevel", "ByteFallback", ...); empty if unknown."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return set()
    kinds, todo = set(), [decoder]
    while todo:
        d = todo.pop()
        kinds.add(d.get("type"))
        todo += d.get("decoders") or []
    return kinds


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def chat_logprobs(items, token_text: TokenText) -> dict:
    def entry(tid, lp):
        return {"token": token_text.text(tid), "logprob": _finite(lp), "bytes": list(token_text.bytes(tid))}
    return {"content": [{**entry(it.token_id, it.logprob), "top_logprobs": [entry(t, l) for t, l in it.top]}
                        for it in items]}


class TextOffsets:
    """Where each token of one completion starts in its text, in characters. The tokens' bytes are
    decoded incrementally as the text is, so a token that carries part of a character starts where
    that character does, and special tokens (left out of the text) take no room."""

    def __init__(self, token_text: TokenText):
        self.token_text = token_text
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def take(self, token_id: int) -> int:
        start = self.chars
        if not self.token_text.special(token_id):
            self.chars += len(self.decoder.decode(self.token_text.bytes(token_id)))
        return start


def completion_logprobs(items, token_text: TokenText, offsets: TextOffsets, text_len: int | None = None) -> dict:
    """`text_len`: the length of the final text, once known; a stop string cuts the text inside the
    last tokens, and no offset may point past its end."""
    starts = [offsets.take(it.token_id) for it in items]
    if text_len is not None:
        starts = [min(s, text_len) for s in starts]
    return {"tokens": [token_text.text(it.token_id) for it in items],
            "token_logprobs": [_finite(it.logprob) for it in items],
            "top_logprobs": [{token_text.text(t): _finite(l) for t, l in it.top} for it in items],
            "text_offset": starts}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0    # JSON has no -inf


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
