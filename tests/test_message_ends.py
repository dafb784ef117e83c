"""Message ends (``flare.server.message_ends``): template marks mapped through token offsets, never inside a
token, the open assistant header excluded."""

from __future__ import annotations

from pathlib import Path

import pytest

from flare.server.message_ends import message_marks, token_endpoints
from flare.server.template import ChatTemplate
from flare.server.text import TextCodec

TOKENIZER = Path(__file__).resolve().parents[1] / "configs" / "tokenizers" / "smollm2"
SPECIAL = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(str(TOKENIZER / "tokenizer.json"))


@pytest.fixture(scope="module")
def chatml() -> ChatTemplate:
    return ChatTemplate((TOKENIZER / "chat_template.jinja").read_text(), SPECIAL)


def test_cuts_only_between_tokens():
    # "helloworld" -> hel | low | orld: a mark after "hello" (5) falls inside "low".
    offsets = [(0, 3), (3, 6), (6, 10)]
    assert token_endpoints(offsets, [5]) == ()
    assert token_endpoints(offsets, [3, 6]) == (1, 2)
    # Strictly inside the prompt, sorted and deduplicated.
    assert token_endpoints(offsets, [10, 0, 6, 3, 6]) == (1, 2)


def test_characters_split_over_byte_tokens():
    # "abc🌅def": the emoji is three byte-level tokens sharing one character span.
    offsets = [(0, 3), (3, 4), (3, 4), (3, 4), (4, 7)]
    assert token_endpoints(offsets, [3, 4]) == (1, 4)


def test_real_template_message_ends(chatml, codec):
    messages = [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'},
        {"role": "tool", "content": '{"temp_c": 21}'},
    ]
    text = chatml.render(messages, add_generation_prompt=True)
    ids, offsets = codec.encode_with_offsets(text, add_special_tokens=False)
    marks = message_marks(chatml, messages, text)
    ends = token_endpoints(offsets, marks)
    assert len(marks) == len(ends) == 4
    # Each endpoint is exactly the tokenization of the conversation up to that message.
    for j, e in enumerate(ends, start=1):
        prefix = codec.encode(chatml.render(messages[:j], add_generation_prompt=False), add_special_tokens=False)
        assert ids[:e] == prefix
        assert codec.tokenizer.id_to_token(ids[e - 1]) == "Ċ"  # the newline after <|im_end|>
    # The last message ends before the open assistant header, which is never an endpoint.
    header = codec.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ends[-1] == len(ids) - len(header) and ids[ends[-1]:] == header
    # Without a first system message the template injects one: prefixes still agree.
    text2 = chatml.render(messages[1:], add_generation_prompt=True)
    assert len(message_marks(chatml, messages[1:], text2)) == 3


def test_templates_that_rewrite_or_merge_turns_yield_no_wrong_marks(codec):
    # The last message is rendered differently from how it renders as an earlier turn:
    # only prefixes that really prefix the full text count.
    rewrite = ChatTemplate("{% for m in messages %}{% if loop.last %}[LAST]{% endif %}{{ m.content }}\n{% endfor %}",
                           {})
    msgs = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}, {"role": "user", "content": "3"}]
    text = rewrite.render(msgs, add_generation_prompt=False)
    assert text == "one\ntwo\n[LAST]3\n"
    assert message_marks(rewrite, msgs, text) == [len(text)]  # the whole text: the prompt end, not inside
    _, offsets = codec.encode_with_offsets(text, add_special_tokens=False)
    assert token_endpoints(offsets, message_marks(rewrite, msgs, text)) == ()
    # Messages concatenated without a separator: BPE merges across the boundary.
    concat = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}!", {})
    msgs = [{"role": "user", "content": "hello"}, {"role": "user", "content": "world"}]
    text = concat.render(msgs, add_generation_prompt=False)
    assert text == "helloworld!" and message_marks(concat, msgs, text) == [11]  # "hello!" is no prefix
    concat2 = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {})
    text = concat2.render(msgs, add_generation_prompt=False) + "!"
    marks = message_marks(concat2, msgs, text)
    _, offsets = codec.encode_with_offsets(text, add_special_tokens=False)
    assert marks == [5, 10] and token_endpoints(offsets, marks) == (3,)  # 5 lies inside "low"


def test_prefixes_the_template_refuses_give_no_mark():
    # Qwen3.5-style guard: a conversation without a user message is an error. The full
    # conversation renders; its system-only prefix does not, and yields no mark.
    guarded = ChatTemplate(
        "{% if not (messages | selectattr('role', 'equalto', 'user') | list) %}"
        "{{ raise_exception('No user query found in messages.') }}{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}", SPECIAL)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}]
    text = guarded.render(msgs, add_generation_prompt=False)
    assert message_marks(guarded, msgs, text) == [len("<system>sys</system><user>hi</user>"), len(text)]


def test_marks_come_from_the_most_recent_messages_only(chatml):
    from flare.server.message_ends import RECENT_MESSAGES

    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(40)]
    text = chatml.render(msgs, add_generation_prompt=True)
    marks = message_marks(chatml, msgs, text)
    expected = [len(chatml.render(msgs[:j], add_generation_prompt=False)) for j in range(41 - RECENT_MESSAGES, 41)]
    assert marks == expected


def test_template_variables_named_like_the_parameters_are_plain_variables(chatml):
    msgs = [{"role": "user", "content": "hi"}]
    kw = {"rendered": "x", "template": "y"}  # message_marks' own parameter names
    text = chatml.render(msgs, add_generation_prompt=False, **kw)
    assert message_marks(chatml, msgs, text, **kw) == [len(text)]
