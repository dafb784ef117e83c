"""Tokenization, incremental detokenization and stop strings.

The incremental detokenizer decodes a sliding window of token ids and emits
only text that is complete: while the newest tokens end inside a UTF-8
sequence (byte-fallback tokens decode to U+FFFD until the sequence closes),
their text is held back. The window starts with the last prompt tokens so
leading-space rules of the tokenizer's decoder see real context.
"""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer

CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _uses_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(d) for d in decoder.get("decoders") or ())


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TextCodec:
    def __init__(self, tokenizer_json_path: str):
        self.tokenizer = Tokenizer.from_file(tokenizer_json_path)
        with open(tokenizer_json_path, encoding="utf-8") as f:
            decoder = json.load(f).get("decoder")
        self._byte_level = _byte_level_alphabet() if _uses_byte_level(decoder) else None
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (log-probabilities' ``bytes``): byte-level BPE
        pieces mapped back through GPT-2's alphabet, byte-fallback pieces (``<0xE2>``)
        as their byte, other pieces as their UTF-8 text (``▁`` a space)."""
        got = self._bytes.get(token_id)
        if got is None:
            piece = self.tokenizer.id_to_token(token_id) or ""
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                got = bytes([int(m.group(1), 16)])
            elif self._byte_level is not None and piece and all(c in self._byte_level for c in piece):
                got = bytes(self._byte_level[c] for c in piece)
            elif "▁" in piece:
                got = piece.replace("▁", " ").encode()
            else:
                got = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
            self._bytes[token_id] = got
        return got

    def text_growth(self, context: list[int], token_id: int) -> int:
        """Characters ``token_id`` adds to the decoded text after ``context`` (its last few
        ids: decoders' leading-space rules need them): text offsets of tokens without
        decoding every prefix."""
        return len(self.decode([*context, token_id])) - len(self.decode(context))

    def token_text(self, token_id: int) -> str:
        """One token's text (a piece of a multi-byte character reads as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str, *, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, enc.offsets

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, codec: TextCodec, prompt_ids: list[int]):
        self.codec = codec
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # window start
        self.read = len(self.ids)  # ids before this were already emitted

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.codec.decode(self.ids[self.prefix : self.read])
        text = self.codec.decode(self.ids[self.prefix :])
        if len(text) > len(prefix_text) and not text.endswith(REPLACEMENT):
            delta = text[len(prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (an unfinished sequence
        decodes to U+FFFD, a complete character, never a broken byte sequence)."""
        prefix_text = self.codec.decode(self.ids[self.prefix : self.read])
        text = self.codec.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text) :] if len(text) > len(prefix_text) else ""


class StopMatcher:
    """Finds stop strings in streamed text, holding back any suffix that could still
    become one. ``feed`` returns (text safe to emit, matched?)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched = False
        self.matched_stop: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        if self.matched:
            return "", True
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched_stop = min(hits, key=lambda h: h[0])
            self.matched = True
            self.held = ""
            return buf[:at], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = ("" if self.matched else self.held), ""
        return out
