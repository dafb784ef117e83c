"""Request bodies into typed structs (msgspec), with typed errors that name the field.

JSON nested deeper than ``MAX_NESTING`` containers is refused before decoding:
decoders (msgspec's, ``json``'s) descend recursively, and a body nested thousands
of levels deep would exhaust the interpreter's recursion limit, a 500 instead of a
400. The refusal names the field the nesting lies in, read from the body's type:
the path is cut where the type stops describing the body (free JSON), and a field
typed as a JSON schema fails like any schema too deep for a grammar
(``grammar_too_complex``, ``grammar.MAX_DEPTH``).

Depth is found in a few vectorised passes over the bytes (quotes that are not
escaped, then brackets outside strings), and only for a body holding more brackets
than the limit: fewer cannot nest deeper.
"""

from __future__ import annotations

from typing import Any, Iterator

import msgspec
import msgspec.inspect as mi
import numpy as np

from flare.core.errors import FrontendError
from flare.server.grammar import too_deep

MAX_NESTING = 128  # containers in a body: room for a schema of grammar.MAX_DEPTH under its field
_QUOTE, _BACKSLASH, _COLON, _COMMA = 0x22, 0x5C, 0x3A, 0x2C
_OPEN, _CLOSE = (0x5B, 0x7B), (0x5D, 0x7D)  # [ {   ] }


def decode_body(body: bytes, kind: type):
    if body.count(b"[") + body.count(b"{") > MAX_NESTING:
        nesting = _Nesting(body, MAX_NESTING)
        if nesting.found:
            raise _nesting_error(kind, nesting.path())
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise _invalid(e, "") from None
    except msgspec.DecodeError as e:
        raise FrontendError(f"request body is not valid JSON: {e}", code="invalid_json") from None


def convert(value: Any, kind: type, param: str):
    """``value`` (decoded JSON, found at ``param``) as ``kind``; errors name the field."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as e:
        raise _invalid(e, param) from None


def _invalid(e: msgspec.ValidationError, prefix: str) -> FrontendError:
    """msgspec's error with its path (``$.a[0]``) made absolute and named in ``param``."""
    text, sep, at = str(e).rpartition(" - at `$")
    if not sep:
        return FrontendError(f"invalid request: {e}", param=prefix or None, code="invalid_request")
    at = at.rstrip("`")
    param = prefix + at if prefix else (at[1:] if at.startswith(".") else None)
    where = f" - at `$.{param}`" if param else f" - at `${at}`"
    return FrontendError(f"invalid request: {text}{where}", param=param, code="invalid_request")


# ---------------------------------------------------------------------------
# nesting


def _real_quotes(a: np.ndarray) -> np.ndarray:
    """Positions of the quotes that open or close strings: not escaped, that is not
    after an odd run of backslashes."""
    quotes = np.flatnonzero(a == _QUOTE)
    after = (quotes > 0) & (a[quotes - 1] == _BACKSLASH)
    if not after.any():
        return quotes
    slashes = np.flatnonzero(a == _BACKSLASH)
    starts = np.ones(slashes.size, bool)
    starts[1:] = np.diff(slashes) != 1
    run_start = slashes[np.maximum.accumulate(np.where(starts, np.arange(slashes.size), 0))]
    k = np.searchsorted(slashes, quotes[after] - 1)
    escaped = (slashes[k] - run_start[k]) % 2 == 0  # run length odd
    return np.delete(quotes, np.flatnonzero(after)[escaped])


class _Nesting:
    """Where the JSON text ``body`` first nests deeper than ``limit`` containers, and the
    keys and indices that lead there."""

    def __init__(self, body: bytes, limit: int):
        self.body = body
        a = self.a = np.frombuffer(body, np.uint8)
        self.quotes = _real_quotes(a)
        brackets = np.flatnonzero(np.isin(a, _OPEN + _CLOSE))
        self.brackets = brackets[np.searchsorted(self.quotes, brackets) % 2 == 0]  # outside strings
        opens = np.isin(a[self.brackets], _OPEN)
        self.depth = np.cumsum(np.where(opens, 1, -1))  # after each bracket
        over = np.flatnonzero(self.depth > limit)
        self.found = over.size > 0
        if not self.found:
            return
        # The containers open where it goes too deep, outermost first: at each depth, the
        # last container opened there (any later one at that depth closed it first).
        first = over[0]
        ks = np.flatnonzero(opens[:first + 1] & (self.depth[:first + 1] >= 1))
        last = np.full(limit + 2, -1)
        np.maximum.at(last, self.depth[ks], ks)
        self.chain = last[1:]  # indices into brackets; -1 where the text is not well formed

    def path(self) -> Iterator[str | int]:
        """The key or index of each container on the way in, outermost first."""
        for level, (k, child) in enumerate(zip(self.chain[:-1], self.chain[1:]), start=1):
            if k < 0 or child < 0:
                return
            start, end = self.brackets[k], self.brackets[child]
            step = self._key(end) if self.a[start] == _OPEN[1] else self._index(k, child, level)
            if step is None:
                return
            yield step

    def _key(self, child: int) -> str | None:
        """The member name before the value that starts at ``child``."""
        j = self._skip_space(child - 1)
        if j < 0 or self.a[j] != _COLON:
            return None
        j = self._skip_space(j - 1)
        q = int(np.searchsorted(self.quotes, j))
        if j < 0 or q == 0 or q >= self.quotes.size or self.quotes[q] != j:
            return None
        try:
            return msgspec.json.decode(self.body[self.quotes[q - 1]:j + 1], type=str)
        except msgspec.MsgspecError:
            return None

    def _index(self, k: int, child: int, level: int) -> int:
        """The element index of the value at bracket ``child`` in the array at ``k``:
        the commas between them at the array's own depth."""
        lo, hi = self.brackets[k], self.brackets[child]
        commas = lo + np.flatnonzero(self.a[lo:hi] == _COMMA)
        commas = commas[np.searchsorted(self.quotes, commas) % 2 == 0]
        depth = self.depth[np.searchsorted(self.brackets, commas) - 1]
        return int(np.count_nonzero(depth == level))

    def _skip_space(self, j: int) -> int:
        while j >= 0 and self.a[j] in b" \t\r\n":
            j -= 1
        return j


def _step(t: mi.Type, key: str | int) -> tuple[bool, mi.Type | None]:
    """Whether ``t`` is a container that ``key`` indexes, and the type found there
    (None: the body's type does not describe it)."""
    if isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.StructType) and isinstance(key, str):
        return True, next((f.type for f in t.fields if f.encode_name == key), None)
    if isinstance(t, mi.ListType) and isinstance(key, int):
        return True, t.item_type
    if isinstance(t, mi.UnionType):
        steps = [_step(m, key) for m in t.types]
        return any(ok for ok, _ in steps), next((c for _, c in steps if c is not None), None)
    return False, None


def _is_schema(t: mi.Type) -> bool:
    if isinstance(t, mi.UnionType):
        return any(_is_schema(m) for m in t.types)
    return isinstance(t, mi.Metadata) and bool((t.extra or {}).get("json_schema"))


def _nesting_error(kind: type, path: Iterator[str | int]) -> FrontendError:
    t, param = mi.type_info(kind), ""
    for key in path:
        ok, child = _step(t, key)
        if not ok:
            break
        param = f"{param}[{key}]" if isinstance(key, int) else f"{param}.{key}" if param else key
        if child is None:
            break
        t = child
        if _is_schema(t):
            return too_deep(param)
    return FrontendError(f"{param or 'the request body'} is nested more than {MAX_NESTING} levels deep",
                         param=param or None, code="nesting_too_deep")
