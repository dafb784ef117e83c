"""Structured output: the composed output grammar, compiled with llguidance.

The grammar a request decodes under is composed from three parts
(docs/agent-api.md, "Structured output"): the reasoning delimiters of the core's
reasoning parser, the answer format the client asked for (a JSON schema, any JSON
object, a regex, or a Lark grammar), and, when tools are callable, the tool-call
syntax of the core's tool parser with each call's payload held to
``{"name": <a declared tool>, "arguments": <its parameters schema>}``::

    start     : [reasoning] body
    body      : answer | calls          (calls only when tools are callable)
    reasoning : <think> free text </think> [short separator]

The answer is constrained; reasoning is free text; tool payloads are parsed by
the tool parser as usual. Markers that the tokenizer holds as single added
tokens (llguidance treats every added token as special) are referenced by id,
so the model emits the token it was trained on; other markers are literal text.

JSON is compact with the conventional separators (``", "`` and ``": "``) and no
free whitespace: a model cannot wander off into blank space, and a random
model terminates as soon as the schema's own bounds allow.

Compilation (building the llguidance matcher) runs on a small thread pool,
never on the event loop; llguidance releases the GIL while it builds. A request
waits at most ``timeout_s`` for its grammar and then fails with a typed error;
the compile finishes in the background and its outcome is cached (keyed by the
grammar text, LRU), so a retry of the same grammar is answered at once and no
grammar is compiled twice while it stays cached. Deterministic bounds come
first: schemas nested deeper than ``MAX_DEPTH`` are refused before compiling,
and llguidance's own size limits reject oversized grammars quickly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Literal

import llguidance
import numpy as np

from flare.core.errors import GrammarError
from flare.core.manifest import ToolParser
from flare.server.parsers import ThinkStart
from flare.server.parsers import hermes, think

MAX_DEPTH = 48  # nested JSON containers in a schema (llguidance itself stops near 128)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Per-step bounds on mask computation (llguidance's fuel units): a mask costs at most a
# few milliseconds on the engine loop; a grammar that needs more fails its request.
STEP_LIMITS = {"step_lexer_fuel": 100_000, "step_max_items": 50_000}


@dataclass(frozen=True)
class AnswerFormat:
    kind: Literal["json_object", "json_schema", "regex", "grammar"]
    spec: Any = None  # the schema (dict), the regex or the Lark grammar (str)
    param: str = "response_format"  # where it came from, for error messages


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict | None


def too_deep(param: str, limit: int = MAX_DEPTH) -> GrammarError:
    return GrammarError(f"{param} is nested more than {limit} levels deep", param=param, code="grammar_too_complex")


def check_depth(value: Any, param: str, limit: int = MAX_DEPTH) -> None:
    """Reject JSON nested deeper than ``limit`` containers (iteratively: a deep value
    must not exhaust the interpreter's recursion either; request bodies are bounded
    before decoding, ``decode.MAX_NESTING``)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if d > limit:
            raise too_deep(param, limit)
        stack.extend((c, d + 1) for c in children)


def _answer_grammar(answer: AnswerFormat) -> dict:
    if answer.kind == "json_object":
        return {"name": "answer", "json_schema": {"type": "object", "x-guidance": JSON_STYLE}}
    if answer.kind == "json_schema":
        schema = answer.spec
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object", param=answer.param)
        check_depth(schema, answer.param)
        style = {**JSON_STYLE, **(schema.get("x-guidance") or {})}
        return {"name": "answer", "json_schema": {**schema, "x-guidance": style}}
    if answer.kind == "regex":
        if not isinstance(answer.spec, str) or not answer.spec:
            raise GrammarError("the regex must be a non-empty string", param=answer.param)
        return {"name": "answer", "lark_grammar": f"start: /{llguidance.regex_to_lark(answer.spec)}/\n"}
    if not isinstance(answer.spec, str) or not answer.spec.strip():
        raise GrammarError("the grammar must be a non-empty Lark grammar", param=answer.param)
    return {"name": "answer", "lark_grammar": answer.spec}


def compose(answer: AnswerFormat, *, think_start: ThinkStart | None, tools: list[ToolSpec] | None,
            tool_format: ToolParser, parallel: bool, marker: Callable[[str], str]) -> str:
    """The llguidance grammar (its JSON form) for one request. ``marker`` turns a
    marker string into a Lark fragment (a token reference or a literal)."""
    rules = ["%llguidance {}"]
    body = "answer"
    if tools:
        calls = []
        for t in tools:
            params = t.parameters if t.parameters is not None else {"type": "object"}
            check_depth(params, f"tools ({t.name}) parameters")
            calls.append({"type": "object", "properties": {"name": {"const": t.name}, "arguments": params},
                          "required": ["name", "arguments"], "additionalProperties": False})
        one = {"anyOf": calls}
        if tool_format == ToolParser.hermes:
            rules += [f'call: {marker(hermes.OPEN)} "\\n" call_json "\\n" {marker(hermes.CLOSE)}',
                      "calls: call" + (' ("\\n" call)*' if parallel else ""),
                      f"call_json: %json {json.dumps({**one, 'x-guidance': JSON_STYLE})}"]
        elif tool_format == ToolParser.json_array:
            array = {"type": "array", "items": one, "minItems": 1, "x-guidance": JSON_STYLE}
            if not parallel:
                array["maxItems"] = 1
            rules.append(f"calls: %json {json.dumps(array)}")
        else:
            raise GrammarError("this core has no tool-call syntax", param="tools", code="unsupported")
        body = "answer | calls"
    rules += [f"body: {body}", "answer: @answer"]
    if think_start in (ThinkStart.optional, ThinkStart.inside):
        close = marker(think.CLOSE)
        if close.startswith("<["):  # a token: free text up to it
            rules += [f"think_rest: THINK_TEXT {close} SEP?", r"THINK_TEXT: /(.|\n)*/"]
        else:  # literal text: a lazy lexeme that ends at the first close marker
            escaped = llguidance.regex_to_lark("".join("\\" + c if not c.isalnum() else c for c in think.CLOSE))
            rules += ["think_rest: think_text SEP?", f"think_text[lazy]: /(.|\\n)*{escaped}/"]
        rules.append(r"SEP: /[ \t\r\n]{1,4}/")
        if think_start == ThinkStart.optional:
            rules += ["start: think_block? body", f"think_block: {marker(think.OPEN)} think_rest"]
        else:
            rules.append("start: think_rest body")
    else:
        rules.append("start: body")
    return json.dumps({"grammars": [{"lark_grammar": "\n".join(rules) + "\n"}, _answer_grammar(answer)]})


class RequestGrammar:
    """One request's matcher; implements the runtime's ``Grammar`` protocol."""

    def __init__(self, matcher: llguidance.LLMatcher, specials: np.ndarray):
        self._m = matcher
        self._specials = specials
        self._failure: str | None = None

    def fill_mask(self, out: np.ndarray) -> bool:
        if self._m.is_error():
            return False
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._m.is_error():
            return False
        # llguidance (1.9) may allow a special token where the grammar forces the same
        # text as bytes (a literal "<tool_call>" in an answer grammar) and then reject it
        # when consumed. The few special ids a mask allows are checked one by one.
        # Such text cannot be produced (the forced token is its only spelling): the mask
        # is then empty and the request fails instead of sampling from nothing.
        words = out.view(np.uint32)
        sp = self._specials
        for t in sp[(words[sp >> 5] >> (sp & 31).astype(np.uint32)) & 1 == 1]:
            if self._m.validate_tokens([int(t)]) != 1:
                words[t >> 5] &= np.uint32(~(1 << int(t & 31)) & 0xFFFFFFFF)
                if not words.any():
                    self._failure = ("the grammar allows no token here (text equal to a special token cannot "
                                     "be forced as plain text; reference the token instead)")
                    return False
        return True

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token)

    def error(self) -> str:
        return self._failure or _first_line(self._m.get_error())


@dataclass(frozen=True)
class CompiledGrammar:
    matcher: llguidance.LLMatcher  # never advanced: every request takes a copy
    seconds: float
    specials: np.ndarray  # token ids llguidance treats as special, EOS excluded

    def new(self) -> RequestGrammar:
        return RequestGrammar(self.matcher.deep_copy(), self.specials)


@dataclass(frozen=True)
class _Outcome:
    grammar: CompiledGrammar | None
    error: str | None
    seconds: float


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop has closed (shutdown): nobody needs the outcome
        pass


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:500] if message.strip() else "unknown error"


class GrammarCompiler:
    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_ids: tuple[int, ...], timeout_s: float = 5.0,
                 cache_size: int = 128, workers: int = 2):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
        # llguidance treats every added token of the form <...> as special (markers included).
        self.specials = np.array([t for t in range(vocab_size)
                                  if t not in eos_ids and self.tokenizer.is_special_token(t)], np.int64)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.limits = llguidance.LLParserLimits(**STEP_LIMITS, verbose_errors=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="flare-grammar")
        self._cache: OrderedDict[str, _Outcome] = OrderedDict()
        self._running: dict[str, concurrent.futures.Future] = {}
        self.compiles = 0  # compilations started (cache misses)

    def marker(self, text: str, ids: list[int]) -> str:
        """Lark fragment for a marker whose tokenization is ``ids``."""
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    async def compile(self, grammar: str, param: str = "response_format") -> CompiledGrammar:
        key = hashlib.sha256(grammar.encode()).hexdigest()
        outcome = self._cache.get(key)
        if outcome is None:
            fut = self._running.get(key)
            if fut is None:
                fut = self._pool.submit(self._build, grammar)
                self._running[key] = fut
                self.compiles += 1
                loop = asyncio.get_running_loop()
                fut.add_done_callback(lambda f, key=key: _call_soon(loop, self._store, key, f))
            try:
                outcome = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)
            except asyncio.TimeoutError:
                raise GrammarError(f"the output grammar did not compile within {self.timeout_s:g} s",
                                   param=param, code="grammar_compile_timeout") from None
        else:
            self._cache.move_to_end(key)
        if outcome.error is not None:
            raise GrammarError(f"the output grammar is not valid: {outcome.error}", param=param)
        return outcome.grammar

    def _build(self, grammar: str) -> _Outcome:
        t0 = time.perf_counter()
        try:
            m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        except (ValueError, TypeError) as e:  # API-level rejections (grammar errors never raise)
            return _Outcome(None, _first_line(str(e)), time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        if m.is_error():
            return _Outcome(None, _first_line(m.get_error()), seconds)
        return _Outcome(CompiledGrammar(m, seconds, self.specials), None, seconds)

    def _store(self, key: str, fut: concurrent.futures.Future) -> None:
        """On the event loop, when a compile finishes (whether or not anyone still waits)."""
        self._running.pop(key, None)
        if fut.cancelled() or fut.exception() is not None:
            return
        self._cache[key] = fut.result()
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
