"""Property test of the request schemas: whatever JSON a client sends to the four
generation endpoints, the server answers below 500, with the protocol's error envelope
whenever it refuses (OpenAI's, Anthropic's for Messages), and keeps serving. Values
nested deeper than any body may be (spliced in as text: ``json`` cannot write them)
are refused with a 400."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import running_server

MODEL = "llama-tiny"

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=8)
# A marker that ``encode`` replaces with arrays or objects nested that many levels.
deep = st.builds(lambda n, bracket: f"__deep{bracket}{n}__", st.integers(130, 5000), st.sampled_from("[{"))
DEEP = re.compile(r'"__deep([\[{])(\d+)__"')
free = st.one_of(json_values, json_values, json_values, deep)  # free JSON: schemas, arguments, template variables
schema = st.one_of(st.just({"type": "object"}), st.fixed_dictionaries(
    {"type": st.sampled_from(["object", "string", "array", 3])},
    optional={"properties": st.dictionaries(st.text(max_size=4), json_values, max_size=2), "items": free}), free)


def text_or(strategy, size: int = 20):
    return st.one_of(st.text(max_size=size), strategy, json_values)


def mostly(valid):
    return st.one_of(valid, valid, valid, json_values)


def bodies(required: dict, optional: dict, most: int = 2):
    """Bodies with the model served, the required fields and at most ``most`` of the
    optional ones: few enough that many bodies get past decoding into the mapping code;
    and, one in three, any subset of all fields (any model, missing fields)."""
    def add(base: dict):
        return st.lists(st.sampled_from(sorted(optional)), max_size=most, unique=True).flatmap(
            lambda keys: st.fixed_dictionaries({k: optional[k] for k in keys}).map(lambda extra: {**base, **extra}))

    served = st.fixed_dictionaries({"model": st.just(MODEL), **required}).flatmap(add)
    return st.one_of(served, served, st.fixed_dictionaries({}, optional={
        "model": st.one_of(st.just(MODEL), json_values), **required, **optional}))


def encode(body) -> bytes:
    def nest(m: re.Match) -> str:
        n = int(m.group(2))
        return '{"a": ' * n + "1" + "}" * n if m.group(1) == "{" else "[" * n + "]" * n

    # allow_nan: Infinity/NaN literals are not JSON; the server must call them malformed.
    return DEEP.sub(nest, json.dumps(body, allow_nan=True)).encode()


sampling = {
    "temperature": st.one_of(st.floats(-1, 3), json_values),
    "top_p": st.one_of(st.floats(-1, 2), json_values),
    "top_k": st.one_of(st.integers(-2, 100000), json_values),
    "min_p": st.one_of(st.floats(-1, 2), json_values),
    "presence_penalty": json_values, "frequency_penalty": json_values, "repetition_penalty": json_values,
    "seed": st.one_of(st.integers(-(1 << 65), 1 << 65), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "surprise": free,
}

# OpenAI Chat Completions and Completions
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "robot", 3]),
     "content": st.one_of(st.text(max_size=40), st.none(), st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url", "audio"]), "text": st.text(max_size=10)},
         optional={"image_url": free}), max_size=2), json_values)},
    optional={"name": st.text(max_size=5), "tool_call_id": json_values})
function = st.fixed_dictionaries({"name": text_or(st.just("get_weather"), 8)},
                                 optional={"parameters": schema, "strict": json_values, "description": json_values})
chat_tool = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["function", "custom"]), "function": function}),
                      json_values)
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "regex", "grammar", "x"])},
                          optional={"json_schema": st.fixed_dictionaries({"schema": schema},
                                                                         optional={"name": json_values}),
                                    "regex": text_or(st.just("[a-z]{1,3}")),
                                    "grammar": text_or(st.just('start: "x"'))}),
    json_values)
openai_fields = {
    **sampling,
    "max_tokens": st.one_of(st.integers(-3, 20), json_values),
    "n": st.one_of(st.integers(-1, 10), json_values),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20), json_values),
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, 60000), max_size=20), json_values),
    "logprobs": st.one_of(st.booleans(), st.integers(-3, 25), json_values),
    "top_logprobs": st.one_of(st.integers(-3, 25), json_values),
    "logit_bias": json_values, "stream_options": json_values,
}
chat_fields = {
    **openai_fields,
    "tools": st.one_of(st.lists(chat_tool, max_size=2), json_values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "any"]), st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": json_values})}), json_values),
    "response_format": response_format,
    "reasoning_effort": text_or(st.sampled_from(["none", "low", "high"])),
    "chat_template_kwargs": free,
}
completion_fields = {
    **openai_fields,
    "echo": json_values, "suffix": json_values, "best_of": json_values,
}

# OpenAI Responses
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "text", "input_image", "input_file", "refusal"])},
    optional={"text": text_or(st.just("hi")), "annotations": json_values, "image_url": json_values})
content = st.one_of(st.text(max_size=20), st.lists(part, max_size=2), json_values)
call_id = text_or(st.just("call_1"), 6)
summary = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["summary_text", "reasoning_text", "x"]),
                                          "text": text_or(st.just("why"))}), max_size=2)
item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", 3]),
                           "content": content},
                          optional={"type": st.just("message"), "id": json_values, "status": json_values}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": call_id, "name": text_or(st.just("f"))},
                          optional={"arguments": text_or(st.just("{}"))}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": call_id},
                          optional={"output": content}),
    st.fixed_dictionaries({"type": st.just("reasoning")},
                          optional={"summary": st.one_of(summary, json_values),
                                    "content": st.one_of(summary, json_values), "encrypted_content": json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["item_reference", "web_search_call", "x"]), "id": json_values}),
    json_values)
responses_fields = {
    **sampling,
    "instructions": json_values,
    "max_output_tokens": st.one_of(st.integers(-3, 20), json_values),
    "tools": st.one_of(st.lists(st.one_of(st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "web_search"]), "name": text_or(st.just("f"), 8)},
        optional={"parameters": schema, "strict": json_values}), json_values), max_size=2), json_values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "file_search"]), "name": json_values}), json_values),
    "text": st.one_of(st.fixed_dictionaries({"format": st.one_of(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "regex"])},
        optional={"schema": schema, "name": json_values, "regex": json_values}), json_values)}), json_values),
    "reasoning": st.one_of(st.fixed_dictionaries({}, optional={"effort": json_values, "summary": json_values}),
                           json_values),
    "store": json_values, "previous_response_id": json_values, "truncation": json_values,
    "include": st.one_of(st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"]),
                                  max_size=2), json_values),
    "top_logprobs": st.one_of(st.integers(-2, 22), json_values),
    "metadata": json_values, "parallel_tool_calls": json_values, "stop": json_values, "chat_template_kwargs": free,
}

# Anthropic Messages
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": text_or(st.just("hi"))},
                                   optional={"cache_control": st.one_of(st.just({"type": "ephemeral"}), json_values)})
block = st.one_of(
    text_block,
    st.fixed_dictionaries({"type": st.just("image"), "source": json_values}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": call_id, "name": text_or(st.just("f"))},
                          optional={"input": free}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": call_id},
                          optional={"content": st.one_of(st.text(max_size=10), st.lists(text_block, max_size=2),
                                                         json_values), "is_error": json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking", "document", 5])},
                          optional={"thinking": json_values, "signature": json_values, "data": json_values}),
    json_values)
messages_fields = {
    **sampling,
    "system": st.one_of(st.text(max_size=20), st.lists(text_block, max_size=2), json_values),
    "tools": st.one_of(st.lists(st.one_of(st.fixed_dictionaries(
        {"name": text_or(st.just("f"), 8)},
        optional={"input_schema": schema, "type": st.sampled_from(["custom", "bash_20250124"]),
                  "cache_control": json_values, "description": json_values}), json_values), max_size=2),
        json_values),
    "tool_choice": st.one_of(st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
        optional={"name": json_values, "disable_parallel_tool_use": json_values}), json_values),
    "stop_sequences": st.one_of(st.lists(st.text(max_size=4), max_size=20), json_values),
    "metadata": json_values,
    "thinking": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"])},
                                                optional={"budget_tokens": json_values}), json_values),
    "output_config": st.one_of(st.fixed_dictionaries({"format": st.one_of(st.fixed_dictionaries(
        {"type": st.sampled_from(["json_schema", "json_object"])}, optional={"schema": schema}), json_values)}),
        json_values),
}

anthropic_message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "assistant", "system"])),
     "content": st.one_of(st.text(max_size=30), st.lists(block, max_size=3), json_values)})
ENDPOINTS = {
    "/v1/chat/completions": bodies({"messages": mostly(st.lists(message, min_size=1, max_size=3))},
                                   chat_fields),
    "/v1/completions": bodies({"prompt": st.one_of(
        st.text(max_size=30), st.lists(st.integers(-5, 60000), max_size=6), json_values)}, completion_fields),
    "/v1/responses": bodies({"input": st.one_of(
        st.text(max_size=30), st.lists(item, min_size=1, max_size=4), json_values)}, responses_fields),
    "/v1/messages": bodies({"max_tokens": mostly(st.integers(1, 8)),
                            "messages": mostly(st.lists(anthropic_message, min_size=1, max_size=3))}, messages_fields),
}


@pytest.fixture(scope="module")
def fuzz_server(tiny_core):
    with running_server(tiny_core, "--max-tokens-limit", "8") as srv:
        yield srv


# 100 bodies an endpoint each run (Hypothesis' default; a clean CI checkout keeps no example
# database, so every run draws new ones).
@pytest.mark.parametrize("path", list(ENDPOINTS))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_no_request_body_causes_a_server_error(fuzz_server, path, data):
    body = data.draw(ENDPOINTS[path], label="body")
    raw = encode(body)
    r = httpx.post(fuzz_server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (r.status_code, raw[:300], r.text[:500])
    if DEEP.search(json.dumps(body, allow_nan=True)):
        assert r.status_code == 400, (raw[:300], r.text[:500])
    if r.status_code >= 400:
        if path == "/v1/messages":
            err = r.json()
            assert err["type"] == "error" and set(err["error"]) == {"type", "message"} and err["error"]["message"]
        else:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "x-request-id" in r.headers


def test_server_still_serves_after_fuzzing(fuzz_server):
    r = httpx.post(fuzz_server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True},
        timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
