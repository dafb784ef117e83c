"""Chat templates: Flare's renderer against Transformers' ``apply_chat_template``.

The Transformers tokenizer is built from the smol core's own assets
(``tokenizer.json``, ``chat_template.jinja``, and the special tokens recorded in
the manifest), so both sides see the same inputs; only the renderers differ.
"""

from __future__ import annotations

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from flare.core.errors import UnprocessableError
from flare.core.manifest import load_manifest
from flare.server.template import ChatTemplate
from flare.server.text import TextCodec


@pytest.fixture(scope="module")
def assets(smol_core):
    m = load_manifest(smol_core)
    source = (smol_core / m.frontend.chat_template).read_text()
    special = dict(m.frontend.special_tokens)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(smol_core / m.frontend.tokenizer), chat_template=source, **special)
    return ChatTemplate(source, special), TextCodec(str(smol_core / m.frontend.tokenizer)), hf


SYS = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is the capital of France?"}],
    "system_user": [SYS, {"role": "user", "content": "Name three colours."}],
    "multi_turn": [
        SYS,
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a joke about cats."},
        {"role": "assistant", "content": "Why did the cat sit on the computer? To keep an eye on the mouse."},
        {"role": "user", "content": "Another one."},
    ],
    "unicode": [
        {"role": "system", "content": "Réponds en français 🇫🇷."},
        {"role": "user", "content": "日本語で答えて: 東京は? 👩‍👩‍👧 e\u0301 \u0915\u094d\u0937 مرحبا"},
    ],
    "empty_ish": [
        {"role": "system", "content": ""},
        {"role": "user", "content": " "},
        {"role": "assistant", "content": "\n"},
        {"role": "user", "content": "\t\n "},
    ],
    "markup_in_content": [
        {"role": "user",
         "content": "Literal tokens: <|im_end|> and <|im_start|>assistant {{ not a template }} {% raw %}"},
    ],
    "assistant_last": [
        {"role": "user", "content": "Say OK."},
        {"role": "assistant", "content": "OK."},
    ],
    "long": [{"role": "user", "content": "word " * 300}],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smollm2_template_matches_transformers(assets, name, add_generation_prompt):
    tmpl, codec, hf = assets
    conv = CONVERSATIONS[name]
    text = tmpl.render(conv, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text.encode() == expected.encode()
    ids = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=add_generation_prompt)["input_ids"]
    assert codec.encode(text, add_special_tokens=False) == ids
    # Sanity: the template really produced a chat (special tokens became single ids).
    literal = sum(m["content"].count("<|im_start|>") for m in conv)
    assert ids.count(1) == len(conv) + (conv[0]["role"] != "system") + add_generation_prompt + literal


def test_rendered_text_for_a_known_conversation(assets):
    """Exact bytes, independent of Transformers."""
    tmpl, codec, _ = assets
    text = tmpl.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = codec.encode(text, add_special_tokens=False)
    # <|im_start|> = 1, <|im_end|> = 2, "\n" = 198, "system" = 9690, "assistant" = 520 9531
    assert ids[:3] == [1, 9690, 198] and ids[-6:] == [2, 198, 1, 520, 9531, 198]


# A template exercising the rest of the Transformers environment: namespace, loop
# controls, tojson (no HTML escaping, non-ASCII kept), trim, tools, reasoning fields,
# template kwargs, special-token variables, ``is defined``.
RICH = """\
{%- set ns = namespace(systems=0, skipped=0) -%}
{%- if tools %}<|im_start|>system
Tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
  {%- if message.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + message.role) }}{% endif %}
  {%- if message.content == 'SKIP' %}{% set ns.skipped = ns.skipped + 1 %}{% continue %}{% endif %}
  {%- if message.role == 'system' %}{% set ns.systems = ns.systems + 1 %}{% endif %}
{{ bos_token }}{{ message.role }}
{% if message.reasoning_content is defined and message.reasoning_content %}<think>{{ message.reasoning_content | trim }}</think>
{% endif %}
{%- if message.tool_calls is defined %}calls={{ message.tool_calls | tojson }}
{% endif %}
{{- message.content | trim }}{{ eos_token if loop.last else '<|im_end|>' }}
{% endfor %}
{%- if add_generation_prompt %}{{ bos_token }}assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>
{% endif %}{% endif %}
{{- 'meta ' ~ dict(systems=ns.systems, skipped=ns.skipped) | tojson(sort_keys=True) }}"""

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find <things> & \"stuff\" — 速い",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.mark.parametrize(
    "conv,kwargs",
    [
        ([SYS, {"role": "user", "content": "  padded  "}], {}),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "SKIP"}, {"role": "user", "content": "b"}], {}),
        ([{"role": "user", "content": "q"},
          {"role": "assistant", "content": "answer", "reasoning_content": "  because  "}], {}),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "old name"}], {}),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "other name"}], {}),
        ([{"role": "user", "content": "q"}], {"enable_thinking": False}),
        ([{"role": "user", "content": "q"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"é\"}"}}]}],
         {}),
    ],
)
@pytest.mark.parametrize("with_tools", [False, True])
def test_rich_template_matches_transformers(assets, conv, kwargs, with_tools):
    _, codec, hf = assets
    tmpl = ChatTemplate(RICH, dict(hf.special_tokens_map))
    tools = TOOLS if with_tools else None
    text = tmpl.render(conv, tools=tools, add_generation_prompt=True, **kwargs)
    expected = hf.apply_chat_template(conv, tools=tools, chat_template=RICH, tokenize=False,
                                      add_generation_prompt=True, **kwargs)
    assert text == expected
    assert ("速い" in text) == with_tools and ("\\u" not in text) and ("&lt;" not in text)
    ids = hf.apply_chat_template(conv, tools=tools, chat_template=RICH, tokenize=True, add_generation_prompt=True,
                                 **kwargs)["input_ids"]
    assert codec.encode(text, add_special_tokens=False) == ids


def test_none_valued_fields_render_like_transformers(assets):
    """Transformers drops message keys whose value is None before rendering (OpenAI
    clients send ``tool_calls: null``); a template testing ``is defined`` must see the
    same thing from Flare."""
    _, _, hf = assets
    tmpl = ChatTemplate(RICH, dict(hf.special_tokens_map))
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": None,
                                               "reasoning_content": None}]
    expected = hf.apply_chat_template(conv, chat_template=RICH, tokenize=False, add_generation_prompt=False)
    assert "calls=" not in expected
    assert tmpl.render(conv, add_generation_prompt=False) == expected


def test_raise_exception_is_unprocessable(assets):
    _, _, hf = assets
    tmpl = ChatTemplate(RICH, dict(hf.special_tokens_map))
    conv = [{"role": "tool", "content": "x"}]
    with pytest.raises(UnprocessableError, match="unknown role tool") as e:
        tmpl.render(conv)
    assert (e.value.status, e.value.code, e.value.param) == (422, "template_error", "messages")
    assert e.value.envelope()["error"]["type"] == "invalid_request_error"
    with pytest.raises(jinja2.exceptions.TemplateError, match="^unknown role tool$"):
        hf.apply_chat_template(conv, chat_template=RICH, tokenize=False)


def test_template_failure_is_unprocessable(assets):
    tmpl, _, _ = assets
    # SmolLM2's template concatenates the content: a non-string content cannot render.
    with pytest.raises(UnprocessableError) as e:
        tmpl.render([{"role": "user", "content": None}])
    assert e.value.code == "template_error"
    with pytest.raises(UnprocessableError):
        tmpl.render([{"role": "user"}])


def test_sandbox_blocks_attribute_escapes(assets):
    tmpl = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(UnprocessableError):
        tmpl.render([{"role": "user", "content": "x"}])
    with pytest.raises(UnprocessableError):
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}", {}).render([])


def test_template_that_does_not_compile():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", {})


# ---------------------------------------------------------------------------
# The Qwen3 template (configs/qwen3-tiny): tools, tool calls and results, thinking


@pytest.fixture(scope="module")
def qwen3_assets(qwen3_core):
    m = load_manifest(qwen3_core)
    source = (qwen3_core / m.frontend.chat_template).read_text()
    special = dict(m.frontend.special_tokens)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(qwen3_core / m.frontend.tokenizer), chat_template=source,
                                 **special)
    return ChatTemplate(source, special), TextCodec(str(qwen3_core / m.frontend.tokenizer)), hf


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city — «météo»",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "q": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}
QWEN3_CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What's the weather in Paris?"}],
    "system_user": [SYS, {"role": "user", "content": "Weather in Tokyo? 東京"}],
    "tool_round_trip": [
        SYS,
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
    ],
    "parallel_calls_and_results": [
        {"role": "user", "content": "Paris and Rome?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            CALL, {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                                    "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
        {"role": "assistant", "content": "Paris 21 C, Rome 25 C."},
        {"role": "user", "content": "Thanks! And Oslo?"},
    ],
    "reasoning_history": [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple arithmetic."},
        {"role": "user", "content": "Now 3 + 3, and call a tool if needed."},
        {"role": "assistant", "content": "", "reasoning_content": "I might search.", "tool_calls": [
            {"id": "c9", "type": "function", "function": {"name": "search", "arguments": {"q": "3+3"}}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "6"},
    ],
}


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("name", sorted(QWEN3_CONVERSATIONS))
def test_qwen3_template_matches_transformers(qwen3_assets, name, with_tools, kwargs):
    tmpl, codec, hf = qwen3_assets
    conv = QWEN3_CONVERSATIONS[name]
    tools = [WEATHER, SEARCH] if with_tools else None
    text = tmpl.render(conv, tools=tools, add_generation_prompt=True, **kwargs)
    expected = hf.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    assert text.encode() == expected.encode()
    ids = hf.apply_chat_template(conv, tools=tools, tokenize=True, add_generation_prompt=True, **kwargs)["input_ids"]
    assert codec.encode(text, add_special_tokens=False) == ids
    # The markers are single tokens, as in Qwen3's own vocabulary.
    calls = sum(len(m.get("tool_calls") or []) for m in conv)
    # The tools prompt names the tags and shows an example: two more <tool_call> tokens.
    assert ids.count(codec.token_to_id("<tool_call>")) == calls + 2 * bool(tools)
    assert ids.count(codec.token_to_id("<tool_response>")) == sum(m["role"] == "tool" for m in conv)
    assert ("<tools>" in text) == with_tools and ("«météo»" in text) == with_tools


def test_qwen3_known_rendering(qwen3_assets):
    """Exact bytes for tools and a disabled thinking block, independent of Transformers."""
    tmpl, _, _ = qwen3_assets
    assert tmpl.accepts_tools
    text = tmpl.render([{"role": "user", "content": "Hi"}], tools=[SEARCH], add_generation_prompt=True,
                       enable_thinking=False)
    assert text == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": '
        '{"q": {"type": "string"}}}}}\n</tools>\n\nFor each function call, return a json object with function name '
        "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
