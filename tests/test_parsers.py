"""Reasoning and tool-call parsers (``flare.server.parsers``) on model outputs.

The outputs below are written in the formats the templates teach: Qwen3's
``<think>`` blocks and ``<tool_call>`` JSON blocks (the tool section of its chat
template, configs/tokenizers/qwen3-tiny), and a JSON array of calls. Each one
is parsed in one piece, with the exact expected content, reasoning and calls;
then the same bytes are fed split at every UTF-8 byte boundary (through an
incremental decoder, as text reaches the parser), token by token through the
real detokenizer, and at random multi-way splits: the streamed deltas must
reassemble into exactly the one-piece result, and every streamed event sequence
must be well formed.
"""

from __future__ import annotations

import codecs
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flare.core.errors import ModelOutputError
from flare.core.manifest import ReasoningParser, ToolParser
from flare.server.parsers import (Assembled, Content, OutputParser, Reasoning, ThinkStart, ToolArgs, ToolCall,
                                  ToolEnd, ToolStart, start_for)

H, J, NONE = ToolParser.hermes, ToolParser.json_array, None
THINK, PLAIN = ReasoningParser.think, ReasoningParser.none


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(pieces, rp, tp, start=ThinkStart.optional) -> tuple[Assembled, list]:
    p = OutputParser(rp, tp, think_start=start, new_id=ids())
    out, events = Assembled(), []
    for piece in pieces:
        e = p.feed(piece)
        events += e
        out.add(e)
    e = p.finish()
    events += e
    out.add(e)
    return out, events


def byte_split(text: str, cut: int) -> list[str]:
    """Two pieces of the UTF-8 bytes, decoded incrementally (a cut inside a character
    yields its text only once the character is complete)."""
    raw = text.encode()
    dec = codecs.getincrementaldecoder("utf-8")()
    return [dec.decode(raw[:cut]), dec.decode(raw[cut:], final=True)]


def check_well_formed(events: list) -> None:
    """Calls are announced once, in order; arguments only between start and end; no
    empty deltas."""
    open_call, started, ended = None, [], []
    for e in events:
        if isinstance(e, (Content, Reasoning, ToolArgs)):
            assert e.text
        if isinstance(e, ToolStart):
            assert open_call is None and e.index == len(started)
            open_call = e.index
            started.append(e.index)
        elif isinstance(e, ToolArgs):
            assert e.index == open_call
        elif isinstance(e, ToolEnd):
            assert e.index == open_call
            ended.append(e.index)
            open_call = None
        elif isinstance(e, Content):
            assert open_call is None
    assert open_call is None and started == ended


QWEN_TWO_CALLS = (
    "<think>\nThe user asks for the weather in two cities. I should call get_weather twice — once for Paris, "
    "once for 東京.\n</think>\n\nI'll check both cities.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "東京", "note": "🌸 \\"quoted\\" } and </tool_call"}}\n'
    "</tool_call>"
)

CASES = {
    "qwen3_think_text_two_calls": (QWEN_TWO_CALLS, THINK, H, ThinkStart.optional, Assembled(
        content="I'll check both cities.",
        reasoning="\nThe user asks for the weather in two cities. I should call get_weather twice — once for Paris, "
                  "once for 東京.\n",
        tool_calls=[ToolCall("call_0", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
                    ToolCall("call_1", "get_weather",
                             '{"city": "東京", "note": "🌸 \\"quoted\\" } and </tool_call"}')])),
    "qwen3_no_thinking_plain_answer": (
        "Use `a < b` here; a <tool> tag or <think> in text is just text.\n\nDone. ", THINK, H, ThinkStart.closed,
        Assembled(content="Use `a < b` here; a <tool> tag or <think> in text is just text.\n\nDone. ")),
    "qwen3_inside_reasoning_then_call": (
        "Need the time first; <tool_call> inside reasoning is not a call.</think>\n\n<tool_call>\n"
        '{"arguments": {"tz": "Europe/Oslo", "nested": {"a": [1, 2, {"b": null}]}}, "name": "get_time"}\n'
        "</tool_call>\n", THINK, H, ThinkStart.inside, Assembled(
            reasoning="Need the time first; <tool_call> inside reasoning is not a call.",
            tool_calls=[ToolCall("call_0", "get_time",
                                 '{"tz": "Europe/Oslo", "nested": {"a": [1, 2, {"b": null}]}}')])),
    "hermes_text_after_call": (
        '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\n\nSearching now…', PLAIN, H,
        ThinkStart.closed, Assembled(content="Searching now…", tool_calls=[ToolCall("call_0", "search", "{}")])),
    "json_array_two_calls": (
        '  [{"name": "search", "arguments": {"query": "flights to Oslo", "filters": {"max_price": 300, '
        '"airlines": ["SK", "DY"], "note": "a ] and a } inside"}}}, {"name": "get_time", "arguments": {}}]\n',
        PLAIN, J, ThinkStart.closed, Assembled(tool_calls=[
            ToolCall("call_0", "search", '{"query": "flights to Oslo", "filters": {"max_price": 300, '
                                         '"airlines": ["SK", "DY"], "note": "a ] and a } inside"}}'),
            ToolCall("call_1", "get_time", "{}")])),
    "json_array_answer_text": (
        "Sure — see [the docs](https://example.org) for details.", PLAIN, J, ThinkStart.closed,
        Assembled(content="Sure — see [the docs](https://example.org) for details.")),
    "think_then_json_array": (
        '<think>calling</think>\n[{"name": "f", "arguments": {"x": 1}}]', THINK, J, ThinkStart.optional,
        Assembled(reasoning="calling", tool_calls=[ToolCall("call_0", "f", '{"x": 1}')])),
    "no_tools_passthrough": (
        '<think>hm</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', THINK, NONE,
        ThinkStart.optional,
        Assembled(reasoning="hm", content='<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_piece_parse_is_exact(name):
    text, rp, tp, start, expected = CASES[name]
    got, events = parse([text], rp, tp, start)
    assert got == expected
    check_well_formed(events)
    for call in got.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_byte_split_reassembles(name):
    text, rp, tp, start, expected = CASES[name]
    for cut in range(len(text.encode()) + 1):
        got, events = parse(byte_split(text, cut), rp, tp, start)
        assert got == expected, cut
        check_well_formed(events)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_pair_of_character_splits_reassembles(name):
    text, rp, tp, start, expected = CASES[name]
    n = len(text)
    for i in range(n + 1):
        for j in range(i, n + 1, 5):
            got, _ = parse([text[:i], text[i:j], text[j:]], rp, tp, start)
            assert got == expected, (i, j)


@pytest.mark.parametrize("name", sorted(CASES))
def test_token_by_token_through_the_detokenizer(name, qwen3_core):
    """The serving path: token ids through the incremental detokenizer, one at a time."""
    from flare.server.text import IncrementalDetokenizer, TextCodec

    text, rp, tp, start, expected = CASES[name]
    codec = TextCodec(str(qwen3_core / "tokenizer.json"))
    toks = codec.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(codec, codec.encode("<|im_start|>assistant\n", add_special_tokens=False))
    pieces = [detok.push([t]) for t in toks] + [detok.flush()]
    assert "".join(pieces) == text
    got, events = parse(pieces, rp, tp, start)
    assert got == expected
    check_well_formed(events)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(CASES)), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_random_multiway_splits_reassemble(name, cuts):
    text, rp, tp, start, expected = CASES[name]
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    got, events = parse(pieces, rp, tp, start)
    assert got == expected
    check_well_formed(events)


def test_arguments_stream_before_the_call_closes():
    """Argument text is emitted as it arrives (not only at </tool_call>), and the name
    as soon as it is complete."""
    p = OutputParser(PLAIN, H, think_start=ThinkStart.closed, new_id=ids())
    assert p.feed('<tool_call>\n{"name": "get_wea') == []
    assert p.feed('ther", "arguments": {"city": "Pa') == [ToolStart(0, "call_0", "get_weather"),
                                                          ToolArgs(0, '{"city": "Pa')]
    assert p.feed('ris"}') == [ToolArgs(0, 'ris"')]  # the final } may still be the object's own
    assert p.feed("}\n</tool") == [ToolArgs(0, "}")]
    assert p.feed("_call>") == [ToolEnd(0)]
    assert p.finish() == []


MALFORMED = {
    "missing_brace": ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', H),
    "no_arguments": ('<tool_call>\n{"name": "get_weather"}\n</tool_call>', H),
    "unterminated": ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', H),
    "arguments_not_object": ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', H),
    "extra_key": ('<tool_call>\n{"name": "f", "arguments": {}, "id": 3}\n</tool_call>', H),
    "repeated_name": ('<tool_call>\n{"name": "f", "arguments": {}, "name": "g"}\n</tool_call>', H),
    "not_json": ("<tool_call>\nget_weather(city='Paris')\n</tool_call>", H),
    "array_garbage": ('[{"name": "f", "arguments": {}}, oops]', J),
    "array_unterminated": ('[{"name": "f", "arguments": {"a": 1}}', J),
    "array_text_after": ('[{"name": "f", "arguments": {}}] and some text', J),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_calls_are_reported_never_content(name):
    """At every split point the output fails with a typed error, and no content delta
    emitted before the failure carries any of the call's text."""
    text, tp = MALFORMED[name]
    for cut in range(len(text) + 1):
        p = OutputParser(PLAIN, tp, think_start=ThinkStart.closed, new_id=ids())
        events = []
        with pytest.raises(ModelOutputError) as e:
            for piece in (text[:cut], text[cut:]):
                events += p.feed(piece)
            p.finish()
        assert (e.value.code, e.value.status) == ("malformed_tool_call", 422)
        content = "".join(x.text for x in events if isinstance(x, Content))
        assert "Sure.".startswith(content), (cut, content)  # only the answer text before the call


@pytest.mark.parametrize("header,expected", [
    ("<|im_start|>assistant\n", ThinkStart.optional),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", ThinkStart.closed),
    ("<|im_start|>assistant\n<think>\n", ThinkStart.inside),
    ("<｜Assistant｜><think>\n", ThinkStart.inside),
])
def test_reasoning_start_from_the_generation_header(header, expected):
    assert start_for(header) == expected


def test_unterminated_reasoning_stays_reasoning():
    got, _ = parse(["<think>still thinking when max_tokens hit"], THINK, H)
    assert got == Assembled(reasoning="still thinking when max_tokens hit")
    got, _ = parse(["  <thi"], THINK, H)  # a prefix of <think> that never completed is text
    assert got == Assembled(content="  <thi")
