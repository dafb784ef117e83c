"""The output grammar (``flare.server.grammar``): composition, compilation limits, cache,
and what a sampler that picks uniformly among the allowed tokens (a random model)
produces under it, with the qwen3-tiny core's tokenizer and markers."""

from __future__ import annotations

import asyncio
import json
import random
import time

import jsonschema
import numpy as np
import pytest

from flare.core.errors import GrammarError
from flare.core.manifest import ReasoningParser, ToolParser, load_manifest, mask_words
from flare.server.grammar import AnswerFormat, GrammarCompiler, ToolSpec, compose
from flare.server.parsers import Assembled, OutputParser, ThinkStart
from flare.server.text import TextCodec
from tests.schemas import PERSON, WEATHER_PARAMS, deep_schema, many_tools


@pytest.fixture(scope="module")
def env(qwen3_core):
    m = load_manifest(qwen3_core)
    path = str(qwen3_core / m.frontend.tokenizer)
    codec = TextCodec(path)
    compiler = GrammarCompiler(path, vocab_size=m.capacities.vocab_size, eos_ids=m.frontend.eos_ids)
    yield m, codec, compiler, (lambda text: compiler.marker(text, codec.encode(text, add_special_tokens=False)))
    compiler.close()


def compile_now(compiler: GrammarCompiler, grammar: str, param: str = "response_format"):
    return asyncio.run(compiler.compile(grammar, param))


def allowed(grammar, words: int) -> list[int]:
    row = np.zeros(words, np.int32)
    assert grammar.fill_mask(row)
    bits = (row[:, None].astype(np.int64) >> np.arange(32)) & 1
    return [int(t) for t in np.flatnonzero(bits.reshape(-1))]


def random_walk(grammar, words: int, eos: int, rng: random.Random, limit: int = 400) -> list[int]:
    out = []
    for _ in range(limit):
        tok = rng.choice(allowed(grammar, words))
        assert grammar.accept(tok), grammar.error()
        if tok == eos:
            return out
        out.append(tok)
    raise AssertionError(f"no EOS after {limit} tokens")


def test_first_tokens_follow_the_composition(env):
    """The opening masks: JSON only; JSON or a reasoning block; JSON, a reasoning block
    or a tool call; and inside reasoning, free text (the close marker included)."""
    m, codec, compiler, marker = env
    words, tok = mask_words(m.capacities.vocab_size), codec.token_to_id
    answer = AnswerFormat("json_schema", PERSON)

    def first(think, tools):
        g = compose(answer, think_start=think, tools=tools, tool_format=ToolParser.hermes, parallel=True,
                    marker=marker)
        return {codec.decode([t]) if t < 49152 else codec.tokenizer.id_to_token(t)
                for t in allowed(compile_now(compiler, g).new(), words)}

    def markers_and_json(tokens: set[str]) -> set[str]:
        """The marker tokens among the first tokens; every other one must open the JSON."""
        json_open = {t for t in tokens if not t.startswith("<")}
        assert json_open and all(t.startswith("{") for t in json_open)
        return tokens - json_open

    assert markers_and_json(first(ThinkStart.closed, None)) == set()
    assert markers_and_json(first(ThinkStart.optional, None)) == {"<think>"}
    assert markers_and_json(first(ThinkStart.optional, [ToolSpec("get_weather", WEATHER_PARAMS)])) == {
        "<think>", "<tool_call>"}
    inside = compile_now(compiler, compose(answer, think_start=ThinkStart.inside, tools=None,
                                           tool_format=ToolParser.hermes, parallel=True, marker=marker)).new()
    free = allowed(inside, words)
    assert tok("</think>") in free and tok("<think>") not in free and len(free) > 40000


@pytest.mark.parametrize("seed", range(12))
def test_random_sampling_under_a_schema_always_yields_valid_json(env, seed):
    m, codec, compiler, marker = env
    g = compile_now(compiler, compose(AnswerFormat("json_schema", PERSON), think_start=ThinkStart.closed,
                                      tools=None, tool_format=ToolParser.hermes, parallel=True, marker=marker))
    toks = random_walk(g.new(), mask_words(m.capacities.vocab_size), m.frontend.eos_ids[0], random.Random(seed))
    jsonschema.validate(json.loads(codec.decode(toks)), PERSON)


def test_random_sampling_with_tools_yields_answers_or_valid_calls(env):
    """With a callable tool the composed grammar lets the output be the answer or tool
    calls; either way the text parses (through the hermes parser) into a valid answer or
    calls whose arguments validate against the tool's parameters."""
    m, codec, compiler, marker = env
    g = compile_now(compiler, compose(AnswerFormat("json_schema", PERSON), think_start=ThinkStart.closed,
                                      tools=[ToolSpec("get_weather", WEATHER_PARAMS)],
                                      tool_format=ToolParser.hermes, parallel=True, marker=marker))
    kinds = set()
    for seed in range(16):
        toks = random_walk(g.new(), mask_words(m.capacities.vocab_size), m.frontend.eos_ids[0], random.Random(seed))
        p = OutputParser(ReasoningParser.think, ToolParser.hermes, think_start=ThinkStart.closed,
                         new_id=lambda: "call")
        out = Assembled()
        out.add(p.feed(codec.decode(toks)))
        out.add(p.finish())
        if out.tool_calls:
            kinds.add("calls")
            assert out.content == ""
            for call in out.tool_calls:
                assert call.name == "get_weather"
                jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
        else:
            kinds.add("answer")
            jsonschema.validate(json.loads(out.content), PERSON)
    assert kinds == {"calls", "answer"}


def test_regex_and_lark_answers(env):
    m, codec, compiler, marker = env
    words, eos = mask_words(m.capacities.vocab_size), m.frontend.eos_ids[0]
    for answer, check in [
        (AnswerFormat("regex", r"(yes|no), [0-9]{2}"), lambda s: s[:3] in ("yes", "no,") and s[-2:].isdigit()),
        (AnswerFormat("grammar", 'start: "A" ("B" | "C")+ "!"'), lambda s: s[0] == "A" and s[-1] == "!"),
    ]:
        g = compile_now(compiler, compose(answer, think_start=None, tools=None, tool_format=ToolParser.none,
                                          parallel=True, marker=marker))
        for seed in range(4):
            assert check(codec.decode(random_walk(g.new(), words, eos, random.Random(seed))))


def test_invalid_and_too_deep_schemas_fail_typed(env):
    _, _, compiler, marker = env

    def build(schema):
        return compose(AnswerFormat("json_schema", schema, param="response_format.json_schema.schema"),
                       think_start=None, tools=None, tool_format=ToolParser.none, parallel=True, marker=marker)

    with pytest.raises(GrammarError) as e:
        compile_now(compiler, build({"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
                    "response_format.json_schema.schema")
    assert (e.value.code, e.value.status, e.value.param) == ("invalid_grammar", 400,
                                                             "response_format.json_schema.schema")
    t0 = time.perf_counter()
    with pytest.raises(GrammarError) as e:
        build(deep_schema(40))  # 80 nested containers
    assert e.value.code == "grammar_too_complex" and time.perf_counter() - t0 < 0.1
    build(deep_schema(20))  # within the limit


def test_cache_shares_compiles_and_copies_state(env):
    m, _, compiler, marker = env
    g = compose(AnswerFormat("json_object"), think_start=None, tools=None, tool_format=ToolParser.none,
                parallel=True, marker=marker)
    before = compiler.compiles
    a, b = compile_now(compiler, g), compile_now(compiler, g)
    assert a is b and compiler.compiles == before + 1
    words = mask_words(m.capacities.vocab_size)
    r1, r2 = a.new(), a.new()
    assert r1.accept(allowed(r1, words)[0])  # advancing one request's copy leaves the other at the start
    assert allowed(r2, words) == allowed(a.new(), words)


def test_slow_compile_times_out_without_blocking_the_loop(qwen3_core):
    """128 rich tools take about half a second to compile on an idle machine; with a
    0.1 s limit the request fails with a typed error after 0.1 s while the event loop
    keeps running; the compile finishes in the background, and a retry of the same
    grammar is then served from the cache at once, without compiling again."""
    m = load_manifest(qwen3_core)
    path = str(qwen3_core / m.frontend.tokenizer)
    codec = TextCodec(path)
    compiler = GrammarCompiler(path, vocab_size=m.capacities.vocab_size, eos_ids=m.frontend.eos_ids, timeout_s=0.1)
    tools = [ToolSpec(t["function"]["name"], t["function"]["parameters"]) for t in many_tools(128, props=16)]
    grammar = compose(AnswerFormat("json_object"), think_start=ThinkStart.closed, tools=tools,
                      tool_format=ToolParser.hermes, parallel=True,
                      marker=lambda s: compiler.marker(s, codec.encode(s, add_special_tokens=False)))

    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        t0 = time.perf_counter()
        with pytest.raises(GrammarError) as e:
            await compiler.compile(grammar, param="tools")
        waited = time.perf_counter() - t0
        assert (e.value.code, e.value.param) == ("grammar_compile_timeout", "tools")
        assert 0.1 <= waited < 0.4 and ticks >= 5  # the loop ran while the compile did
        while compiler._running:  # let the background compile finish
            await asyncio.sleep(0.05)
        t.cancel()
        compiles = compiler.compiles
        t0 = time.perf_counter()
        compiled = await compiler.compile(grammar)
        assert time.perf_counter() - t0 < 0.05 and compiler.compiles == compiles and compiled.seconds > 0.1

    try:
        asyncio.run(scenario())
    finally:
        compiler.close()


def test_oversized_grammar_fails_fast_and_typed(env):
    """llguidance's size limit: 128 tools with 32 union-typed parameters each."""
    _, codec, compiler, marker = env
    tools = [ToolSpec(t["function"]["name"], t["function"]["parameters"]) for t in many_tools(128, props=32)]
    grammar = compose(AnswerFormat("json_object"), think_start=None, tools=tools, tool_format=ToolParser.hermes,
                      parallel=True, marker=marker)
    t0 = time.perf_counter()
    with pytest.raises(GrammarError, match="too large") as e:
        compile_now(compiler, grammar, "tools")
    assert (e.value.code, e.value.status) == ("invalid_grammar", 400) and time.perf_counter() - t0 < 2


def test_marker_text_forced_as_plain_text_fails_cleanly(env):
    """llguidance forces the literal text "<tool_call>" as the special token and then
    rejects that token; the mask filter drops it, leaving no allowed token, and the
    grammar reports the failure instead of letting the sampler pick from nothing. The
    same block written with the token reference works."""
    m, codec, compiler, marker = env
    words, eos = mask_words(m.capacities.vocab_size), m.frontend.eos_ids[0]
    literal = compile_now(compiler, compose(AnswerFormat("grammar", 'start: "<tool_call>" "x"'), think_start=None,
                                            tools=None, tool_format=ToolParser.none, parallel=True,
                                            marker=marker)).new()
    row = np.zeros(words, np.int32)
    assert not literal.fill_mask(row) and "no token" in literal.error()
    ref = f'start: <[{codec.token_to_id("<tool_call>")}]> "x"'
    g = compile_now(compiler, compose(AnswerFormat("grammar", ref), think_start=None, tools=None,
                                      tool_format=ToolParser.none, parallel=True, marker=marker)).new()
    assert codec.decode(random_walk(g, words, eos, random.Random(0))) == "<tool_call>x"
