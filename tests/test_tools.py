"""Tool definitions, tool_choice and the rules the pipeline applies to parsed calls."""

from __future__ import annotations

import pytest

from flare.core.errors import FrontendError, ModelOutputError
from flare.server import tools as T
from flare.server.parsers import Content, Reasoning, ToolArgs, ToolEnd, ToolStart
from flare.server.pipeline import _Policy

A = T.Tool("get_weather", "Weather", {"type": "object"})
B = T.Tool("get_time", None, None)


def test_make_tool_validates_and_refuses_strict():
    assert T.make_tool("f.x-1_", None, None, False, "tools[0]") == T.Tool("f.x-1_", None, None)
    for name in ("", "has space", "x" * 65, 3):
        with pytest.raises(FrontendError) as e:
            T.make_tool(name, None, None, None, "tools[2].function")
        assert e.value.param == "tools[2].function.name"
    with pytest.raises(FrontendError) as e:
        T.make_tool("f", None, None, True, "tools[1]")
    assert (e.value.param, e.value.code, e.value.status) == ("tools[1].strict", "unsupported", 400)
    with pytest.raises(FrontendError) as e:
        T.make_tool("f", None, ["not", "a", "schema"], None, "tools[0]")
    assert e.value.param == "tools[0].parameters"
    with pytest.raises(FrontendError) as e:
        T.check_unique([A, B, A], "tools")
    assert e.value.param == "tools[2].name"


def test_choice_and_offered_tools():
    assert T.offered([A, B], T.choose([A, B], "auto", None, "tool_choice")) == [A, B]
    assert T.offered([A, B], T.choose([A, B], "none", None, "tool_choice")) == []
    assert T.offered([A, B], T.choose([A, B], "required", None, "tool_choice")) == [A, B]
    assert T.offered([A, B], T.choose([A, B], "named", "get_time", "tool_choice")) == [B]
    with pytest.raises(FrontendError, match="not among the declared tools"):
        T.choose([A], "named", "get_time", "tool_choice")
    with pytest.raises(FrontendError, match="no tools are declared"):
        T.choose([], "required", None, "tool_choice")


def test_required_instruction_joins_or_leads_the_system_message():
    user = {"role": "user", "content": "hi"}
    assert T.with_instruction([user]) == [{"role": "system", "content": T.REQUIRED_INSTRUCTION}, user]
    sys = {"role": "system", "content": "Be brief."}
    assert T.with_instruction([sys, user]) == [
        {"role": "system", "content": f"Be brief.\n\n{T.REQUIRED_INSTRUCTION}"}, user]
    assert sys["content"] == "Be brief."  # the request's own message is not modified


def call(i: int, name: str) -> list:
    return [ToolStart(i, f"c{i}", name), ToolArgs(i, "{}"), ToolEnd(i)]


def test_policy_auto_required_named():
    auto = _Policy(T.AUTO, {"get_weather", "get_time"}, parallel=True)
    events = [Reasoning("r"), Content("text"), *call(0, "get_weather"), *call(1, "get_time")]
    assert auto.filter(events) == events
    auto.check_finish()
    _Policy(T.AUTO, {"get_weather"}, parallel=True).check_finish()  # auto may answer without calls

    required = _Policy(T.ToolChoice(T.ChoiceMode.required), {"get_weather"}, parallel=True)
    assert required.filter([Content("no call")]) == [Content("no call")]
    with pytest.raises(ModelOutputError) as e:
        required.check_finish()
    assert (e.value.code, e.value.status) == ("tool_call_required", 422)
    started = _Policy(T.ToolChoice(T.ChoiceMode.required), {"get_weather"}, parallel=True)
    started.filter([ToolStart(0, "c0", "get_weather")])  # started but never completed
    with pytest.raises(ModelOutputError):
        started.check_finish()

    named = _Policy(T.ToolChoice(T.ChoiceMode.named, "get_weather"), {"get_weather"}, parallel=True)
    assert named.filter([Reasoning("r"), Content("answer"), *call(0, "get_weather")]) == [
        Reasoning("r"), *call(0, "get_weather")]
    named.check_finish()


def test_policy_rejects_undeclared_and_extra_calls():
    with pytest.raises(ModelOutputError) as e:
        _Policy(T.AUTO, {"get_weather"}, parallel=True).filter(call(0, "rm_rf"))
    assert e.value.code == "unknown_tool"
    single = _Policy(T.AUTO, {"get_weather"}, parallel=False)
    assert single.filter(call(0, "get_weather")) == call(0, "get_weather")
    with pytest.raises(ModelOutputError) as e:
        single.filter(call(1, "get_weather"))
    assert e.value.code == "too_many_tool_calls"
