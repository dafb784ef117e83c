"""Chat templates rendered like Transformers' ``apply_chat_template``.

Same jinja2 environment (sandboxed, trim_blocks, lstrip_blocks, loopcontrols,
a ``tojson`` that does not escape HTML, ``raise_exception``, ``strftime_now``,
restricted ``dict`` and ``namespace``), the tokenizer's special tokens as
template variables, and the same message preprocessing (reasoning fields
aliased), so the rendered bytes and token ids are identical. The prompt is
then tokenized without adding special tokens, as Transformers does.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from flare.core.errors import UnprocessableError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (assistant-mask markers) and
    renders its body unchanged, as Transformers does when not tracking."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"underscore-prefixed namespace attribute {name!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        # Transformers drops keys whose value is None first (clients send ``tool_calls: null``),
        # so ``is defined`` tests in templates see a missing key, not None.
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source = source
        self.special_tokens = dict(special_tokens)
        env = _environment()
        try:
            self._template = env.from_string(source)
            variables = jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e}") from e
        # A template that never reads ``tools`` cannot show them to the model.
        self.accepts_tools = "tools" in variables

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=_alias_reasoning(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:
            raise UnprocessableError(f"the chat template rejected this conversation: {e}", param="messages",
                                     code="template_error") from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise UnprocessableError(f"the chat template failed on this conversation: {e}", param="messages",
                                     code="template_error") from e
