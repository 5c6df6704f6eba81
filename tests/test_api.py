"""The library API: sampling controls, stop conditions, streaming, and refusal of bad input."""
import asyncio
import json
import threading

import pytest
import torch

from engine import ContextLengthError, SamplingParams


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    a = llm.generate(["Tell me a story about a fox."], p)[0]
    b = llm.generate(["Tell me a story about a fox."], p)[0]
    # The same seed gives the same tokens even with other requests in the batch.
    c = llm.generate(["Tell me a story about a fox.", "Something else entirely"],
                     [p, SamplingParams(max_tokens=24, temperature=1.0, seed=7)])[0]
    other = llm.generate(["Tell me a story about a fox."], SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=4321, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids == c.token_ids
    assert other.token_ids != a.token_ids


def test_max_tokens_and_stop_strings(llm):
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = llm.generate(["List the numbers from 1 to 20: 1, 2, 3,"], greedy)[0]
    assert len(full.token_ids) == 40 and full.finish_reason == "length"
    stop = full.text[10:14]
    assert stop.strip()
    cut = llm.generate(["List the numbers from 1 to 20: 1, 2, 3,"],
                       SamplingParams(max_tokens=40, temperature=0, stop=[stop, "zzz-never"]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.find(stop)]
    short = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "length"


def test_stop_token_ids(llm):
    full = llm.generate(["The alphabet: A B C D"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    stop_id = full.token_ids[3]
    out = llm.generate(["The alphabet: A B C D"],
                       SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full.token_ids[:4] and out.finish_reason == "stop"


def test_streaming_sync_and_async_give_the_generated_text(llm):
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = llm.generate(["Water boils at"], p)[0]
    chunks = list(llm.stream("Water boils at", p))
    assert "".join(c.text for c in chunks) == ref.text
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 20

    async def consume():
        return [c async for c in llm.stream("Water boils at", p)]
    achunks = asyncio.run(consume())
    assert "".join(c.text for c in achunks) == ref.text


def test_async_streams_on_one_loop_each_get_their_own_tokens_in_order(llm):
    prompts = ["Water boils at", "The capital of France is", "One, two,", "def main():", "Once upon a time",
               "The alphabet: A B C", "Hello", "2 + 2 ="]
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    want = llm.generate(prompts, params)

    async def consume_all():
        async def one(prompt, p):
            return [c async for c in llm.stream(prompt, p)]
        return await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, params)))
    for ref, chunks in zip(want, asyncio.run(consume_all())):
        assert [t for c in chunks for t in c.token_ids] == ref.token_ids
        assert [c.completion_tokens for c in chunks] == list(range(1, len(ref.token_ids) + 1))
        assert "".join(c.text for c in chunks) == ref.text and chunks[-1].finish_reason == "length"


def test_mailbox_wakes_its_loop_once_per_batch_and_keeps_the_order():
    from engine.llm import _Mailbox
    loop = asyncio.new_event_loop()
    try:
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), real(*a))[1]
        box = _Mailbox(loop)
        queues = [asyncio.Queue(), asyncio.Queue()]
        items = [(queues[i % 2], f"chunk {i}") for i in range(7)]
        for q, item in items:          # posted from another thread, as the engine thread posts
            poster = threading.Thread(target=box.post, args=(q, item))
            poster.start()
            poster.join()
        assert len(wakes) == 1         # one wake-up for the batch, not one per chunk
        loop.run_until_complete(asyncio.sleep(0))
        got = [[q.get_nowait() for _ in range(q.qsize())] for q in queues]
        assert got == [[f"chunk {i}" for i in range(0, 7, 2)], [f"chunk {i}" for i in range(1, 7, 2)]]
        box.post(queues[0], "after")   # the mailbox was emptied: the next chunk wakes the loop again
        assert len(wakes) == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert queues[0].get_nowait() == "after"
    finally:
        loop.close()
    box.post(queues[1], "to a closed loop")    # nobody can read it: dropped, and the engine thread goes on
    assert queues[1].empty()


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=8, temperature=0))
    ids = llm.encode_chat([{"role": "user", "content": "Say hello."}])
    assert out.prompt_token_ids == ids
    assert llm.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_logprobs(llm):
    out = llm.generate(["One, two,"], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok      # greedy picks the most likely


@pytest.mark.parametrize("kwargs, name", [
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"), ({"stop": [""]}, "stop"), ({"presence_penalty": 9.0}, "presence_penalty"),
])
def test_bad_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="^prompt"):
        llm.generate([""], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="^prompt"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 10**9]], SamplingParams(max_tokens=4))
    with pytest.raises(ContextLengthError, match=str(llm.max_model_len)):
        llm.generate([[5] * (llm.max_model_len + 1)], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="^messages"):
        llm.chat([], SamplingParams(max_tokens=4))
    # The engine still serves after refusing.
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0))[0].token_ids


def test_embeddings_are_normalised(llm):
    e = llm.embed(["a cat sat on the mat", "a cat sat on a mat", "quarterly tax filing deadlines"])
    assert e.shape == (3, 576)
    assert ((e.norm(dim=1) - 1).abs() < 1e-5).all()
    assert (e[0] @ e[1]) > (e[0] @ e[2])


# ---------------------------------------------------------------------------------------------------
# Issue 26: tiny temperatures, clear errors for bad arguments, and no hang on an engine-thread error.

def _within(fn, timeout_s: float = 120):
    """fn() on another thread; the test fails (instead of hanging) if it does not return in time."""
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            result["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"the call did not return within {timeout_s}s"
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.parametrize("temperature", [5e-324, 1e-39, 1e-7])
def test_tiny_temperature_is_greedy(llm, temperature):
    greedy = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0]
    tiny = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=temperature,
                                                                      seed=3))[0]
    assert tiny.text.strip() and tiny.token_ids == greedy.token_ids


@pytest.mark.parametrize("call, error, match", [
    (lambda llm: llm.generate(123), TypeError, "^prompts: must be a string, a list of token ids"),
    (lambda llm: llm.generate([1.5]), TypeError, "^prompt: must be a string or a list of token ids"),
    (lambda llm: llm.generate(["hi"], "not-params"), TypeError, "^params: must be a SamplingParams"),
    (lambda llm: llm.generate(["a", "b"], [SamplingParams()]), ValueError, "^params: one SamplingParams"),
    (lambda llm: llm.stream("hi", {"max_tokens": 2}), TypeError, "^params: must be a SamplingParams"),
    (lambda llm: llm.embed([]), ValueError, "^texts: must be a non-empty"),
    (lambda llm: llm.embed([""]), ValueError, "^texts: must be a non-empty"),
    (lambda llm: llm.embed(5), TypeError, "^texts: must be a string or a list of strings"),
    (lambda llm: llm.logits("hi"), TypeError, "^token_ids: must be a list of token ids"),
    (lambda llm: llm.chat("hi"), TypeError, "^messages: must be a list"),
])
def test_bad_arguments_name_the_parameter(llm, call, error, match):
    with pytest.raises(error, match=match):
        call(llm)


@pytest.mark.parametrize("kwargs, error, name", [
    ({"stop": 5}, TypeError, "stop"), ({"stop": ["a", 3]}, TypeError, "stop"),
    ({"seed": 2**80}, ValueError, "seed"), ({"seed": "7"}, TypeError, "seed"),
    ({"temperature": "hot"}, TypeError, "temperature"), ({"max_tokens": 2.0}, TypeError, "max_tokens"),
    ({"logprobs": True}, TypeError, "logprobs"), ({"stop_token_ids": 5}, TypeError, "stop_token_ids"),
    ({"json_schema": "{not json"}, ValueError, "json_schema"), ({"json_schema": 3}, TypeError, "json_schema"),
    ({"json_schema": {}, "json_object": True}, ValueError, "json_object"),
])
def test_bad_sampling_params_types(kwargs, error, name):
    with pytest.raises(error, match=f"^{name}: "):
        SamplingParams(**kwargs)


def test_seed_range_runs(llm):
    # The largest seed torch accepts runs (2**80 is refused by SamplingParams instead of hanging).
    out = _within(lambda: llm.generate(["hi"], SamplingParams(max_tokens=2, seed=2**64 - 1)))
    assert len(out[0].token_ids) == 2


def test_embed_of_a_string_is_one_input(llm):
    one = llm.embed("hello")
    assert one.shape == (1, 576)
    assert torch.allclose(one, llm.embed(["hello"]))


def test_engine_step_error_fails_its_requests(llm, monkeypatch):
    params = SamplingParams(max_tokens=6, temperature=0)
    want = llm.generate(["Water boils at"], params)[0].token_ids

    class Injected(RuntimeError):
        pass

    def broken_sample(*args, **kwargs):
        raise Injected("injected sampling failure")
    monkeypatch.setattr(llm.engine.sampler, "sample", broken_sample)
    with pytest.raises(Injected, match="injected sampling failure"):
        _within(lambda: llm.generate(["Water boils at"], params))

    async def consume():
        return [c async for c in llm.stream("Water boils at", params)]
    with pytest.raises(Injected):
        _within(lambda: asyncio.run(consume()))
    monkeypatch.undo()
    # The engine serves on, with its KV blocks back in the pool.
    assert _within(lambda: llm.generate(["Water boils at"], params))[0].token_ids == want
    m = llm.metrics()
    assert m["kv_blocks_used"] == 0 and m["running"] == 0 and m["requests_failed"] >= 2


def test_engine_add_request_error_reaches_the_caller(llm, monkeypatch):
    def broken_add(*args, **kwargs):
        raise OverflowError("injected: Overflow when unpacking long long")
    monkeypatch.setattr(llm.engine, "add_request", broken_add)
    with pytest.raises(OverflowError, match="injected"):
        _within(lambda: llm.generate(["hi"], SamplingParams(max_tokens=2)))


class _Fatal(BaseException):
    """Not an Exception: nothing in the engine loop catches it, so the thread dies."""


class _DyingEngine:
    """Stands in for Engine (no model): takes requests, and its first step kills the engine thread."""
    tokenizer, model_name, max_model_len, tp = None, "dying", 64, None

    def __init__(self, config):
        self.requests = {}

    def idle(self):
        pass

    def close(self):
        pass

    def validate(self, ids, params):
        return 4

    def add_request(self, rid, ids, params, sink):
        self.requests[rid] = sink

    def has_work(self):
        return bool(self.requests)

    def step(self):
        raise _Fatal("the engine thread dies")

    def metrics(self):
        return {}


def test_a_dead_engine_thread_fails_every_caller(monkeypatch):
    import engine.llm
    monkeypatch.setattr(engine.llm, "Engine", _DyingEngine)
    dying = engine.llm.LLM()
    with pytest.raises(RuntimeError, match="engine thread stopped: _Fatal"):
        _within(lambda: dying.generate([[1, 2, 3]], SamplingParams(max_tokens=2)))
    # Whatever comes after fails at once instead of waiting on the dead thread.
    with pytest.raises(RuntimeError, match="engine thread stopped"):
        _within(lambda: dying.generate([[1, 2, 3]], SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="engine thread stopped"):
        _within(dying.metrics)
    _within(lambda: dying.shutdown(1))


PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                  "tags": {"type": "array", "items": {"type": "string"},
                                                           "maxItems": 2}},
                 "required": ["name", "age", "tags"]}


def _is_person(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "tags"} and isinstance(obj["name"], str)
            and isinstance(obj["age"], int) and all(isinstance(t, str) for t in obj["tags"]))


def test_json_schema_constrains_the_output(llm):
    prompt = "Describe a person."        # no hint of JSON: the grammar alone makes the output JSON
    outs = llm.generate([prompt, prompt, prompt], [
        SamplingParams(max_tokens=120, temperature=0, json_schema=PERSON_SCHEMA),
        SamplingParams(max_tokens=120, temperature=0.9, seed=5, json_schema=json.dumps(PERSON_SCHEMA)),
        SamplingParams(max_tokens=12, temperature=0)])
    for out in outs[:2]:
        assert out.finish_reason == "stop" and _is_person(json.loads(out.text)), out.text
    # A free request in the same batch is untouched.
    assert outs[2].token_ids == llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    obj = llm.chat([{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}],
                   SamplingParams(max_tokens=120, temperature=0, json_object=True))
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict), obj.text


def test_unsupported_json_schema_is_refused(llm):
    with pytest.raises(ValueError, match="^json_schema: this schema is not supported"):
        llm.generate(["hi"], SamplingParams(max_tokens=4, json_schema={"type": "no-such-type"}))
