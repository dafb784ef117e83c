"""Property test of the request schemas: whatever JSON a client sends to the generation
endpoints, the server answers below 500, with an OpenAI error envelope whenever it
refuses, and keeps serving."""

from __future__ import annotations

import json

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
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "robot", 3]),
     "content": st.one_of(st.text(max_size=40), st.none(), st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url", "audio"]), "text": st.text(max_size=10)}), max_size=2),
         json_values)},
    optional={"name": st.text(max_size=5), "tool_call_id": json_values})
fields = {
    "model": st.one_of(st.just(MODEL), json_values),
    "messages": st.one_of(st.lists(message, max_size=3), json_values),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 60000), max_size=6), json_values),
    "max_tokens": st.one_of(st.integers(-3, 20), json_values),
    "temperature": st.one_of(st.floats(-1, 3), json_values),
    "top_p": st.one_of(st.floats(-1, 2), json_values),
    "top_k": st.one_of(st.integers(-2, 100000), json_values),
    "min_p": st.one_of(st.floats(-1, 2), json_values),
    "presence_penalty": json_values, "frequency_penalty": json_values, "repetition_penalty": json_values,
    "seed": st.one_of(st.integers(-(1 << 65), 1 << 65), json_values),
    "n": st.one_of(st.integers(-1, 10), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=20), json_values),
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, 60000), max_size=20), json_values),
    "logprobs": json_values, "logit_bias": json_values, "stream_options": json_values,
    "surprise": json_values,
}
bodies = st.fixed_dictionaries({}, optional=fields)


@pytest.fixture(scope="module")
def fuzz_server(tiny_core):
    with running_server(tiny_core, "--max-tokens-limit", "8") as srv:
        yield srv


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_no_request_body_causes_a_server_error(fuzz_server, body, path):
    # allow_nan: Infinity/NaN literals are not JSON; the server must call them malformed.
    raw = json.dumps(body, allow_nan=True).encode()
    r = httpx.post(fuzz_server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (r.status_code, body, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "x-request-id" in r.headers


def test_server_still_serves_after_fuzzing(fuzz_server):
    r = httpx.post(fuzz_server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True},
        timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
