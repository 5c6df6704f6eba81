"""The library API: sampling controls, stop conditions, streaming, and refusal of bad input."""
import asyncio

import pytest

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
