"""End to end over HTTP: the real SmolLM2 core behind ``flare-serve``, driven by the
official ``openai`` client (and raw ``httpx`` for malformed requests)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from flare.core.manifest import load_manifest
from flare.server.template import ChatTemplate
from flare.server.text import TextCodec

MODEL = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def client(smol_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def frontend(smol_core):
    m = load_manifest(smol_core)
    tmpl = ChatTemplate((smol_core / m.frontend.chat_template).read_text(), dict(m.frontend.special_tokens))
    return tmpl, TextCodec(str(smol_core / m.frontend.tokenizer))


def prompt_len(frontend, messages) -> int:
    tmpl, codec = frontend
    return len(codec.encode(tmpl.render(messages, add_generation_prompt=True), add_special_tokens=False))


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def chat_stream(client, messages, **kw) -> tuple[str, str | None, object, int]:
    """(text, finish_reason, usage, number of frames with a finish_reason)."""
    text, finish, usage, finishes, first_role = [], None, None, 0, None
    for i, chunk in enumerate(chat(client, messages, stream=True, stream_options={"include_usage": True}, **kw)):
        assert chunk.model == MODEL
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        (c,) = chunk.choices
        if i == 0:
            first_role = c.delta.role
        if c.delta.content:
            text.append(c.delta.content)
        if c.finish_reason is not None:
            finish = c.finish_reason
            finishes += 1
    assert first_role == "assistant"
    return "".join(text), finish, usage, finishes


# ---------------------------------------------------------------------------
# (a) a real answer


def test_paris_non_streaming_and_streaming(client, frontend):
    r = chat(client, FRANCE, seed=0, max_tokens=32)
    (choice,) = r.choices
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert r.model == MODEL and r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == prompt_len(frontend, FRANCE)
    text, finish, usage, finishes = chat_stream(client, FRANCE, seed=0, max_tokens=32)
    assert "Paris" in text
    # Same seed, same stream: the assembled deltas are the non-streaming text exactly.
    assert (text, finish, finishes) == (choice.message.content, "stop", 1)
    assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)


def test_usage_counts_every_sampled_token(client, frontend):
    """completion_tokens counts every sampled token, the EOS that ended the answer
    included: with max_tokens one short of it the same stream stops at ``length``
    with the same text, and with exactly that many it stops at ``stop``."""
    _, codec = frontend
    r = chat(client, FRANCE, seed=0, max_tokens=32)
    text, n = r.choices[0].message.content, r.usage.completion_tokens
    assert r.choices[0].finish_reason == "stop"
    assert n == len(codec.encode(text, add_special_tokens=False)) + 1  # + <|im_end|>
    assert r.usage.total_tokens == r.usage.prompt_tokens + n
    short = chat(client, FRANCE, seed=0, max_tokens=n - 1)
    assert (short.choices[0].message.content, short.choices[0].finish_reason) == (text, "length")
    assert short.usage.completion_tokens == n - 1
    exact = chat(client, FRANCE, seed=0, max_tokens=n)
    assert (exact.choices[0].message.content, exact.choices[0].finish_reason) == (text, "stop")
    assert exact.usage.completion_tokens == n
    shorter = chat(client, FRANCE, seed=0, max_tokens=3)
    assert shorter.choices[0].finish_reason == "length" and shorter.usage.completion_tokens == 3
    assert text.startswith(shorter.choices[0].message.content) and len(shorter.choices[0].message.content) < len(text)


def test_stop_string(client):
    """A stop string ends the answer before it, streaming or not; the tokens sampled up
    to the one that completed it are counted."""
    full = chat(client, FRANCE, seed=0, max_tokens=32)
    text = full.choices[0].message.content
    assert " Paris" in text
    before = text[: text.index(" Paris")]
    r = chat(client, FRANCE, seed=0, max_tokens=32, stop=[" Paris"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (before, "stop")
    assert r.usage.completion_tokens < full.usage.completion_tokens
    streamed, finish, usage, _ = chat_stream(client, FRANCE, seed=0, max_tokens=32, stop=["zzz", " Paris"])
    assert (streamed, finish, usage.completion_tokens) == (before, "stop", r.usage.completion_tokens)


# ---------------------------------------------------------------------------
# (b) concurrency


STORY_PROMPTS = [
    [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}],
    [{"role": "system", "content": "You are a poet."},
     {"role": "user", "content": "Describe the sea at night in detail."}],
    [{"role": "user", "content": "Explain in detail how a bicycle works, part by part."}],
    [{"role": "user", "content": "Tell me everything you know about the history of Rome. 🏛️"}],
]


def run_together(fns) -> list:
    """Run callables at the same moment on their own threads."""
    barrier = threading.Barrier(len(fns))

    def go(fn):
        barrier.wait()
        return fn()

    with ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(go, fns))


def test_four_concurrent_streams(client, frontend):
    max_tokens = 20
    results = run_together([
        (lambda p=p, i=i: chat_stream(client, p, seed=100 + i, max_tokens=max_tokens, temperature=0.8))
        for i, p in enumerate(STORY_PROMPTS)
    ])
    for p, (text, finish, usage, finishes) in zip(STORY_PROMPTS, results):
        assert finishes == 1 and finish in ("stop", "length")
        assert usage.prompt_tokens == prompt_len(frontend, p)
        if finish == "length":
            assert usage.completion_tokens == max_tokens
        else:
            assert usage.completion_tokens < max_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert text
    assert [r[1] for r in results].count("length") >= 3  # stories do not end in 20 tokens
    # Each stream is the one its seed gives when the request runs alone.
    for i, (p, (text, finish, usage, _)) in enumerate(zip(STORY_PROMPTS, results)):
        alone = chat(client, p, seed=100 + i, max_tokens=max_tokens, temperature=0.8)
        assert (alone.choices[0].message.content, alone.choices[0].finish_reason) == (text, finish)
        assert alone.usage.completion_tokens == usage.completion_tokens


def test_abandoned_requests_free_their_slots(smol_server, client):
    """Four clients that leave (two streams closed after a few chunks, two non-streaming
    requests timed out) each asked for 1,500 tokens, minutes of work holding all four
    slots. Their departures cancel them: four new requests then complete at once."""
    url = smol_server.url + "/v1/chat/completions"
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long essay about rivers."}],
            "max_tokens": 1500, "temperature": 1.0, "ignore_eos": True}
    for _ in range(2):
        with httpx.stream("POST", url, json={**long, "stream": True}, timeout=60) as s:
            lines = s.iter_lines()
            assert [next(lines) for _ in range(4)][0].startswith("data: ")
    for _ in range(2):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=long, timeout=1.5)
    quick = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    results = run_together([(lambda i=i: chat(quick, FRANCE, seed=i, max_tokens=4)) for i in range(4)])
    assert [r.choices[0].finish_reason for r in results] == ["length"] * 4


def test_batch_independence(client):
    """Same seed and prompt: identical output alone and beside three other requests."""
    target = [{"role": "user", "content": "Invent a name for a new colour and describe it."}]
    others = [[{"role": "user", "content": f"Give me {k} reasons to learn the piano."}] for k in (3, 5, 7)]
    texts = set()
    for seed in (11, 22):
        kw = dict(seed=seed, max_tokens=24, temperature=1.0)
        alone = chat(client, target, **kw)
        together = run_together([lambda: chat(client, target, **kw)] + [
            (lambda o=o, j=j: chat(client, o, seed=seed * 10 + j, max_tokens=24, temperature=1.0))
            for j, o in enumerate(others)
        ])
        assert together[0].choices[0].message.content == alone.choices[0].message.content, seed
        assert together[0].usage.completion_tokens == alone.usage.completion_tokens
        texts.add(alone.choices[0].message.content)
    # And seeds matter: two seeds at T = 1 do not give the same text.
    assert len(texts) == 2


# ---------------------------------------------------------------------------
# (d) text completions, (e) models and health


def test_completions_string_and_token_prompts(client, frontend):
    _, codec = frontend
    prompt = "The three primary colours are"
    ids = codec.encode(prompt, add_special_tokens=True)
    a = client.completions.create(model=MODEL, prompt=prompt, seed=5, max_tokens=12, temperature=0.7)
    b = client.completions.create(model=MODEL, prompt=ids, seed=5, max_tokens=12, temperature=0.7)
    assert a.object == "text_completion" and a.id.startswith("cmpl-")
    assert a.choices[0].text and a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == len(ids)
    assert a.usage.completion_tokens == b.usage.completion_tokens
    if a.choices[0].finish_reason == "length":
        assert a.usage.completion_tokens == 12
    # A list of two prompts: one choice each, in order, prompt tokens summed; the
    # same two as token lists give the same texts.
    other = "Once upon a time"
    two = client.completions.create(model=MODEL, prompt=[prompt, other], seed=5, max_tokens=4)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.prompt_tokens == len(ids) + len(codec.encode(other, add_special_tokens=True))
    two_ids = client.completions.create(model=MODEL, prompt=[ids, codec.encode(other, add_special_tokens=True)],
                                        seed=5, max_tokens=4)
    assert [c.text for c in two_ids.choices] == [c.text for c in two.choices]


def test_completions_default_to_16_tokens_and_chat_to_the_context(client, frontend):
    """OpenAI's legacy Completions API generates 16 tokens without max_tokens; chat runs to
    the context limit (or a stop). ignore_eos makes both run their full budget; near the
    context limit the completions default shrinks to what is left instead of failing."""
    a = client.completions.create(model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert a.usage.completion_tokens == 16 and a.choices[0].finish_reason == "length"
    # A long message leaves a short run to the limit (about 80 tokens).
    long = [{"role": "user", "content": "word " * 1950}]
    c = client.chat.completions.create(model=MODEL, messages=long, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 2048 - c.usage.prompt_tokens and c.choices[0].finish_reason == "length"
    # A 2,040-token prompt that starts with the chat's (its prefix served from the cache: one long
    # prefill in this test, not two).
    tmpl, codec = frontend
    ids = codec.encode(tmpl.render(long, add_generation_prompt=True), add_special_tokens=False)
    assert len(ids) == c.usage.prompt_tokens
    b = client.completions.create(model=MODEL, prompt=ids + list(range(1000, 1000 + 2040 - len(ids))),
                                  extra_body={"ignore_eos": True})
    assert b.usage.prompt_tokens == 2040 and b.usage.completion_tokens == 8  # what a 2,048 context leaves


def test_models_and_health(smol_server):
    r = httpx.get(smol_server.url + "/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == 2048
    h = httpx.get(smol_server.url + "/health")
    assert (h.status_code, h.json()) == (200, {"status": "ok"})


# ---------------------------------------------------------------------------
# (f) bad requests


def post(url: str, path: str, body, raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def good(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}


def assert_error(r: httpx.Response, status: int, *, code: str | None = None, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["error"]
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code
    if param != "any":
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    "case,path,body,raw,status,code,param",
    [
        ("malformed_json", "/v1/chat/completions", None, b'{"model": "x", "messages": [', 400, "invalid_json", None),
        ("not_an_object", "/v1/chat/completions", [1, 2], None, 400, "invalid_request", "any"),
        ("unknown_model", "/v1/chat/completions", good(model="gpt-4o"), None, 404, "model_not_found", "model"),
        ("empty_messages", "/v1/chat/completions", good(messages=[]), None, 400, "empty_messages", "messages"),
        ("over_context", "/v1/chat/completions",
         good(messages=[{"role": "user", "content": "word " * 2100}]), None, 400, "context_length_exceeded",
         "messages"),
        ("prompt_plus_max_tokens_over_context", "/v1/chat/completions", good(max_tokens=2040), None, 400,
         "context_length_exceeded", "max_tokens"),
        # The engine names its own fields (prompt, max_tokens); each protocol answers with its own.
        ("completions_over_context", "/v1/completions", {"model": MODEL, "prompt": "word " * 2100, "max_tokens": 2},
         None, 400, "context_length_exceeded", "prompt"),
        ("responses_over_context", "/v1/responses", {"model": MODEL, "input": "word " * 2100}, None, 400,
         "context_length_exceeded", "input"),
        ("responses_empty_input", "/v1/responses", {"model": MODEL, "input": []}, None, 400, "empty_messages",
         "input"),
        ("responses_max_output_tokens_over_context", "/v1/responses",
         {"model": MODEL, "input": "Hi", "max_output_tokens": 2040}, None, 400, "context_length_exceeded",
         "max_output_tokens"),
        ("max_tokens_zero", "/v1/chat/completions", good(max_tokens=0), None, 400, None, "max_tokens"),
        ("max_tokens_negative", "/v1/chat/completions", good(max_tokens=-1), None, 400, None, "max_tokens"),
        ("temperature_zero", "/v1/chat/completions", good(temperature=0), None, 400, "invalid_temperature",
         "temperature"),
        ("unknown_field", "/v1/chat/completions", good(frobnicate=True), None, 400, "invalid_request", "any"),
        ("wrong_type", "/v1/chat/completions", good(max_tokens="ten"), None, 400, "invalid_request", "max_tokens"),
        ("wrong_role", "/v1/chat/completions", good(messages=[{"role": "robot", "content": "x"}]), None, 400,
         "invalid_request", "any"),
        ("n_zero", "/v1/chat/completions", good(n=0), None, 400, None, "n"),
        ("too_many_stops", "/v1/chat/completions", good(stop=[f"s{i}" for i in range(17)]), None, 400, None, "stop"),
        ("empty_stop", "/v1/chat/completions", good(stop=[""]), None, 400, None, "stop"),
        ("top_logprobs_over_the_cap", "/v1/chat/completions", good(logprobs=True, top_logprobs=21), None, 400,
         "invalid_request", "top_logprobs"),
        ("top_logprobs_without_logprobs", "/v1/chat/completions", good(top_logprobs=2), None, 400, None,
         "top_logprobs"),
        ("logprobs_not_boolean", "/v1/chat/completions", good(logprobs=3), None, 400, None, "logprobs"),
        ("completion_logprobs_over_the_cap", "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21},
         None, 400, None, "logprobs"),
        ("completion_logprobs_negative", "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": -2}, None,
         400, None, "logprobs"),
        ("completion_max_tokens_zero_without_echo", "/v1/completions", {"model": MODEL, "prompt": "x",
                                                                        "max_tokens": 0}, None, 400, None,
         "max_tokens"),
        ("completion_top_logprobs", "/v1/completions", {"model": MODEL, "prompt": "x", "top_logprobs": 2}, None,
         400, None, "top_logprobs"),
        ("empty_prompt", "/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 2}, None, 400,
         "empty_prompt", "prompt"),
        ("mixed_prompt_list", "/v1/completions", {"model": MODEL, "prompt": [5, "x"], "max_tokens": 2}, None, 400,
         None, "prompt"),
        ("bool_prompt", "/v1/completions", {"model": MODEL, "prompt": [True], "max_tokens": 2}, None, 400,
         "invalid_request", "prompt[0]"),
        ("token_outside_vocab", "/v1/completions", {"model": MODEL, "prompt": [5, 49152], "max_tokens": 2}, None,
         400, None, "prompt"),
        ("unknown_route", "/v1/embeddings", {"model": MODEL, "input": "x"}, None, 404, "route_not_found", None),
        ("reserved_template_variable", "/v1/chat/completions",
         good(chat_template_kwargs={"messages": []}), None, 400, None, "chat_template_kwargs"),
    ],
)
def test_bad_requests(smol_server, case, path, body, raw, status, code, param):
    r = post(smol_server.url, path, body, raw)
    assert_error(r, status, code=code, param=param)
    # The server keeps serving.
    ok = post(smol_server.url, "/v1/chat/completions", good())
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_wrong_method(smol_server):
    r = httpx.get(smol_server.url + "/v1/chat/completions")
    err = assert_error(r, 405, code="method_not_allowed")
    assert "GET" in err["message"]


def test_out_of_range_values_clamp(client, smol_server):
    """temperature 5.0 clamps to the core's 2.0 and top_p 7 to 1.0: the outputs are
    those of the clamped values, token for token."""
    msgs = [{"role": "user", "content": "Say something surprising."}]
    hot = chat(client, msgs, seed=3, max_tokens=8, temperature=5.0)
    two = chat(client, msgs, seed=3, max_tokens=8, temperature=2.0)
    assert hot.choices[0].message.content == two.choices[0].message.content
    wide = chat(client, msgs, seed=4, max_tokens=8, temperature=1.0, top_p=7)
    one = chat(client, msgs, seed=4, max_tokens=8, temperature=1.0, top_p=1.0)
    assert wide.choices[0].message.content == one.choices[0].message.content
    # Raw status for the clamped requests is 200.
    assert post(smol_server.url, "/v1/chat/completions", good(temperature=5.0)).status_code == 200
    assert post(smol_server.url, "/v1/chat/completions", good(top_p=7)).status_code == 200


def test_good_request_after_errors(client):
    r = chat(client, FRANCE, seed=0, max_tokens=32)
    assert "Paris" in r.choices[0].message.content


def test_template_variables_the_server_does_not_reserve_are_passed(smol_server):
    # Names that are parameters of the server's own helpers are ordinary template variables.
    r = post(smol_server.url, "/v1/chat/completions", good(chat_template_kwargs={"rendered": 1, "template": 2}))
    assert r.status_code == 200, r.text


def nested(levels: int) -> str:
    """A JSON schema nested ``levels`` objects deep, as text (``json.dumps`` itself stops
    near 1,000 levels)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


def test_mistyped_input_item_is_a_400_naming_the_field(smol_server):
    r = post(smol_server.url, "/v1/responses", {"model": MODEL, "input": [{"type": "reasoning", "content": 5}]})
    assert_error(r, 400, code="invalid_request", param="input[0].content")


def test_schema_nested_too_deep_is_a_400_naming_the_field(smol_server):
    raw = ('{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "response_format": '
           '{"type": "json_schema", "json_schema": {"name": "d", "schema": %s}}}' % (MODEL, nested(5000))).encode()
    r = post(smol_server.url, "/v1/chat/completions", None, raw)
    assert_error(r, 400, code="grammar_too_complex", param="response_format.json_schema.schema")


DEEP_CASES = [
    # (path, body text with DEEP where the nesting goes, status code or the Messages message, param)
    ("/v1/chat/completions",
     '{"model": "%s", "messages": [{"role": "user", "content": "[{\\"quoted\\\\\\" ]] }"}], "tools": ['
     '{"type": "function", "function": {"name": "a", "description": "] } [", "parameters": {"type": "object"}}}, '
     '{"type": "function", "function": {"name": "b", "parameters": DEEP}}]}', "grammar_too_complex",
     "tools[1].function.parameters"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [], "chat_template_kwargs": {"x": [1, DEEP]}}',
     "nesting_too_deep", "chat_template_kwargs"),
    ("/v1/completions", '{"model": "%s", "prompt": [[1, 2], DEEP]}', "nesting_too_deep", "prompt[1]"),
    ("/v1/responses", '{"model": "%s", "input": "x", "text": {"format": {"type": "json_schema", "schema": DEEP}}}',
     "grammar_too_complex", "text.format.schema"),
    ("/v1/responses", '{"model": "%s", "input": [{"role": "user", "content": "x"}, DEEP]}', "nesting_too_deep",
     "input[1]"),
    ("/v1/messages", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], '
     '"output_config": {"format": {"type": "json_schema", "schema": DEEP}}}',
     "output_config.format.schema is nested more than 48 levels deep", None),
    ("/v1/messages", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "assistant", "content": ['
     '{"type": "text", "text": "{{"}, {"type": "tool_use", "id": "t", "name": "f", "input": {"q": DEEP}}]}]}',
     "messages[0].content[1].input is nested more than 128 levels deep", None),
]


@pytest.mark.parametrize("path,template,expected,param", DEEP_CASES, ids=[
    "chat-tool-parameters", "chat-template-kwargs", "completions-prompt", "responses-text-format", "responses-input",
    "messages-output-config", "messages-tool-use-input"])
def test_nesting_is_bounded_on_every_endpoint(smol_server, path, template, expected, param):
    """Nesting past the bound anywhere is a 400 before decoding, naming the field (in a
    JSON schema, as a grammar too complex); brackets and escaped quotes inside strings
    before it do not count."""
    raw = (template % MODEL).replace("DEEP", nested(3000)).encode()
    r = post(smol_server.url, path, None, raw)
    if path == "/v1/messages":
        assert r.status_code == 400 and r.json()["error"] == {"type": "invalid_request_error", "message": expected}
    else:
        assert_error(r, 400, code=expected, param=param)
    ok = post(smol_server.url, path, None, (template % MODEL).replace("DEEP", nested(2)).encode())
    assert ok.status_code < 500, ok.text


def test_responses_and_messages_items_are_typed(smol_server):
    url = smol_server.url
    for items, param, code in [
        ([{"type": "item_reference", "id": "msg_1"}], "input[0].type", "unsupported"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}], "input[0].content[0]",
         "unsupported"),
        ([{"role": "user", "content": [{"type": "input_text", "text": 3}]}], "input[0].content[0].text",
         "invalid_request"),
        ([{"type": "function_call", "call_id": "c"}], "input[0]", "invalid_request"),  # no name
        ([{"role": "robot", "content": "x"}], "input[0].role", "invalid_request"),
    ]:
        assert_error(post(url, "/v1/responses", {"model": MODEL, "input": items}), 400, code=code, param=param)
    # The shapes the SDKs send back are accepted: an item without "type", output items, reasoning.
    ok = post(url, "/v1/responses", {"model": MODEL, "max_output_tokens": 2, "input": [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Again"}]}]})
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete"), ok.text
    for block, message in [({"type": "image", "source": {"type": "url", "url": "x"}}, "not supported"),
                           ({"type": "redacted_thinking", "data": "x"}, "not supported"),
                           ({"type": "tool_use", "id": "t"}, "missing required field `name`")]:
        r = post(url, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": [block]}]})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    ok = post(url, "/v1/messages", {"model": MODEL, "max_tokens": 2, "system": [{"type": "text", "text": "Be brief."}],
                                    "messages": [{"role": "user", "content": [
                                        {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
                                        {"role": "assistant", "content": [
                                            {"type": "thinking", "thinking": "hm", "signature": "sig"},
                                            {"type": "text", "text": "Hello"}]},
                                        {"role": "user", "content": "Again"}]})
    assert ok.status_code == 200 and ok.json()["stop_reason"] in ("end_turn", "max_tokens"), ok.text
