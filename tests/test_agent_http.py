"""The agent API end to end: live ``flare-serve`` processes driven by the official
``openai`` and ``anthropic`` clients.

* SmolLM2 (real weights): ``response_format`` JSON schema, 20 seeded requests.
* qwen3-tiny (random weights, Qwen3 template, hermes tool parser, think reasoning):
  the same schema; tools through the template and ``tool_choice`` semantics;
  tool calls produced under the composed grammar (a random model calls tools only
  when the grammar offers the call syntax: then the call is valid by construction);
  Responses and Messages, streaming and not; malformed calls; pathological grammars.

Random weights mean the model's choices are arbitrary but fixed by the seed: tests
run a handful of seeds and assert on every outcome, never on one lucky seed.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import openai
import pytest

from flare.core.manifest import load_manifest
from flare.server.template import ChatTemplate
from flare.server.text import TextCodec
from flare.server.tools import REQUIRED_INSTRUCTION
from tests.conftest import running_server
from tests.schemas import PERSON, WEATHER_PARAMS, deep_schema, many_tools

QWEN = "qwen3-tiny"
SMOL = "smollm2-135m-instruct"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
SEEDS = range(8)  # one decode batch on the tiny core (8 slots)


@pytest.fixture(scope="module")
def qwen3_server(qwen3_core):
    # A tight compile limit, which a schema of 128 rich alternatives (about 0.6 s to compile
    # on an idle machine) exceeds; ordinary grammars compile in milliseconds.
    # No prefix cache: these tests compare a seed's output across phases (created, streamed,
    # SDK helper), sampled over the whole 49k vocabulary of random weights, where a 1e-6
    # logit difference moves a draw. With the cache, a request that restores another's
    # checkpoint prefills a different partition than one that arrived first, and arrival
    # order is up to the threads (the cache is tested over HTTP in test_http_cache.py).
    with running_server(qwen3_core, "--grammar-compile-timeout", "0.25", "--no-prefix-cache") as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(qwen3_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(qwen3_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=qwen3_server.url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def qwen3_frontend(qwen3_core):
    m = load_manifest(qwen3_core)
    tmpl = ChatTemplate((qwen3_core / m.frontend.chat_template).read_text(), dict(m.frontend.special_tokens))
    return tmpl, TextCodec(str(qwen3_core / m.frontend.tokenizer))


def rendered_len(frontend, messages, tools=None, **kw) -> int:
    tmpl, codec = frontend
    return len(codec.encode(tmpl.render(messages, tools=tools, add_generation_prompt=True, **kw),
                            add_special_tokens=False))


def chat(client, messages=ASK, **kw):
    return client.chat.completions.create(model=QWEN, messages=messages, **kw)


def chat_stream(client, messages=ASK, **kw) -> list[dict]:
    """Reassemble a streamed chat completion, per choice: content, reasoning, calls, finish."""
    outs: dict[int, dict] = {}
    for chunk in chat(client, messages, stream=True, **kw):
        for c in chunk.choices:
            out = outs.setdefault(c.index, {"content": "", "reasoning": "", "calls": {}, "finish": None})
            d = c.delta
            out["content"] += d.content or ""
            out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                call = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id is not None:
                    assert call["id"] is None and tc.function.name  # id and name come once, first
                    call["id"], call["name"] = tc.id, tc.function.name
                call["arguments"] += tc.function.arguments or ""
            if c.finish_reason is not None:
                assert out["finish"] is None
                out["finish"] = c.finish_reason
    for out in outs.values():
        out["calls"] = [out["calls"][i] for i in sorted(out["calls"])]
    return [outs[i] for i in sorted(outs)]


def run_parallel(fns, workers=8) -> list:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda f: f(), fns))


# ---------------------------------------------------------------------------
# Structured output


def test_smol_json_schema_20_of_20(smol_server):
    """Real SmolLM2 weights, 20 seeds: every answer is JSON that validates."""
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "Invent a person. Reply with JSON: name, age, role and skills."}]

    def one(seed):
        r = client.chat.completions.create(model=SMOL, messages=msgs, seed=seed, max_tokens=120,
                                           response_format=PERSON_FORMAT)
        return r.choices[0]

    choices = run_parallel([lambda s=s: one(s) for s in range(20)])
    for c in choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)
    assert len({c.message.content for c in choices}) >= 5  # seeds matter: real, varied answers


def test_random_model_json_schema_always_valid(oai):
    """Random weights, 16 seeds (two requests of n = 8: one decode batch each)."""
    for seed in (0, 8):
        r = chat(oai, seed=seed, n=8, max_tokens=200, response_format=PERSON_FORMAT, extra_body=NO_THINK)
        assert len(r.choices) == 8
        for c in r.choices:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), PERSON)


def test_json_object_regex_and_stream_equal_non_stream(oai):
    r = chat(oai, seed=1, max_tokens=60, response_format={"type": "regex", "regex": "(yes|no): [0-9]{3}"},
             extra_body=NO_THINK)
    text = r.choices[0].message.content
    assert text[:4] in ("yes:", "no: ") and text[-3:].isdigit() and r.choices[0].finish_reason == "stop"
    (s,) = chat_stream(oai, seed=1, max_tokens=60, response_format={"type": "regex", "regex": "(yes|no): [0-9]{3}"},
                       extra_body=NO_THINK)
    assert (s["content"], s["finish"]) == (text, "stop")
    r = chat(oai, seed=2, max_tokens=300, response_format={"type": "json_object"},
             extra_body={**NO_THINK, "top_k": 20})
    assert isinstance(json.loads(r.choices[0].message.content), dict) or r.choices[0].finish_reason == "length"


def test_pathological_grammars_fail_typed_without_stalling_others(qwen3_server, oai):
    """A response schema of 128 rich alternatives (the parameters of 128 tools) takes about
    0.6 s to compile, over the server's 0.25 s limit: that request fails with a typed 400
    while the event loop keeps answering /health as fast as before and a concurrent
    stream keeps producing tokens; the compile finishes in the background, and a retry is
    then served from the cache. A schema nested too deep is refused before compiling."""
    url = qwen3_server.url
    schema = {"anyOf": [t["function"]["parameters"] for t in many_tools(128, props=16)]}
    body = {"model": QWEN, "messages": ASK, "max_tokens": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}
    arrivals: list[float] = []
    first, stop = threading.Event(), threading.Event()

    def stream():
        s = chat(oai, seed=3, max_tokens=400, stream=True, extra_body={**NO_THINK, "ignore_eos": True})
        for _ in s:
            arrivals.append(time.perf_counter())
            first.set()
            if stop.is_set():
                break
        s.close()

    def poll_health(until) -> list[float]:
        out = []
        with httpx.Client(timeout=10) as h:
            while until() or len(out) < 5:
                t = time.perf_counter()
                assert h.get(url + "/health").status_code == 200
                out.append(time.perf_counter() - t)
                time.sleep(0.02)
        return out

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(120)
    before = poll_health(lambda: False)
    box: dict = {}

    def pathological():
        box["t0"] = time.perf_counter()
        box["first"] = httpx.post(url + "/v1/chat/completions", timeout=60, json=body)
        box["t1"] = time.perf_counter()
        while True:  # retry until the background compile has landed in the cache
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json=body)
            if r.status_code != 400 or r.json()["error"]["code"] != "grammar_compile_timeout":
                break
        box["retry"], box["t2"] = r, time.perf_counter()

    worker = threading.Thread(target=pathological)
    worker.start()
    during = poll_health(worker.is_alive)
    worker.join()
    stop.set()
    reader.join(120)
    r = box["first"]
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["type"], err["param"]) == ("grammar_compile_timeout", "invalid_request_error",
                                                        "response_format.json_schema.schema")
    assert box["t1"] - box["t0"] < 5
    assert box["retry"].status_code == 200, box["retry"].text  # compiled once, then cached
    assert max(during) < max(before) + 0.3, (before, during)  # no loop stall of the compile's length
    assert sum(box["t0"] < t < box["t2"] for t in arrivals) >= 2  # the stream went on meanwhile
    deep = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": QWEN, "messages": ASK, "max_tokens": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep_schema(40)}}})
    assert deep.status_code == 400 and deep.json()["error"]["code"] == "grammar_too_complex"


# ---------------------------------------------------------------------------
# Tools through the template and tool_choice


def test_tool_choice_shapes_the_prompt(oai, qwen3_frontend):
    """auto renders every tool; none renders none; required adds the instruction;
    a named choice renders only that tool. Prompt token counts are the local renderings'."""
    tools = [WEATHER, TIME]
    kw = dict(seed=5, max_tokens=4, tools=tools, extra_body=NO_THINK)
    auto = chat(oai, **kw)
    assert auto.usage.prompt_tokens == rendered_len(qwen3_frontend, ASK, tools, enable_thinking=False)
    assert auto.choices[0].finish_reason == "length" and auto.choices[0].message.tool_calls is None
    none = chat(oai, tool_choice="none", **kw)
    assert none.usage.prompt_tokens == rendered_len(qwen3_frontend, ASK, None, enable_thinking=False)
    assert none.choices[0].finish_reason == "length"
    # required and named: the random model does not call within 4 tokens, so the response
    # fails with the typed error (their prompts are checked where calls succeed, below).
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(openai.UnprocessableEntityError) as e:
            chat(oai, tool_choice=choice, **kw)
        assert e.value.status_code == 422
        assert e.value.body["code"] == "tool_call_required" and e.value.body["type"] == "model_output_error"


def test_strict_functions_and_bad_tool_choices_are_400(qwen3_server):
    def post(**kw):
        return httpx.post(qwen3_server.url + "/v1/chat/completions", timeout=30,
                          json={"model": QWEN, "messages": ASK, "max_tokens": 2, **kw})

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    r = post(tools=[strict])
    assert r.status_code == 400
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("tools[0].function.strict", "unsupported")
    r = post(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = post(tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = post(tools=[WEATHER, WEATHER])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1].name"


def test_smol_template_without_tools_refuses_them(smol_server):
    r = httpx.post(smol_server.url + "/v1/chat/completions", timeout=30, json={
        "model": SMOL, "messages": ASK, "max_tokens": 2, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
    # tool_choice none: the tools are not rendered, so the request runs.
    r = httpx.post(smol_server.url + "/v1/chat/completions", timeout=30, json={
        "model": SMOL, "messages": ASK, "max_tokens": 2, "tools": [WEATHER], "tool_choice": "none"})
    assert r.status_code == 200


def outcome(choice) -> tuple:
    m = choice.message
    calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return m.content, calls, choice.finish_reason


def test_tool_calls_under_the_composed_grammar_stream_and_not(oai):
    """Tools plus an output schema, 8 seeds (n = 8): each output is a valid answer or
    valid calls (both happen); the stream reassembles into the same content and calls,
    each call's id and name announced once, first."""
    kw = dict(seed=0, n=8, max_tokens=200, tools=[WEATHER, TIME], response_format=PERSON_FORMAT,
              extra_body=NO_THINK)
    r = chat(oai, **kw)
    streamed = chat_stream(oai, **kw)
    kinds = set()
    for choice, s in zip(r.choices, streamed):
        content, calls, finish = outcome(choice)
        if calls:
            kinds.add("calls")
            assert content is None and finish == "tool_calls"
            for (name, args), c in zip(calls, choice.message.tool_calls):
                params = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
                jsonschema.validate(json.loads(args), params)
                assert c.id.startswith("call_") and c.type == "function"
        else:
            kinds.add("answer")
            assert finish == "stop"
            jsonschema.validate(json.loads(content), PERSON)
        assert (s["content"] or None, [(c["name"], c["arguments"]) for c in s["calls"]], s["finish"]) == \
            (content, calls, finish)
        assert len({c["id"] for c in s["calls"]}) == len(calls)
    assert kinds == {"calls", "answer"}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_either_call_or_fail_typed(oai, qwen3_frontend, choice):
    """Without decoding constraints on the choice itself, every seed either calls (named:
    only the named tool, no answer text) or fails with tool_call_required; both happen.
    The prompt is the template's with the instruction (required) or with only the named
    tool rendered (named)."""
    if choice == "required":
        prompt_len = rendered_len(qwen3_frontend, [{"role": "system", "content": REQUIRED_INSTRUCTION}, *ASK],
                                  [WEATHER, TIME], enable_thinking=False)
    else:
        prompt_len = rendered_len(qwen3_frontend, ASK, [WEATHER], enable_thinking=False)
    def one(seed):
        try:
            return chat(oai, seed=seed, max_tokens=200, tools=[WEATHER, TIME], tool_choice=choice,
                        response_format=PERSON_FORMAT, extra_body=NO_THINK)
        except openai.UnprocessableEntityError as e:
            return e

    seen = set()
    for r in run_parallel([lambda s=s: one(s) for s in SEEDS]):
        if isinstance(r, openai.UnprocessableEntityError):
            assert (r.body["code"], r.body["type"]) == ("tool_call_required", "model_output_error")
            seen.add("failed")
            continue
        content, calls, finish = outcome(r.choices[0])
        assert calls and finish == "tool_calls" and content is None
        assert r.usage.prompt_tokens == prompt_len
        if isinstance(choice, dict):
            assert {name for name, _ in calls} == {"get_weather"}
        seen.add("called")
    assert seen == {"called", "failed"}


def test_malformed_call_is_an_error_never_content(oai, qwen3_frontend):
    """The answer grammar writes a tool call block (the marker tokens a model emits) whose
    payload is not a call. Seeds that take it fail with malformed_tool_call, streaming
    (an error event, no [DONE]) and not, and no content ever shows the block; seeds that
    take the grammar's other branch make a valid call."""
    _, codec = qwen3_frontend
    open_, close = codec.token_to_id("<tool_call>"), codec.token_to_id("</tool_call>")
    bad = {"type": "grammar", "grammar": f'start: <[{open_}]> "\\n{{\\"name\\": \\"get_weather\\"}}\\n" <[{close}]>'}
    def one(seed):
        kw = dict(seed=seed, max_tokens=60, tools=[WEATHER], response_format=bad)
        try:
            return chat(oai, extra_body=NO_THINK, **kw), None
        except openai.UnprocessableEntityError as e:
            raw = httpx.post(str(oai.base_url) + "chat/completions", timeout=120,
                             json={"model": QWEN, "messages": ASK, "stream": True, **kw, **NO_THINK})
            return e, [line[6:] for line in raw.text.splitlines() if line.startswith("data: ")]

    failures = 0
    for r, frames in run_parallel([lambda s=s: one(s) for s in SEEDS]):
        if frames is None:
            assert r.choices[0].message.tool_calls and r.choices[0].finish_reason == "tool_calls"
            continue
        failures += 1
        assert r.body["code"] == "malformed_tool_call"
        assert json.loads(frames[-1])["error"]["code"] == "malformed_tool_call" and "[DONE]" not in frames
        assert all(not json.loads(f)["choices"][0]["delta"].get("content") for f in frames[:-1])
    assert failures > 0


def test_tool_result_round_trip_renders_like_the_template(oai, qwen3_frontend):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    r = chat(oai, history, seed=1, max_tokens=3, tools=[WEATHER])
    local = [*ASK, {**history[1], "content": ""}, history[2]]
    assert r.usage.prompt_tokens == rendered_len(qwen3_frontend, local, [WEATHER])


def test_reasoning_is_split_from_content(oai):
    """Thinking on and an output schema: the grammar lets the output open a reasoning
    block, where a random model stays (it never samples </think>) until max_tokens.
    Those outputs carry everything as reasoning_content and no content; the others are
    valid answers. Streams reassemble to the same fields; no marker reaches content."""
    kinds = set()
    r = chat(oai, seed=0, n=8, max_tokens=70, response_format=PERSON_FORMAT)
    streamed = chat_stream(oai, seed=0, n=8, max_tokens=70, response_format=PERSON_FORMAT)
    for choice, s in zip(r.choices, streamed):
        m, finish = choice.message, choice.finish_reason
        reasoning = m.model_extra.get("reasoning_content")
        if reasoning:
            kinds.add("reasoning")
            assert (m.content, finish) == ("", "length")
        else:
            kinds.add("answer")
            jsonschema.validate(json.loads(m.content), PERSON)
        assert "<think>" not in m.content and "</think>" not in m.content
        assert (s["content"], s["reasoning"] or None, s["finish"]) == (m.content, reasoning, finish)
    assert kinds == {"reasoning", "answer"}


# ---------------------------------------------------------------------------
# Responses


RESP_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
               "parameters": WEATHER_PARAMS, "strict": False}]
RESP_FORMAT = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}


def test_responses_create_and_stream(oai):
    """Six seeds, each created, streamed raw and streamed through the SDK's accumulating
    helper. One request at a time: the phases must agree token for token, and on the CPU
    a decode row's logits depend on how many rows its batch has (MKL picks its kernel by
    the GEMM's row count), so requests that ran together would agree only when their
    batches happened to grow and shrink alike."""
    def kw(seed):
        return dict(model=QWEN, input="What's the weather in Paris?", instructions="Answer or call a tool.",
                    tools=RESP_TOOLS, text=RESP_FORMAT, max_output_tokens=200, extra_body={"seed": seed, **NO_THINK})

    def helper(seed):
        with oai.responses.stream(**kw(seed)) as h:
            for _ in h:
                pass
            return h.get_final_response()

    seeds = range(6)
    created = [oai.responses.create(**kw(s)) for s in seeds]
    streamed = [list(oai.responses.create(stream=True, **kw(s))) for s in seeds]
    helped = [helper(s) for s in seeds]
    kinds = set()
    for r, events, final_h in zip(created, streamed, helped):
        assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
        assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        types = [o.type for o in r.output]
        if types == ["message"]:
            kinds.add("message")
            jsonschema.validate(json.loads(r.output_text), PERSON)
        else:
            kinds.add("calls")
            assert set(types) == {"function_call"}
            for o in r.output:
                assert o.name == "get_weather" and o.status == "completed" and o.call_id.startswith("call_")
                jsonschema.validate(json.loads(o.arguments), WEATHER_PARAMS)
        names = [e.type for e in events]
        assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response
        assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == \
            [(o.type, getattr(o, "arguments", None)) for o in r.output] and final.output_text == r.output_text
        deltas = "".join(e.delta for e in events if e.type in ("response.output_text.delta",
                                                               "response.function_call_arguments.delta"))
        assert deltas == r.output_text + "".join(o.arguments for o in r.output if o.type == "function_call")
        assert final_h.output_text == r.output_text and len(final_h.output) == len(r.output)
    assert kinds == {"message", "calls"}


def test_responses_input_items_and_failures(oai, qwen3_server, qwen3_frontend):
    items = [{"role": "user", "content": "What's the weather in Paris?"},
             {"type": "function_call", "call_id": "call_9", "name": "get_weather",
              "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"},
             {"type": "function_call_output", "call_id": "call_9", "output": "21 C"}]
    r = oai.responses.create(model=QWEN, input=items, instructions="Be brief.", tools=RESP_TOOLS,
                             max_output_tokens=4, extra_body={"seed": 1})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    chat_equiv = [{"role": "system", "content": "Be brief."}, ASK[0],
                  {"role": "assistant", "content": "", "tool_calls": [{"id": "call_9", "type": "function", "function": {
                      "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_9", "content": "21 C"}]
    assert r.usage.input_tokens == rendered_len(qwen3_frontend, chat_equiv, [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city", "parameters": WEATHER_PARAMS}}])
    # A required call that is not made: 422 without streaming, response.failed when streaming.
    kw = dict(model=QWEN, input="hi", tools=RESP_TOOLS, tool_choice="required", max_output_tokens=3,
              extra_body={"seed": 1})
    with pytest.raises(openai.UnprocessableEntityError):
        oai.responses.create(**kw)
    events = list(oai.responses.create(stream=True, **kw))
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "tool_call_required"
    for bad, param in [({"previous_response_id": "resp_x"}, "previous_response_id"), ({"store": True}, "store"),
                       ({"tools": [{**RESP_TOOLS[0], "strict": True}]}, "tools[0].strict")]:
        r = httpx.post(qwen3_server.url + "/v1/responses", timeout=30, json={"model": QWEN, "input": "x", **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param


# ---------------------------------------------------------------------------
# Anthropic Messages


CLAUDE_TOOLS = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_PARAMS}]


def test_messages_create_and_stream_with_tools(claude):
    """Six seeds, each created and streamed, one request at a time (see
    test_responses_create_and_stream: batched rows are not batch-size invariant on the CPU)."""
    def kw(seed):
        return dict(model=QWEN, max_tokens=200, system="Answer or call a tool.",
                    messages=[{"role": "user", "content": "What's the weather in Paris?"}], tools=CLAUDE_TOOLS,
                    thinking={"type": "disabled"},
                    extra_body={"seed": seed, "output_config": {"format": {"type": "json_schema", "schema": PERSON}}})

    def stream(seed):
        with claude.messages.stream(**kw(seed)) as s:
            return [e.type for e in s], s.get_final_message()

    seeds = range(6)
    created = [claude.messages.create(**kw(s)) for s in seeds]
    streamed = [stream(s) for s in seeds]
    kinds = set()
    for m, (names, final) in zip(created, streamed):
        assert m.type == "message" and m.role == "assistant" and m.usage.output_tokens > 0
        if m.stop_reason == "tool_use":
            kinds.add("tool_use")
            for b in m.content:
                assert b.type == "tool_use" and b.name == "get_weather" and b.id.startswith("toolu_")
                jsonschema.validate(b.input, WEATHER_PARAMS)
        else:
            kinds.add("text")
            assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"]
            jsonschema.validate(json.loads(m.content[0].text), PERSON)
        assert names[0] == "message_start" and names[-1] == "message_stop"
        assert [b.model_dump(exclude={"id"}) for b in final.content] == \
            [b.model_dump(exclude={"id"}) for b in m.content]
        assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    assert kinds == {"tool_use", "text"}


def test_messages_history_stop_sequences_and_errors(claude, qwen3_server, qwen3_frontend):
    history = [{"role": "user", "content": "What's the weather in Paris?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris", "unit": "c"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"}]}]
    m = claude.messages.create(model=QWEN, max_tokens=3, messages=history, tools=CLAUDE_TOOLS,
                               extra_body={"seed": 2})
    assert m.stop_reason == "max_tokens"
    chat_equiv = [ASK[0], {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
                  {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"}]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == rendered_len(qwen3_frontend, chat_equiv, [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city", "parameters": WEATHER_PARAMS}}])
    # A stop sequence the (schema-constrained) answer must contain: stop_reason stop_sequence.
    m = claude.messages.create(model=QWEN, max_tokens=100, messages=[{"role": "user", "content": "Hi"}],
                               stop_sequences=['"age"'], thinking={"type": "disabled"},
                               extra_body={"seed": 3, "output_config": {"format": {"type": "json_schema",
                                                                                   "schema": PERSON}}})
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", '"age"')
    assert m.content[0].text.startswith('{"name": "') and m.content[0].text.endswith(", ")
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=QWEN, max_tokens=5, messages=[{"role": "user", "content": "x"}],
                               tools=CLAUDE_TOOLS, tool_choice={"type": "tool", "name": "nope"})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert set(e.value.body["error"]) == {"type", "message"}
    with claude.messages.stream(model=QWEN, max_tokens=3, messages=[{"role": "user", "content": "x"}],
                                tools=CLAUDE_TOOLS, tool_choice={"type": "any"}, extra_body={"seed": 1}) as s:
        with pytest.raises(anthropic.APIStatusError) as e:
            for _ in s:
                pass
    assert "tool call" in str(e.value)
