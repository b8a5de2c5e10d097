"""POST /v1/completions and /v1/responses on a real `omni-jax serve` (text only: the thinker alone),
driven by the official `openai` client and checked against `OmniJax.generate` with the same
prompts and params."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import httpx
import openai
import pytest

from omni_jax import OmniJax, SamplingParams
from omni_jax.server.kept import Kept
from omni_jax.server.schemas import MAX_CHOICES
from test_server import API_KEY, MODEL, _auth, _idle, _metrics, env, pipeline_yaml, serving  # noqa: F401

pytestmark = pytest.mark.server

PROMPT = "Hello, my name is"
IDS = [9707, 11, 1879, 0]
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def server(env, pipeline_yaml, tmp_path_factory):  # noqa: F811
    log_path = str(tmp_path_factory.mktemp("completions_server") / "serve.log")
    with serving(["--model", MODEL, "--pipeline", pipeline_yaml, "--api-key", API_KEY, "--modalities", "text"],
                 env, log_path) as srv:
        yield srv


@pytest.fixture(scope="module")
def library(server, pipeline_yaml):  # noqa: F811
    omni = OmniJax(model=MODEL, pipeline=pipeline_yaml, output_modalities=["text"])
    yield omni
    omni.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _want(library, prompt, **params):
    return library.generate(prompt, SamplingParams(**params), output_modalities=["text"], use_tqdm=False)[0]


def _assert_offsets(text: str, lps) -> None:
    """Each token's text is where its offset says in the choice's text."""
    for token, offset in zip(lps.tokens, lps.text_offset):
        assert text[offset:offset + len(token)] == token, (text, lps)
    assert "".join(lps.tokens) == text


def test_text_equals_the_library(client, library):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY)
    want = _want(library, PROMPT, max_tokens=8, **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text == want.text and want.text
    assert r.choices[0].finish_reason == want.finish_reason == "length" and r.choices[0].logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 8)
    # no chat template: the prompt is the text itself
    assert list(want.prompt_token_ids) == library.tokenizer.encode(PROMPT)


def test_max_tokens_defaults_to_16_as_openai(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True}, **GREEDY)
    assert r.usage.completion_tokens == 16


def test_a_batch_of_texts_or_token_ids_is_one_choice_each(client, library):
    texts = [PROMPT, "The sky is", "1, 2, 3,"]
    r = client.completions.create(model=MODEL, prompt=texts, max_tokens=5, **GREEDY)
    wants = [_want(library, t, max_tokens=5, **GREEDY) for t in texts]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [w.text for w in wants]
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in wants)
    assert r.usage.completion_tokens == 15
    # token ids: one list, or a list of lists
    want = _want(library, {"prompt_token_ids": IDS}, max_tokens=5, **GREEDY)
    assert client.completions.create(model=MODEL, prompt=IDS, max_tokens=5, **GREEDY).choices[0].text == want.text
    r = client.completions.create(model=MODEL, prompt=[IDS, IDS[:2]], max_tokens=5, **GREEDY)
    assert r.choices[0].text == want.text
    assert r.choices[1].text == _want(library, {"prompt_token_ids": IDS[:2]}, max_tokens=5, **GREEDY).text


def test_n_samples_per_prompt(client, library):
    """n choices per prompt, prompt i's j-th at index i * n + j; seeded, sample j takes seed + j."""
    sampled = dict(temperature=1.0, top_p=0.9, max_tokens=6)
    r = client.completions.create(model=MODEL, prompt=[PROMPT, IDS], n=3, seed=11, **sampled)
    assert [c.index for c in r.choices] == list(range(6))
    for i, prompt in enumerate([PROMPT, {"prompt_token_ids": IDS}]):
        want = [_want(library, prompt, seed=11 + j, **sampled).text for j in range(3)]
        assert [c.text for c in r.choices[3 * i:3 * i + 3]] == want
        assert len(set(want)) > 1  # the samples differ
    assert r.usage.completion_tokens == 36  # the prompts counted once each
    assert r.usage.prompt_tokens == len(library.tokenizer.encode(PROMPT)) + len(IDS)
    # greedy: n copies of the one answer, as OpenAI gives
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=4, best_of=2, **GREEDY)
    assert r.choices[0].text == r.choices[1].text == _want(library, PROMPT, max_tokens=4, **GREEDY).text


def test_logprobs_and_echo_equal_the_library(client, library):
    want = _want(library, PROMPT, max_tokens=4, logprobs=2, prompt_logprobs=2, **GREEDY)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2, echo=True, **GREEDY)
    choice = r.choices[0]
    assert choice.text == PROMPT + want.text
    lps = choice.logprobs
    ids = list(want.prompt_token_ids) + list(want.token_ids)
    assert lps.tokens == [library.tokenizer.decode([t]) for t in ids]
    # the prompt's first token has no logprob; then the prompt's, then the completion's
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    steps = list(want.prompt_logprobs[1:]) + list(want.logprobs)
    for token, step, got, top in zip(ids[1:], steps, lps.token_logprobs[1:], lps.top_logprobs[1:]):
        assert abs(got - step[token].logprob) < 1e-6
        # the top 2 and the token itself
        names = {library.tokenizer.decode([t]) for t, v in step.items() if v.rank <= 2 or t == token}
        assert set(top) == names and 2 <= len(top) <= 3
    _assert_offsets(choice.text, lps)
    # without echo: the completion's tokens only, offsets from 0
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=0, **GREEDY)
    lps = r.choices[0].logprobs
    assert [abs(a - s[t].logprob) < 1e-6 for a, s, t in zip(lps.token_logprobs, want.logprobs, want.token_ids)] \
        == [True] * 4
    assert all(len(top) == 1 for top in lps.top_logprobs)  # logprobs 0: the token alone
    _assert_offsets(r.choices[0].text, lps)


def test_echo_with_max_tokens_0_scores_the_prompt(client, library):
    """What evaluation harnesses send to score a text: the prompt back, with its logprobs."""
    want = _want(library, PROMPT, max_tokens=1, prompt_logprobs=1, **GREEDY)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(want.prompt_token_ids)
    got = choice.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for token, step, lp in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:], got[1:]):
        assert abs(lp - step[token].logprob) < 1e-6
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == PROMPT
    assert [x for c in streamed if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs] == got


def test_a_streamed_batch_equals_the_whole_reply(client):
    kw = dict(model=MODEL, prompt=[PROMPT, IDS], max_tokens=6, logprobs=1, echo=True, **GREEDY)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts, offsets, reasons = ["", ""], [[], []], [[], []]
    for c in chunks[:-1]:
        assert c.object == "text_completion" and c.usage is None and len(c.choices) == 1
        ch = c.choices[0]
        texts[ch.index] += ch.text
        if ch.logprobs:
            offsets[ch.index] += ch.logprobs.text_offset
        if ch.finish_reason:
            reasons[ch.index].append(ch.finish_reason)
    assert texts == [c.text for c in whole.choices]
    assert offsets == [c.logprobs.text_offset for c in whole.choices]
    assert reasons == [["length"], ["length"]]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


@pytest.mark.parametrize("change, param, code", [
    ({"prompt": [1, "a"]}, "prompt", "invalid_value"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({"prompt": [[1], []]}, "prompt", "invalid_value"),
    ({"prompt": [True, 1]}, "prompt", "invalid_value"),
    ({"prompt": ["x"] * (MAX_CHOICES + 1)}, "prompt", "invalid_value"),
    ({"prompt": ["x"] * 8, "n": 9}, "n", "invalid_value"),
    ({"n": 0}, "n", "invalid_value"),
    ({"prompt": ""}, "prompt", "invalid_value"),
    ({"prompt": [[1], [1 << 30]]}, "prompt[1]", "invalid_value"),
    ({"prompt": "word " * 600}, "prompt", "context_length_exceeded"),
    ({"n": 2, "best_of": 3}, "best_of", "unsupported_parameter"),
    ({"suffix": "end"}, "suffix", "unsupported_parameter"),
    ({"logit_bias": {"1": -101}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "invalid_value"),
    ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": -1}, "max_tokens", "invalid_value"),
    ({"logprobs": 21}, "logprobs", "invalid_value"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"temperature": 3}, "temperature", "invalid_value"),
    ({"stop": ["s"] * 17}, "stop", "invalid_value"),
])
def test_400_names_the_field(server, change, param, code):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **change}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=_auth(), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err


def test_unknown_model_is_404(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-3.5-turbo-instruct", "prompt": "x"},
                   headers=_auth(), timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_refused_prompt_or_a_client_that_leaves_frees_the_whole_batch(server):
    long = {"model": MODEL, "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    # One bad prompt of a batch: 400 naming it, and the good ones, submitted beside it, stopped.
    r = httpx.post(f"{server.url}/v1/completions", json={**long, "prompt": [IDS, IDS, [1 << 30]]}, headers=_auth(),
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[2]"
    _idle(server)
    # A client that leaves a streamed batch: every choice not finished is aborted. 32 prompts on a
    # thinker of 8 sequences: the stream starts once each has begun, so the last 8 have their
    # 300 tokens ahead when the client leaves.
    def counts():
        m = _metrics(server)
        return [m.get(f'omni_jax_requests_total{{endpoint="completions",finish_reason="{r}"}}', 0)
                for r in ("abort", "length")]

    before = counts()
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**long, "prompt": [IDS] * 32, "stream": True},
                      headers=_auth(), timeout=60) as s:
        seen = 0
        for line in s.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 6:
                break
    _idle(server)  # no request running, no KV block held
    aborted, finished = (a - b for a, b in zip(counts(), before))
    assert aborted >= 1 and aborted + finished == 32, (aborted, finished)


def test_concurrent_batches_complete(server, library):
    want = [_want(library, p, max_tokens=6, **GREEDY).text for p in (PROMPT, {"prompt_token_ids": IDS})]
    c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def one(i):
        kw = dict(model=MODEL, prompt=[PROMPT, IDS], max_tokens=6, **GREEDY)
        if i % 2:
            return [c.text for c in (await c.completions.create(**kw)).choices]
        texts = ["", ""]
        async for chunk in await c.completions.create(**kw, stream=True):
            texts[chunk.choices[0].index] += chunk.choices[0].text
        return texts

    async def go():
        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await c.close()

    assert all(texts == want for texts in asyncio.run(go()))
    m = _idle(server)
    assert m["omni_jax_requests_in_flight"] == 0


def test_wire_format(server):
    """The raw events: `data: {json}` per chunk, `data: [DONE]` last, as OpenAI streams them."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=_auth(), timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------- /v1/responses

def _png_url() -> str:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (56, 56, 3), np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(library, messages, **params):
    return _want(library, {"messages": messages}, **GREEDY, **params)


def test_a_response_equals_the_library(client, library):
    r = client.responses.create(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=5, **GREEDY)
    want = _chat(library, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                 max_tokens=5)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == want.text and want.text
    assert [(o.type, o.role, o.content[0].type) for o in r.output] == [("message", "assistant", "output_text")]
    # max_output_tokens ended it: incomplete, as OpenAI's
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(want.prompt_token_ids), 5)
    assert r.instructions == "Be brief." and r.store is True and r.previous_response_id is None


def test_input_items_with_parts_images_and_roles(client, library):
    url = _png_url()
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": url},
                                                             {"type": "input_text", "text": "What is it?"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "A picture."}]},
             {"role": "user", "content": "Which colours?"}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=4, **GREEDY)
    want = _chat(library, [{"role": "system", "content": "Answer in one word."},
                           {"role": "user", "content": [{"type": "image", "image": url},
                                                        {"type": "text", "text": "What is it?"}]},
                           {"role": "assistant", "content": "A picture."},
                           {"role": "user", "content": "Which colours?"}], max_tokens=4)
    assert r.output_text == want.text and r.usage.input_tokens == len(want.prompt_token_ids)


def test_previous_response_id_continues_the_conversation(client, library):
    first = client.responses.create(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=4,
                                    **GREEDY)
    second = client.responses.create(model=MODEL, input="Tell me more", previous_response_id=first.id,
                                     max_output_tokens=4, **GREEDY)
    # the earlier turns, the earlier reply, the new input; the instructions are not carried over
    want = _chat(library, [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text},
                           {"role": "user", "content": "Tell me more"}], max_tokens=4)
    assert second.output_text == want.text and second.previous_response_id == first.id
    third = client.responses.create(model=MODEL, input="Again", previous_response_id=second.id, max_output_tokens=3,
                                    **GREEDY)
    want = _chat(library, [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text},
                           {"role": "user", "content": "Tell me more"},
                           {"role": "assistant", "content": second.output_text},
                           {"role": "user", "content": "Again"}], max_tokens=3)
    assert third.output_text == want.text
    # retrieved as it was answered; deleted, it is gone for both
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert (e.value.body["param"], e.value.body["code"]) == ("previous_response_id", "previous_response_not_found")
    # store: false keeps nothing
    unstored = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_streamed_events_in_order_and_equal_to_the_whole(client):
    kw = dict(model=MODEL, input="Hello", max_output_tokens=6, top_logprobs=1,
              include=["message.output_text.logprobs"], **GREEDY)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(d.delta for d in deltas) == whole.output_text
    assert [x.logprob for d in deltas for x in d.logprobs] == [x.logprob for x in whole.output[0].content[0].logprobs]
    final = events[-1].response
    assert final.output_text == whole.output_text
    # (the cached tokens differ: the first request left the prompt in the prefix cache)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, 6)
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # a streamed one is stored too


def test_a_response_stream_on_the_wire(server):
    """`event: <type>` then `data: <json>` per event, as OpenAI's."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, headers=_auth(), timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b]
    for block in blocks:
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and json.loads(data.removeprefix("data: "))["type"] == kind[len("event: "):]


@pytest.mark.parametrize("change, param, code", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "invalid_value"),  # the chat completions' shape: the Responses API names the function flat
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format", "invalid_value"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "unsupported_parameter"),
    ({"background": True}, "background", "unsupported_parameter"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "unsupported_parameter"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format.schema", "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "name": "bad name!"}}}, "text.format.name", "invalid_value"),
    ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"include": ["file_search_call.results"]}, "include", "unsupported_parameter"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output", "invalid_value"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments", "invalid_value"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "unsupported_parameter"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type",
     "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x.org/a.png"}]}]},
     "input[0].content[0].image_url.url", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].image_url", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", "invalid_value"),
    ({"input": "word " * 600}, "input", "context_length_exceeded"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id", "previous_response_not_found"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"thinking_token_budget": 8}, "thinking_token_budget", "invalid_value"),  # this model does not think
])
def test_response_400_names_the_field(server, change, param, code):
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 4, **change}
    r = httpx.post(f"{server.url}/v1/responses", json=body, headers=_auth(), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err


def test_a_client_that_leaves_a_response_stream_aborts_it(server):
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, headers=_auth(), timeout=60) as s:
        for i, _ in enumerate(s.iter_lines()):
            if i >= 10:
                break
    m = _idle(server)
    assert m['omni_jax_requests_total{endpoint="responses",finish_reason="abort"}'] >= 1


def test_kept_holds_within_its_bounds():
    """The store behind stored responses: the oldest go first past the byte or count budget, and
    an entry is gone after its time."""
    kept = Kept(ttl_s=60, max_entries=3, max_bytes=100)
    for key in "abc":
        kept.put(key, key.upper(), 40)
    assert [kept.get(k) for k in "abc"] == [None, "B", "C"]  # 120 bytes: a went
    kept.put("b", "B2", 10)  # replaced (now the newest), not counted twice: 50 bytes
    kept.put("d", "D", 10)
    kept.put("e", "E", 10)  # 4 entries: the oldest, c, went
    assert [kept.get(k) for k in "bcde"] == ["B2", None, "D", "E"]
    assert kept.pop("e") and not kept.pop("e") and kept.get("e") is None
    brief = Kept(ttl_s=0.05)
    brief.put("x", 1)
    time.sleep(0.1)
    assert brief.get("x") is None


# ------------------------------------------------------------------------------ structured outputs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "color"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "color": {"enum": ["red", "green"]}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def _is_answer(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"ok", "n", "color"} and isinstance(value["ok"], bool), text
    assert type(value["n"]) is int and 0 <= value["n"] <= 9 and value["color"] in ("red", "green"), text
    return value


def _constrained(library, prompt, spec: dict, **params):
    from omni_jax import StructuredOutputs

    return _want(library, prompt, structured_outputs=StructuredOutputs(**spec), **params)


def test_chat_response_format_json_schema_equals_the_library(client, library):
    """A chat reply under a JSON schema is JSON the schema accepts, and the library's reply to the
    same messages under the same schema; json_object's reply (a random model's never-ending
    string here) is the library's, and opens an object."""
    msgs = [{"role": "user", "content": "Answer in JSON."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, response_format=JSON_SCHEMA, max_tokens=300,
                                       **GREEDY)
    want = _constrained(library, {"messages": msgs}, {"json": SCHEMA}, max_tokens=300, **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == want.text
    _is_answer(want.text)
    r = client.chat.completions.create(model=MODEL, messages=msgs, response_format={"type": "json_object"},
                                       max_tokens=20, **GREEDY)
    want = _constrained(library, {"messages": msgs}, {"json_object": True}, max_tokens=20, **GREEDY)
    assert r.choices[0].message.content == want.text and want.text.lstrip().startswith("{")


def test_chat_parse_with_a_pydantic_model(client):
    """openai's `parse` helper: a pydantic model sent as a strict schema, the reply parsed into it."""
    from typing import Literal

    from pydantic import BaseModel

    class Answer(BaseModel):
        ok: bool
        color: Literal["red", "green"]

    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Pick a color."}],
                                      response_format=Answer, max_tokens=300, **GREEDY)
    assert isinstance(r.choices[0].message.parsed, Answer)


def test_completions_structured_outputs_and_streams(client, library):
    """vLLM's structured_outputs (choice, regex, grammar) on completions, whole and streamed."""
    specs = [{"choice": ["yes", "no", "maybe"]}, {"regex": r"[a-z]{3}-[0-9]{2}"},
             {"grammar": 'start: "A" ("B" | "C") ("B" | "C")? "D"'}, {"json": SCHEMA, "disable_any_whitespace": True}]
    for spec in specs:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200,
                                      extra_body={"structured_outputs": spec}, **GREEDY)
        want = _constrained(library, PROMPT, spec, max_tokens=200, **GREEDY)
        text = r.choices[0].text
        assert text == want.text and r.choices[0].finish_reason == "stop", (spec, text)
        streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, stream=True,
                                             extra_body={"structured_outputs": spec}, **GREEDY)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    assert text == json.dumps(_is_answer(text))


def test_response_text_format_json_schema(client, library):
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    r = client.responses.create(model=MODEL, input="Answer in JSON.", text={"format": fmt}, max_output_tokens=300,
                                **GREEDY)
    want = _constrained(library, {"messages": [{"role": "user", "content": "Answer in JSON."}]}, {"json": SCHEMA},
                        max_tokens=300, **GREEDY)
    assert r.status == "completed" and r.output_text == want.text
    _is_answer(r.output_text)
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"


def test_logit_bias_bans_and_forces_tokens(client, library):
    """OpenAI's logit_bias: -100 on the greedy first token makes the runner-up first (the library's
    own logprobs say which), +100 forces a token, in chat and completions alike; a token id past
    the vocabulary is a 400."""
    first = _want(library, PROMPT, max_tokens=1, logprobs=2, **GREEDY)
    rank = {lp.rank: token for token, lp in first.logprobs[0].items()}
    top, second = rank[1], rank[2]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logit_bias={str(top): -100}, **GREEDY)
    assert library.tokenizer.encode(r.choices[0].text) == [second]
    forced = library.tokenizer.encode(" sky")[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logit_bias={str(forced): 100},
                                  temperature=1.0, seed=1)
    assert library.tokenizer.encode(r.choices[0].text) == [forced] * 3
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       logit_bias={str(forced): 100}, **GREEDY)
    assert r.choices[0].message.content == library.tokenizer.decode([forced] * 3)
    with pytest.raises(openai.BadRequestError, match="vocab_size"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logit_bias={"10000000": 5})


def test_a_stage_refused_grammar_is_a_400_and_the_server_serves_on(server, client):
    """A grammar only the stage sees (through sampling_params_list) is refused by the stage: a 400
    naming the problem, and the next request is served."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "sampling_params_list": [{"structured_outputs": {"regex": "(("}}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=_auth(), timeout=60)
    assert r.status_code == 400 and "regex is not valid" in r.json()["error"]["message"], r.text
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **GREEDY).choices[0].text


# ------------------------------------------------------------------------------ tokenize / detokenize

def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, headers=_auth(), timeout=60)


def test_tokenize_counts_what_a_request_takes(server, library):
    """vLLM's /tokenize: a text's ids are the tokenizer's; a chat's are the prompt ids the library's
    request with the same messages has, an image's placeholders included; /detokenize gives the
    text back; the model card says max_model_len."""
    r = _post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    ids = library.tokenizer.encode(PROMPT)
    assert r["tokens"] == ids and r["count"] == len(ids)
    assert r["token_strs"] == library.tokenizer.convert_ids_to_tokens(ids)
    max_len = library.pipeline.stage("thinker").max_model_len
    assert r["max_model_len"] == max_len
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url()}},
                                         {"type": "text", "text": "What is it?"}]}]
    r = _post(server, "/tokenize", {"messages": msgs}).json()
    want = _chat(library, [{"role": "user", "content": [{"type": "image", "image": _png_url()},
                                                        {"type": "text", "text": "What is it?"}]}], max_tokens=1)
    assert r["tokens"] == list(want.prompt_token_ids) and r["token_strs"] is None
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": PROMPT}
    assert httpx.get(f"{server.url}/v1/models/{MODEL}", headers=_auth(), timeout=30).json()["max_model_len"] == max_len


def test_chat_template_kwargs_reach_the_template(server, client, library):
    """vLLM's chat_template_kwargs: the built-in template's add_vision_id labels the picture; a
    chat's prompt and /tokenize's are the library's prompt with the same variables."""
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url()}},
                                         {"type": "text", "text": "What is it?"}]}]
    labelled = {"add_vision_id": True}
    want = library.processor.process({"messages": msgs, "chat_template_kwargs": labelled}).prompt_token_ids
    plain = library.processor.process({"messages": msgs}).prompt_token_ids
    assert "Picture 1: " in library.tokenizer.decode(want.tolist()) and len(want) > len(plain)
    r = _post(server, "/tokenize", {"messages": msgs, "chat_template_kwargs": labelled}).json()
    assert r["tokens"] == want.tolist()
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, extra_body={
        "chat_template_kwargs": labelled})
    assert r.usage.prompt_tokens == len(want)


@pytest.mark.parametrize("path, body, param, code", [
    ("/tokenize", {}, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"add_vision_id": True}}, "chat_template_kwargs",
     "invalid_value"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs", "invalid_value"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "invalid_value"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_generation_prompt": False},
     "add_generation_prompt", "unsupported_parameter"),
    ("/tokenize", {"prompt": "word " * 600}, "prompt", "context_length_exceeded"),
    ("/tokenize", {"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "invalid_value"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "tools": [{"type": "function"}]}, "tools",
     "invalid_value"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]", "invalid_value"),
])
def test_tokenize_400s_name_the_field(server, path, body, param, code):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err


# ------------------------------------------------------------------------------ function calling

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Lyon"]}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _streamed_calls(stream) -> tuple[str, list, str]:
    """A streamed chat reply's content, tool calls (OpenAI's deltas put together) and finish reason.
    Each call's deltas are as OpenAI streams them: the first names it (its id, type and name, no
    arguments yet), the next carry only arguments."""
    content, calls, reason = "", {}, None
    for c in stream:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            if t.index not in calls:
                assert t.id.startswith("call_") and t.type == "function" and t.function.name, t
                assert t.function.arguments == "", t
            else:
                assert t.id is None and t.function.name is None and t.function.arguments, t
            got = calls.setdefault(t.index, {"id": t.id, "name": "", "arguments": ""})
            got["name"] += t.function.name or ""
            got["arguments"] += t.function.arguments or ""
        reason = c.choices[0].finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("choice, parallel", [({"type": "function", "function": {"name": "get_weather"}}, None),
                                              ("required", False)])
def test_a_required_tool_call_equals_the_library(client, library, choice, parallel):
    """tool_choice naming a function, or "required": the reply is a call (the random model held to
    Qwen's format and the tool's schema by the grammar), in message.tool_calls with finish_reason
    "tool_calls", the library's reply under the same grammar read the same way; streamed alike."""
    from omni_jax import StructuredOutputs, call_grammar, read_tool_calls

    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOW], tool_choice=choice,
                                       max_tokens=60, **extra, **GREEDY)
    chosen = [WEATHER] if isinstance(choice, dict) else [WEATHER, NOW]
    want = library.generate({"messages": ASK, "tools": [WEATHER, NOW]}, SamplingParams(
        max_tokens=60, structured_outputs=StructuredOutputs(grammar=call_grammar(chosen, parallel=False)), **GREEDY),
        output_modalities=["text"], use_tqdm=False)[0]
    content, calls = read_tool_calls(want.text)
    assert content == "" and len(calls) == 1, want.text
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [(c.type, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("function", calls[0].name, calls[0].arguments)]
    assert message.tool_calls[0].id.startswith("call_")
    if isinstance(choice, dict):
        assert json.loads(calls[0].arguments)["city"] in ("Paris", "Lyon")
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOW], tool_choice=choice,
                                              max_tokens=60, stream=True, **extra, **GREEDY)
    content, got, reason = _streamed_calls(streamed)
    assert (content, reason) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in got] == [(calls[0].name, calls[0].arguments)]


def test_each_of_n_choices_makes_its_own_call(client):
    """n sampled choices under a named tool: each its own call (its own id), fitting the schema."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], n=3, seed=5, temperature=1.0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=60)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        assert json.loads(c.message.tool_calls[0].function.arguments)["city"] in ("Paris", "Lyon")
    assert len({c.message.tool_calls[0].id for c in r.choices}) == 3


def test_auto_reads_the_calls_a_reply_makes(client):
    """tool_choice "auto": words, then calls, read out of the reply whole and streamed. (The random
    model is made to write them, tags as the tokens they are, by a grammar; it would not otherwise.)"""
    calls = ['\n{"name": "now", "arguments": {}}\n', '\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n']
    said = "Sure.\n" + "\n".join(f"<tool_call>{c}</tool_call>" for c in calls)
    extra = _call_grammar_extra(calls)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOW], max_tokens=200,
                                       extra_body=extra, **GREEDY)
    message = r.choices[0].message
    assert message.content == "Sure." and r.choices[0].finish_reason == "tool_calls", message
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("now", "{}"), ("get_weather", '{"city": "Lyon"}')]
    assert len({c.id for c in message.tool_calls}) == 2
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOW], max_tokens=200,
                                              extra_body=extra, stream=True, **GREEDY)
    content, calls, reason = _streamed_calls(streamed)
    assert (content, reason) == ("Sure.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("now", "{}"), ("get_weather", '{"city": "Lyon"}')]
    # tool_choice "none": the tools are left out of the prompt and nothing is read as a call
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOW], tool_choice="none",
                                       max_tokens=200, extra_body=extra, **GREEDY)
    assert r.choices[0].message.content == said and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=1, **GREEDY).usage.prompt_tokens


def test_a_conversation_with_calls_and_results_is_the_library_prompt(server, client, library):
    """An assistant turn's calls and the tool messages with their results make the prompt the
    library makes of the same messages: same prompt tokens, same greedy reply."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20 C, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=6, **GREEDY)
    lib_history = [m if m["role"] != "assistant" else {k: v for k, v in m.items() if k != "content"} for m in history]
    want = _want(library, {"messages": lib_history, "tools": [WEATHER]}, max_tokens=6, **GREEDY)
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.choices[0].message.content == want.text
    ids = list(want.prompt_token_ids)
    assert library.tokenizer.decode(ids).count("<tool_response>\n20 C, sunny\n</tool_response>") == 1
    # /tokenize counts the same prompt
    assert _post(server, "/tokenize", {"messages": history, "tools": [WEATHER]}).json()["tokens"] == ids


def _flat(tool: dict) -> dict:
    """A chat completions tool in the Responses API's shape."""
    return {"type": "function", **tool["function"]}


def _call_grammar_extra(calls: list[str], words: str = "Sure.") -> dict:
    """vLLM's structured_outputs extra that makes the random model say `words`, then make these
    calls (each a block's JSON with its newlines), tags as the tokens they are."""
    parts = [json.dumps(words), *(f"<tool_call> {json.dumps(c)} </tool_call>" for c in calls)]
    return {"structured_outputs": {"grammar": "start: " + ' "\\n" '.join(parts)}}


def test_a_response_calls_a_function(client, library):
    """The Responses API: a named function's call is a function_call output item (no message
    item), the library's reply under the same grammar; streamed, its events in OpenAI's order,
    the completed response's output the same."""
    from omni_jax import StructuredOutputs, call_grammar, read_tool_calls

    tools = [_flat(WEATHER), _flat(NOW)]
    choice = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model=MODEL, input=ASK[0]["content"], tools=tools, tool_choice=choice,
                                max_output_tokens=60, **GREEDY)
    want = library.generate({"messages": ASK, "tools": [WEATHER, NOW]}, SamplingParams(
        max_tokens=60, structured_outputs=StructuredOutputs(grammar=call_grammar([WEATHER], parallel=False)), **GREEDY),
        output_modalities=["text"], use_tqdm=False)[0]
    _, calls = read_tool_calls(want.text)
    assert r.status == "completed" and r.output_text == "" and len(r.output) == 1
    item = r.output[0]
    assert (item.type, item.name, item.arguments, item.status) == ("function_call", "get_weather",
                                                                   calls[0].arguments, "completed")
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    assert [t.name for t in r.tools] == ["get_weather", "now"] and r.tool_choice.name == "get_weather"
    events = list(client.responses.create(model=MODEL, input=ASK[0]["content"], tools=tools, tool_choice=choice,
                                          max_output_tokens=60, stream=True, **GREEDY))
    kinds = [e.type for e in events]  # the arguments in one delta or more, as they were written
    assert [k for i, k in enumerate(kinds) if k != kinds[i - 1]] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == events[-3].arguments == calls[0].arguments
    done = events[-1].response
    assert [(o.type, o.name, o.arguments) for o in done.output] == [("function_call", "get_weather", calls[0].arguments)]


def test_a_response_with_words_and_calls_and_the_next_turn(client, library):
    """Words and two calls (tool_choice auto): the message item, then a function_call item per
    call, streamed in that order at their output indexes. The next turn, by previous_response_id
    with the calls' outputs or statelessly with the calls given back, is the library's prompt of
    the whole conversation."""
    calls = ['\n{"name": "now", "arguments": {}}\n', '\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n']
    extra = _call_grammar_extra(calls)
    tools = [_flat(WEATHER), _flat(NOW)]
    r = client.responses.create(model=MODEL, input=ASK[0]["content"], tools=tools, max_output_tokens=200,
                                extra_body=extra, **GREEDY)
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == "Sure."
    assert [(o.name, o.arguments) for o in r.output[1:]] == [("now", "{}"), ("get_weather", '{"city": "Lyon"}')]
    events = list(client.responses.create(model=MODEL, input=ASK[0]["content"], tools=tools, max_output_tokens=200,
                                          extra_body=extra, stream=True, **GREEDY))
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "message"), (1, "function_call"), (2, "function_call")]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sure."
    assert [o.type for o in events[-1].response.output] == ["message", "function_call", "function_call"]
    # the next turn: the calls' outputs
    outputs = [{"type": "function_call_output", "call_id": o.call_id, "output": out}
               for o, out in zip(r.output[1:], ["noon", "20 C"])]
    nxt = client.responses.create(model=MODEL, input=outputs, previous_response_id=r.id, tools=tools,
                                  max_output_tokens=4, **GREEDY)
    history = ASK + [
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"type": "function", "function": {"name": "now", "arguments": "{}"}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "content": "noon"}, {"role": "tool", "content": "20 C"}]
    want = _want(library, {"messages": history, "tools": [WEATHER, NOW]}, max_tokens=4, **GREEDY)
    assert nxt.usage.input_tokens == len(want.prompt_token_ids) and nxt.output_text == want.text
    # statelessly: the calls given back as input items
    given = [*ASK, {"role": "assistant", "content": "Sure."},
             *({"type": "function_call", "call_id": o.call_id, "name": o.name, "arguments": o.arguments}
               for o in r.output[1:]), *outputs]
    again = client.responses.create(model=MODEL, input=given, tools=tools, max_output_tokens=4, **GREEDY)
    assert again.usage.input_tokens == len(want.prompt_token_ids) and again.output_text == want.text


def test_a_reply_cut_inside_a_call_keeps_the_call_written_so_far(client):
    """max_output_tokens ending a reply in the middle of a call's arguments: the call is kept, with
    the arguments written (as OpenAI keeps a cut call): chat's finish_reason "length", the Responses
    API's item "incomplete"; streamed, the same call and arguments."""
    args = '{"note": "' + "word " * 60 + '"}'
    block = '\n{"name": "now", "arguments": ' + args + '}\n'
    grammar = f"start: <tool_call> {json.dumps(block)} </tool_call>"
    extra = {"structured_outputs": {"grammar": grammar}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, NOW], max_tokens=30,
                                       extra_body=extra, **GREEDY)
    call = r.choices[0].message.tool_calls[0].function
    assert r.choices[0].finish_reason == "length" and call.name == "now"
    assert args.startswith(call.arguments) and len(call.arguments) > len('{"note": "word')
    content, calls, reason = _streamed_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, NOW], max_tokens=30, extra_body=extra, stream=True, **GREEDY))
    assert (content, reason, [(c["name"], c["arguments"]) for c in calls]) == ("", "length", [("now", call.arguments)])
    ask = dict(model=MODEL, input=ASK[0]["content"], tools=[_flat(WEATHER), _flat(NOW)], max_output_tokens=30,
               extra_body=extra, **GREEDY)
    resp = client.responses.create(**ask)
    assert resp.status == "incomplete" and [(o.type, o.status, o.arguments) for o in resp.output] == [
        ("function_call", "incomplete", call.arguments)]
    events = list(client.responses.create(**ask, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"


def test_a_response_whose_words_follow_its_calls(client):
    """Words after the calls (or a call cut by max_output_tokens, which stays words): the message
    item comes after the calls, whole as streamed."""
    call = '\n{"name": "now", "arguments": {}}\n'
    tools = [_flat(WEATHER), _flat(NOW)]
    for words, limit, status in [("Then more.", 200, "completed"), ("Then a long word list " * 20, 30, "incomplete")]:
        grammar = f'start: <tool_call> {json.dumps(call)} </tool_call> "\\n" {json.dumps(words)}'
        ask = dict(model=MODEL, input=ASK[0]["content"], tools=tools, max_output_tokens=limit,
                   extra_body={"structured_outputs": {"grammar": grammar}}, **GREEDY)
        r = client.responses.create(**ask)
        assert r.status == status and [o.type for o in r.output] == ["function_call", "message"]
        assert r.output_text == words[:len(r.output_text)] and r.output_text
        events = list(client.responses.create(**ask, stream=True))
        added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
        assert added == [(0, "function_call"), (1, "message")]
        done = events[-1].response
        assert [o.type for o in done.output] == ["function_call", "message"] and done.output_text == r.output_text
