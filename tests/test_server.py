"""serve.py end to end: the real server in a subprocess on 127.0.0.1 (the embedded SmolLM2 model on the
CPU), driven by the official openai client and, for the malformed cases, by raw HTTP.

Two servers per module, started in parallel with the in-process reference LLM: the main one, and one
with --api-key that the SIGTERM test shuts down at the end.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from serving import MAX_MODEL_LEN, MODEL, ROOT, Server, client, metrics

from engine import LLM, SamplingParams

API_KEY = "test-key-3f9a"
GREEDY = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def servers():
    # The third is test_sigterm_drains_and_exits_zero's own: it ends that server, so no other test
    # may depend on it (they load at once, so it costs no extra wait).
    started = (Server(), Server("--api-key", API_KEY), Server("--api-key", API_KEY, "--shutdown-timeout", "3"))
    try:
        yield started
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def reference(servers):
    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_tokens=8192)   # loads while the servers do
    for s in servers:
        s.wait_healthy()
    yield llm
    llm.shutdown(5)


@pytest.fixture(scope="module")
def server(servers, reference):
    return servers[0]


@pytest.fixture(scope="module")
def keyed_server(servers, reference):
    return servers[1]


@pytest.fixture(scope="module")
def draining_server(servers, reference):
    return servers[2]


# ---------------------------------------------------------------------------------------------------

COMPLETION_PROMPT = "The three primary colors are"
CHAT = [{"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the capital of Italy?"}]


def test_completion_matches_generate(server, reference):
    ref = reference.generate([COMPLETION_PROMPT], SamplingParams(**GREEDY))[0]
    c = client(server)
    out = c.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, **GREEDY)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)

    text, finish, usage = "", None, None
    for chunk in c.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, stream=True,
                                      stream_options={"include_usage": True}, **GREEDY):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    assert (text, finish) == (ref.text, ref.finish_reason)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))


def test_each_token_streams_in_its_own_event(server, reference):
    """Nothing between the engine and the client gathers tokens: a streamed completion arrives as one
    event per engine chunk, each chunk one token (every token of this completion adds text)."""
    chunks = list(reference.stream(COMPLETION_PROMPT, SamplingParams(**GREEDY)))
    assert all(len(c.token_ids) == 1 and c.text for c in chunks)
    texts, usage = [], None
    for event in client(server).completions.create(model=MODEL, prompt=COMPLETION_PROMPT, stream=True,
                                                   stream_options={"include_usage": True}, **GREEDY):
        usage = event.usage or usage
        texts += [ch.text for ch in event.choices if ch.text]
    assert texts == [c.text for c in chunks]
    assert usage.completion_tokens == len(texts)


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(server):
    """usage.prompt_tokens_details.cached_tokens, OpenAI's field: none the first time a prompt is
    seen; the second time its full KV blocks (16 tokens each, at least one token left to compute),
    plain and streamed, chat and completions. The prompts are this test's own."""
    c = client(server)
    prompt = ("A list of the moons of Jupiter, each with the year it was found and the person who found "
              "it, in the order of their distance from the planet, nearest first: Metis, Adrastea,")
    cached = []
    for _ in range(2):
        out = c.completions.create(model=MODEL, prompt=prompt, **GREEDY)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    full_blocks = (out.usage.prompt_tokens - 1) // 16 * 16
    assert full_blocks >= 32 and cached == [0, full_blocks]
    usage = None
    for chunk in c.completions.create(model=MODEL, prompt=prompt, stream=True,
                                      stream_options={"include_usage": True}, **GREEDY):
        usage = chunk.usage or usage
    assert usage.prompt_tokens_details.cached_tokens == full_blocks

    # A system message of its own: without one the template puts the model's default system prompt
    # first, whose first block every other user-only chat shares.
    messages = [{"role": "system", "content": prompt.replace("Jupiter", "Saturn")},
                {"role": "user", "content": "Go on."}]
    first = c.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    again = c.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16


def test_chat_matches_chat(server, reference):
    ref = reference.chat(CHAT, SamplingParams(**GREEDY))
    c = client(server)
    out = c.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)

    parts, finish, usage = [], None, None
    for chunk in c.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert ("".join(parts), finish) == (ref.text, ref.finish_reason)
    assert usage.completion_tokens == len(ref.token_ids)


def test_max_completion_tokens_stop_and_logprobs(server, reference):
    c = client(server)
    ref = reference.chat(CHAT, SamplingParams(temperature=0, max_tokens=6, logprobs=2))
    out = c.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_completion_tokens=6,
                                    logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert out.choices[0].message.content == ref.text
    assert [e.logprob for e in content] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)
    for entry in content:       # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 2 and entry.token == entry.top_logprobs[0].token

    full = reference.generate([COMPLETION_PROMPT], SamplingParams(**GREEDY))[0].text
    stop = full.strip().split()[1]       # a word inside the greedy output: the text must end before it
    out = c.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, stop=[stop], **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:full.index(stop)]


def test_n_choices_use_seed_plus_index(server, reference):
    sampled = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 8}
    refs = [reference.generate([COMPLETION_PROMPT], SamplingParams(seed=7 + i, **sampled))[0]
            for i in range(3)]
    assert len({r.text for r in refs}) > 1       # the seeds matter, so the comparison below means something
    out = client(server).completions.create(model=MODEL, prompt=COMPLETION_PROMPT, n=3, seed=7, **sampled)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.text for ch in out.choices] == [r.text for r in refs]
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    assert out.usage.prompt_tokens == len(refs[0].prompt_token_ids)     # counted once, not per choice

    # Streamed chat with n = 2: the interleaved deltas sort back into each seed's own output.
    chat_refs = [reference.chat(CHAT, SamplingParams(seed=3 + i, **sampled)).text for i in range(2)]
    texts, finishes = ["", ""], [None, None]
    for chunk in client(server).chat.completions.create(model=MODEL, messages=CHAT, n=2, seed=3, stream=True,
                                                        **sampled):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert texts == chat_refs and None not in finishes


def test_models_embeddings_and_metrics(server, reference):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    texts = ["a cat sat on the mat", "the stock market fell"]
    emb = c.embeddings.create(model=MODEL, input=texts)
    ref = reference.embed(texts)
    got = [d.embedding for d in emb.data]
    assert len(got) == 2 and len(got[0]) == ref.shape[1]
    for g, r in zip(got, ref.tolist()):
        assert sum((a - b) ** 2 for a, b in zip(g, r)) ** 0.5 < 1e-4
        assert abs(sum(a * a for a in g) - 1) < 1e-4
    assert emb.usage.prompt_tokens == sum(len(reference.encode_prompt(t)) for t in texts)
    c.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=4)   # this test's own finished request
    m = metrics(server)         # parsed by prometheus_client's parser, so the exposition is valid
    for name in ("microengine_kv_cache_capacity_blocks", "microengine_requests_finished_total",
                 "microengine_requests_waiting", "microengine_requests_rejected_total",
                 "microengine_cuda_graph_decode_batch_sizes", "microengine_cuda_graph_step_sizes",
                 'microengine_time_to_first_token_seconds_bucket{le="+Inf"}',
                 "microengine_inter_token_latency_seconds_count", "microengine_request_queue_time_seconds_sum",
                 'microengine_http_responses_total{code="200"}', "process_cpu_seconds_total"):
        assert name in m, name
    assert m["microengine_requests_finished_total"] > 0
    for histogram in ("time_to_first_token", "inter_token_latency", "request_queue_time"):
        name = f"microengine_{histogram}_seconds"
        buckets = sorted((float(k.split('le="')[1][:-2]), v) for k, v in m.items() if k.startswith(name + "_bucket"))
        counts = [v for _, v in buckets]
        assert len(counts) > 5 and counts == sorted(counts) and counts[-1] == m[name + "_count"] > 0


def test_tiny_temperatures_sample_greedily(server, reference):
    """Issue 26.1: a tiny valid temperature used to overflow the fp32 logits and return ""."""
    c = client(server)
    ref = reference.generate([COMPLETION_PROMPT], SamplingParams(**GREEDY))[0].text
    assert ref.strip()
    out = c.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=12, temperature=5e-324)
    assert out.choices[0].text == ref
    ref_chat = reference.chat(CHAT, SamplingParams(**GREEDY)).text
    out = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=1e-39)
    assert out.choices[0].message.content == ref_chat


EMOJI_CHAT = [{"role": "user", "content": "Repeat exactly: \U0001F600\U0001F603\U0001F604 \u65e5\u672c\u8a9e"}]


def test_logprob_bytes_are_each_tokens_utf8_bytes(server, reference):
    """Issue 26.2: a token holding part of a character came back as U+FFFD with bytes [239, 191, 189]."""
    params = {"temperature": 0, "max_tokens": 22}
    ref = reference.chat(EMOJI_CHAT, SamplingParams(**params))
    out = client(server).chat.completions.create(model=MODEL, messages=EMOJI_CHAT, logprobs=True, top_logprobs=2,
                                                 **params)
    text, content = out.choices[0].message.content, out.choices[0].logprobs.content
    assert text == ref.text and "\U0001F600" in text and len(content) == len(ref.token_ids)
    special = set(reference.tokenizer.all_special_ids)
    joined = b"".join(bytes(e.bytes) for tid, e in zip(ref.token_ids, content) if tid not in special)
    assert joined.decode("utf-8") == text          # every token's real bytes, partial characters included
    partial = [e for e in content if not _is_utf8(bytes(e.bytes))]
    assert partial, "the output should hold tokens that split a character"
    for e in content:
        assert e.bytes != [0xEF, 0xBF, 0xBD]
        assert e.top_logprobs[0].bytes == e.bytes       # greedy: the top entry is the chosen token
    for e in partial:                                   # OpenAI's spelling of a token that is no text
        assert e.token == "bytes:" + "".join(f"\\x{b:02x}" for b in e.bytes)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_completion_text_offsets_point_into_the_text(server, reference):
    """Issue 26.3: text_offset counted a U+FFFD per partial token and ran past the text."""
    prompt = "\U0001F600\U0001F603\U0001F604\U0001F601\U0001F606\U0001F605\U0001F602\U0001F923"
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "logprobs": 1, "temperature": 0}
    out = client(server).completions.create(**kw)
    text, lp = out.choices[0].text, out.choices[0].logprobs
    assert text == reference.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].text
    assert len(text) < 6 and len(lp.text_offset) == len(lp.tokens) == 6    # tokens that split characters
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(off < len(text) for off in lp.text_offset)
    for token, off in zip(lp.tokens, lp.text_offset):
        if not token.startswith("bytes:"):
            assert text[off:off + len(token)] == token
    streamed_tokens, streamed_offsets, streamed_text = [], [], ""
    for chunk in client(server).completions.create(stream=True, **kw):
        for ch in chunk.choices:
            streamed_text += ch.text
            if ch.logprobs is not None:
                streamed_tokens += ch.logprobs.tokens
                streamed_offsets += ch.logprobs.text_offset
    assert (streamed_text, streamed_tokens, streamed_offsets) == (text, lp.tokens, lp.text_offset)


def test_null_means_the_default(server, reference):
    """Issue 26.4: explicit null (allowed by the spec) got 400 for temperature, top_p, n, ..."""
    nulls = dict.fromkeys(["temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "logprobs",
                           "stream", "seed", "stop", "user", "stream_options", "top_logprobs",
                           "max_completion_tokens", "ignore_eos"])
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 6,
                                                    "seed": 11, **{k: v for k, v in nulls.items() if k != "seed"}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
        # null took the defaults (temperature 1, top_p 1, no penalties): the same tokens as those given.
        explicit = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": CHAT, "max_tokens": 6, "seed": 11, "temperature": 1.0, "top_p": 1.0,
            "presence_penalty": 0, "frequency_penalty": 0, "n": 1, "stream": False}).json()
        assert body["choices"][0]["message"] == explicit["choices"][0]["message"]
        comp_nulls = {k: v for k, v in nulls.items() if k not in ("max_completion_tokens", "top_logprobs")}
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, **comp_nulls})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"] is None
    # The official client sends None as null too.
    out = client(server).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=None,
                                                 top_p=None, n=None, presence_penalty=None, logprobs=None)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_message_name_is_accepted(server, reference):
    """Issue 26.5: messages[].name got 400 unsupported_parameter."""
    messages = [{"role": "system", "content": "You answer in one short sentence.", "name": "rules"},
                {"role": "user", "content": "What is the capital of Italy?", "name": "alice"}]
    out = client(server).chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert out.choices[0].message.content == reference.chat(messages, SamplingParams(**GREEDY)).text


PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}


def test_response_format_constrains_the_output(server, reference):
    """response_format json_schema and json_object, through constrained decoding (xgrammar)."""
    c = client(server)
    messages = [{"role": "user", "content": "Describe a person."}]
    ref = reference.chat(messages, SamplingParams(temperature=0, max_tokens=120, json_schema=PERSON_SCHEMA))
    out = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=120,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "person", "schema": PERSON_SCHEMA, "strict": True}})
    person = json.loads(out.choices[0].message.content)
    assert out.choices[0].message.content == ref.text and out.choices[0].finish_reason == "stop"
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int)

    text, finish = "", None
    for chunk in c.completions.create(model=MODEL, prompt="A small JSON object:", temperature=0, max_tokens=120,
                                      stream=True, extra_body={"response_format": {"type": "json_object"}}):
        for ch in chunk.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_64_concurrent_streams(server, reference):
    prompts = [f"Item {i}: the number {i * 7} written in words is" for i in range(64)]
    refs = [o.text for o in reference.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    before = metrics(server)["microengine_requests_finished_total"]

    async def one(c, prompt):
        text, finish = "", None
        async for chunk in await c.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                      max_tokens=8, stream=True):
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
        return text, finish

    async def run_all():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)
        try:
            return await asyncio.gather(*(one(c, p) for p in prompts))
        finally:
            await c.close()

    results = asyncio.run(run_all())
    assert [t for t, _ in results] == refs
    assert all(f in ("stop", "length") for _, f in results)
    assert metrics(server)["microengine_requests_finished_total"] - before == 64


def _malformed_cases(long_prompt: str):
    def chat(**kw):
        return "/v1/chat/completions", {"model": MODEL, "messages": CHAT, **kw}

    def comp(**kw):
        return "/v1/completions", {"model": MODEL, "prompt": "hi", **kw}

    bad = "invalid_request_error"
    return [
        # (name, path, body (dict, or bytes sent as is), status, param)
        ("bad json", "/v1/chat/completions", b'{"model": "llama", "messages": [', 400, None),
        ("not an object", "/v1/completions", b"[1, 2, 3]", 400, None),
        ("empty body", "/v1/completions", b"", 400, None),
        ("NaN temperature", "/v1/completions", b'{"model":"llama","prompt":"hi","temperature":NaN}', 400,
         "temperature"),
        ("missing model", "/v1/completions", {"prompt": "hi"}, 400, "model"),
        ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("unknown model", *comp(model="gpt-9"), 400, "model"),
        ("empty messages", *chat(messages=[]), 400, "messages"),
        ("messages not a list", *chat(messages="hello"), 400, "messages"),
        ("bad role", *chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
        ("content missing", *chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
        ("content wrong type", *chat(messages=[{"role": "user", "content": 42}]), 400, "messages[0].content"),
        ("image part", *chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
         400, "messages[0].content[0].type"),
        ("negative max_tokens", *comp(max_tokens=-5), 400, "max_tokens"),
        ("zero max_tokens", *chat(max_tokens=0), 400, "max_tokens"),
        ("string max_tokens", *comp(max_tokens="10"), 400, "max_tokens"),
        ("float max_tokens", *comp(max_tokens=2.5), 400, "max_tokens"),
        ("max_tokens disagree", *chat(max_tokens=5, max_completion_tokens=6), 400, "max_tokens"),
        ("temperature 5", *chat(temperature=5), 400, "temperature"),
        ("negative temperature", *comp(temperature=-0.1), 400, "temperature"),
        ("top_p 0", *comp(top_p=0), 400, "top_p"),
        ("top_p 1.5", *chat(top_p=1.5), 400, "top_p"),
        ("top_k -5", *comp(top_k=-5), 400, "top_k"),
        ("n 0", *comp(n=0), 400, "n"),
        ("n 1000", *chat(n=1000), 400, "n"),
        ("stop list too long", *comp(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
        ("empty stop", *comp(stop=[""]), 400, "stop"),
        ("stop of ints", *chat(stop=[1, 2]), 400, "stop[0]"),
        ("presence_penalty 3", *comp(presence_penalty=3), 400, "presence_penalty"),
        ("frequency_penalty string", *chat(frequency_penalty="x"), 400, "frequency_penalty"),
        ("seed string", *comp(seed="abc"), 400, "seed"),
        ("chat logprobs int", *chat(logprobs=5), 400, "logprobs"),
        ("top_logprobs without logprobs", *chat(top_logprobs=2), 400, "top_logprobs"),
        ("top_logprobs 50", *chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
        ("completion logprobs 100", *comp(logprobs=100), 400, "logprobs"),
        ("stream not bool", *comp(stream="yes"), 400, "stream"),
        ("stream_options without stream", *chat(stream_options={"include_usage": True}), 400,
         "stream_options"),
        ("user not a string", *chat(user=5), 400, "user"),
        ("tools", *chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
        ("response_format type", *chat(response_format={"type": "yaml"}), 400, "response_format.type"),
        ("response_format without schema", *chat(response_format={"type": "json_schema"}), 400,
         "response_format.json_schema"),
        ("unsupported json schema", *comp(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "no-such-type"}}}), 400, "response_format"),
        ("logit_bias", *comp(logit_bias={"50256": -100}), 400, "logit_bias"),
        ("echo", *comp(echo=True), 400, "echo"),
        ("suffix", *comp(suffix="!"), 400, "suffix"),
        ("best_of", *comp(best_of=3), 400, "best_of"),
        ("empty prompt", *comp(prompt=""), 400, "prompt"),
        ("empty prompt list", *comp(prompt=[]), 400, "prompt"),
        ("token id outside vocab", *comp(prompt=[1, 99_999_999]), 400, "prompt"),
        ("prompt over context", *comp(prompt=long_prompt), 400, "prompt"),
        ("chat over context", *chat(messages=[{"role": "user", "content": long_prompt}]), 400, "messages"),
        ("max_tokens over context", *comp(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
        ("embedding of nothing", "/v1/embeddings", {"model": MODEL, "input": []}, 400, "input"),
        ("embedding of an int", "/v1/embeddings", {"model": MODEL, "input": 3}, 400, "input"),
        ("embedding dimensions", "/v1/embeddings", {"model": MODEL, "input": "x", "dimensions": 8}, 400,
         "dimensions"),
        ("huge body", *comp(prompt="x" * (2 << 20)), 413, None),
    ], bad


def test_malformed_requests_get_openai_errors(server, reference):
    long_prompt = " ".join(["word"] * (MAX_MODEL_LEN + 50))
    assert len(reference.encode_prompt(long_prompt)) > MAX_MODEL_LEN
    cases, bad = _malformed_cases(long_prompt)
    assert len(cases) >= 30
    failures = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for name, path, body, status, param in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            try:
                err = r.json()["error"]
                ok = (r.status_code == status and isinstance(err["message"], str) and err["message"]
                      and err["type"] == bad and set(err) == {"message", "type", "param", "code"}
                      and (param is None or err["param"] == param))
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                failures.append(f"{name}: {r.status_code} {r.text[:300]}")
        assert not failures, "\n".join(failures)

        # FastAPI's own errors use the same body: unknown route, wrong method.
        r = http.get("/v1/nope")
        assert r.status_code == 404 and "message" in r.json()["error"]
        r = http.get("/v1/chat/completions")
        assert r.status_code == 405 and "message" in r.json()["error"]

        # The server is unharmed.
        assert http.get("/health").json()["status"] == "ok"
    out = client(server).completions.create(model=MODEL, prompt=COMPLETION_PROMPT, **GREEDY)
    assert out.choices[0].text == reference.generate([COMPLETION_PROMPT], SamplingParams(**GREEDY))[0].text


def test_disconnects_abort_and_free_blocks(server, reference):
    before = metrics(server)
    assert before["microengine_requests_running"] == 0

    async def connect_and_leave(http, i):
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"text":"' in line:
                    return          # leaving the block closes the connection mid-stream

    async def wait_and_give_up(i):
        # A non-streaming client that times out: its request must be aborted too.
        body = {"model": MODEL, "prompt": f"Essay {i}:", "max_tokens": 400, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=1.5) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json=body)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            await asyncio.gather(*(connect_and_leave(http, i) for i in range(20)),
                                 *(wait_and_give_up(i) for i in range(2)))

    asyncio.run(run())
    deadline = time.monotonic() + 30
    while True:
        m = metrics(server)
        if m["microengine_requests_running"] == 0 and m["microengine_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"requests still running: {m}"
        time.sleep(0.1)
    assert m["microengine_requests_aborted_total"] - before["microengine_requests_aborted_total"] == 22
    assert m["microengine_requests_finished_total"] == before["microengine_requests_finished_total"]
    # Prefix-cached blocks of the aborted prompts count as free (evictable) in the engine's pool.
    assert m["microengine_kv_cache_used_blocks"] == before["microengine_kv_cache_used_blocks"] == 0
    assert m["microengine_kv_cache_free_blocks"] == m["microengine_kv_cache_capacity_blocks"]


def test_cli_has_every_engine_option():
    from engine.config import EngineConfig
    out = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=False)
    assert out.returncode == 0
    for f in dataclasses.fields(EngineConfig):
        if f.name != "extra":
            assert "--" + f.name.replace("_", "-") in out.stdout, f.name
    for flag in ("--host", "--port", "--api-key", "--shutdown-timeout", "--max-request-bytes",
                 "--max-queued-requests", "--allowed-hosts", "--header-timeout", "--body-timeout",
                 "--max-connections", "--allocator", "--memory-release"):
        assert flag in out.stdout


@pytest.fixture
def cpu_allocator(monkeypatch):
    """configure_allocator as on a machine without CUDA (no restart), its state restored after."""
    import torch

    from engine.memory import allocator
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(allocator.ENV, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(allocator, "_release", "dedicated")
    return allocator


def test_cli_allocator_options(cpu_allocator, capsys):
    import serve
    args = serve.parse_args([])
    assert (args.allocator, args.memory_release) == ("native", "dedicated")
    assert not hasattr(args, "cuda_graphs")        # left to EngineConfig's default
    assert os.environ[cpu_allocator.ENV] == "backend:native"
    args = serve.parse_args(["--allocator", "cudaMallocAsync", "--memory-release", "shared"])
    assert os.environ[cpu_allocator.ENV] == "backend:cudaMallocAsync"
    assert cpu_allocator._release == "shared"
    assert not hasattr(args, "cuda_graphs")        # graphs stay on under either allocator
    assert serve.parse_args(["--allocator", "cudaMallocAsync", "--cuda-graphs"]).cuda_graphs is True
    assert serve.parse_args(["--allocator", "cudaMallocAsync", "--no-cuda-graphs"]).cuda_graphs is False
    for argv, message in ((["--memory-release", "shared"], "needs the cudaMallocAsync backend"),
                          (["--allocator", "cudaMalloc"], "invalid choice")):
        with pytest.raises(SystemExit) as e:
            serve.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err, argv


def test_api_key(keyed_server):
    url = keyed_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")):
            r = httpx.request(method, url + path, headers=headers, json={"model": MODEL, "prompt": "hi"})
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        client(keyed_server, "wrong").models.list()
    out = client(keyed_server, API_KEY).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_sigterm_drains_and_exits_zero(draining_server):
    """SIGTERM with a stream in flight: new requests get 503, the stream ends cleanly (finished, or
    aborted with an error event once --shutdown-timeout=3s passes), and the process exits 0."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events = []
    with httpx.Client(base_url=draining_server.url, headers=auth, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                break
        signaled = time.monotonic()
        draining_server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(draining_server.url + "/v1/completions", headers=auth, timeout=10,
                             json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        events += [line[6:] for line in lines if line.startswith("data: ")]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last.get("choices", [{}])[0].get("finish_reason") == "length" or \
        last.get("error", {}).get("code") == "server_shutting_down"
    assert draining_server.proc.wait(timeout=20) == 0
    assert time.monotonic() - signaled < 3 + 10
