"""Incremental detokenization on the real SmolLM2 tokenizer, and stop strings."""

from __future__ import annotations

import itertools
import random

import pytest

from flare.runtime.request import FinishReason, Request, SamplingParams
from flare.server.output import OutputStream
from flare.server.text import REPLACEMENT, IncrementalDetokenizer, StopMatcher, TextCodec


@pytest.fixture(scope="module")
def codec(smol_core) -> TextCodec:
    return TextCodec(str(smol_core / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompt_ids(codec) -> list[int]:
    return codec.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)


STRINGS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "日本語のテキストです。中文也可以。한국어 텍스트",
    "🙂👍🏽🇫🇷 emoji: 👩‍👩‍👧‍👦 family",
    "e\u0301 n\u0303 a\u0308 \u0915\u094d\u0937",  # combining marks, Devanagari conjunct
    "Ünïcödé ça va? Ωμέγα. Привет, мир!",
    "مرحبا بالعالم שלום",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 \U0001f9ec",  # 4-byte code points
    "a\ufffdb",  # a literal replacement character in the text itself
    "  leading spaces\n\n\ttabs and trailing  ",
    "code: `x = {'a': [1, 2]}` → ✓",
    "🙂",
    "",
]

_POOLS = [
    "abcdefghijklmnopqrstuvwxyz     .,!?\n",
    "àéîõüçñßøåæœ",
    "日本語中文字漢かなカナ한국",
    "🙂👍🏽🎉🚀❤️🇯🇵🧬",
    "\u0301\u0308\u0327\u200d",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢𐍈",
]


def random_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pools = rng.sample(_POOLS, rng.randint(1, 3))
        out.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40))))
    return out


def stream(codec: TextCodec, prompt: list[int], ids: list[int], group: int = 1) -> list[str]:
    """Push ids ``group`` at a time; returns the emitted chunks, the flush last."""
    d = IncrementalDetokenizer(codec, prompt)
    chunks = [d.push(ids[i : i + group]) for i in range(0, len(ids), group)]
    chunks.append(d.flush())
    return chunks


def check_stream(codec: TextCodec, prompt: list[int], ids: list[int], group: int = 1) -> None:
    full = codec.decode(ids)
    chunks = stream(codec, prompt, ids, group)
    assert "".join(chunks) == full
    if REPLACEMENT not in full:
        assert not [c for c in chunks if REPLACEMENT in c]
    # Nothing emitted is ever taken back, and nothing complete is held back: after each
    # push the text emitted so far is exactly the decode of the ids so far, unless that
    # decode ends inside a character (then it is that decode minus its broken tail).
    emitted = ""
    for k, chunk in enumerate(chunks[:-1]):
        emitted += chunk
        assert full.startswith(emitted)
        so_far = codec.decode(ids[: (k + 1) * group])
        if not so_far.endswith(REPLACEMENT):
            assert emitted == so_far


@pytest.mark.parametrize("text", STRINGS)
def test_streaming_reproduces_the_full_decode(codec, prompt_ids, text):
    ids = codec.encode(text, add_special_tokens=False)
    assert codec.decode(ids) == text
    check_stream(codec, prompt_ids, ids)
    check_stream(codec, [], ids)
    check_stream(codec, prompt_ids, ids, group=3)


def test_multibyte_characters_really_span_tokens(codec):
    # The cases above exercise held-back bytes only if single tokens decode to U+FFFD.
    for text in ("日本語のテキストです。", "🙂👍🏽🇫🇷", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢"):
        ids = codec.encode(text, add_special_tokens=False)
        assert any(REPLACEMENT in codec.decode([i]) for i in ids)
        chunks = stream(codec, [], ids)
        assert "" in chunks[:-1]  # something was held back at least once


def test_random_unicode_strings(codec, prompt_ids):
    for text in random_strings(120):
        ids = codec.encode(text, add_special_tokens=False)
        check_stream(codec, prompt_ids, ids)


def test_random_token_sequences(codec, prompt_ids):
    """A model can emit any id sequence, including ones no text encodes to (stray
    continuation bytes, special tokens): the stream still equals the full decode."""
    rng = random.Random(1)
    V = codec.vocab_size
    multibyte = [i for i in range(V) if REPLACEMENT in codec.decode([i])]
    assert len(multibyte) > 100
    for _ in range(60):
        ids = [rng.choice(multibyte) if rng.random() < 0.6 else rng.randrange(V) for _ in range(rng.randint(1, 25))]
        check_stream(codec, prompt_ids, ids)


def test_special_tokens_are_skipped(codec, prompt_ids):
    im_end = codec.token_to_id("<|im_end|>")
    im_start = codec.token_to_id("<|im_start|>")
    ids = codec.encode("Hi 🙂", add_special_tokens=False)
    seq = [im_start, *ids[:2], im_end, *ids[2:], im_end]
    assert "".join(stream(codec, prompt_ids, seq)) == "Hi 🙂"


# ---------------------------------------------------------------------------
# StopMatcher


def splits(text: str, parts: int):
    """Every way to cut ``text`` into ``parts`` chunks (empty chunks allowed)."""
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), parts - 1):
        bounds = (0, *cuts, len(text))
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def feed_all(stops: list[str], chunks: list[str]) -> tuple[list[str], int | None, str]:
    m = StopMatcher(stops)
    out, hit = [], None
    for i, c in enumerate(chunks):
        text, matched = m.feed(c)
        out.append(text)
        if matched and hit is None:
            hit = i
        if hit is not None:
            assert matched  # stays matched
            if i > hit:
                assert text == ""
    return out, hit, m.flush()


@pytest.mark.parametrize(
    "stops,text,before",
    [
        (["STOP"], "The answer is 42.\nSTOP here and more", "The answer is 42.\n"),
        (["\n\n", "User:"], "Hi there.\nUser: next\n\nend", "Hi there.\n"),
        (["\n\n", "User:"], "Line one.\n\nUser: x", "Line one."),
        (["aab"], "xaaab", "xa"),  # the stop overlaps a false start of itself
        (["STOP"], "STOck STOP", "STOck "),  # a held prefix is released when it fails
        (["。"], "日本語。次の文", "日本語"),
        (["<end>"], "<end>", ""),
        (["🙂"], "ok 👍🏽 then 🙂 more", "ok 👍🏽 then "),
    ],
)
def test_stop_found_at_every_split(stops, text, before):
    end_of_stop = min(text.index(s) + len(s) for s in stops if s in text)
    for parts in (1, 2, 3):
        for chunks in splits(text, parts):
            out, hit, tail = feed_all(stops, chunks)
            assert "".join(out) == before, chunks
            assert tail == ""  # nothing after a match, ever
            # The match is reported by the chunk that completes the stop string.
            covered = list(itertools.accumulate(len(c) for c in chunks))
            assert hit == next(i for i, n in enumerate(covered) if n >= end_of_stop), chunks
            # Emitted text is final: every prefix of the output is a prefix of ``before``.
            assert all(before.startswith("".join(out[: i + 1])) for i in range(len(out)))


@pytest.mark.parametrize(
    "stops,text,held",
    [
        (["STOP"], "Hello ST", "ST"),
        (["STOP", "END"], "Almost EN", "EN"),
        (["\n\nUser:"], "answer\n\nUse", "\n\nUse"),
        (["xyz"], "no stop here", ""),
    ],
)
def test_held_prefix_released_at_flush(stops, text, held):
    for parts in (1, 2, 3):
        for chunks in splits(text, parts):
            out, hit, tail = feed_all(stops, chunks)
            assert hit is None
            assert "".join(out) == text[: len(text) - len(held)], chunks
            assert tail == held
            assert "".join(out) + tail == text


def test_no_stops_passes_text_through():
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.feed("") == ("", False)
    assert m.flush() == ""
    m = StopMatcher([""])  # empty stop strings are ignored, never match everything
    assert m.feed("abc") == ("abc", False)


# ---------------------------------------------------------------------------
# Both together, as the engine drives them


def _request() -> Request:
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                       presence_penalty=0.0, frequency_penalty=0.0, seed=0, max_tokens=100)
    return Request([1], p)


def test_output_stream_stop_string_across_tokens(codec, prompt_ids):
    ids = codec.encode("Sure! The capital is Paris 🙂.\nUser: and more text", add_special_tokens=False)
    out = OutputStream(codec, prompt_ids, ["\nUser:"])
    req = _request()
    matched_at = None
    for i, t in enumerate(ids):
        if out.on_tokens(req, [t]):
            matched_at = i
            break
    # The match is reported by the token that completes "\nUser:".
    assert codec.decode(ids[: matched_at + 1]).endswith("\nUser:")
    assert not codec.decode(ids[:matched_at]).endswith("\nUser:")
    req.finish_reason = FinishReason.stop
    out.on_finish(req)
    assert "".join(out._pieces) == "Sure! The capital is Paris 🙂."
    assert out._finish == FinishReason.stop


def test_output_stream_releases_held_text_at_length_finish(codec, prompt_ids):
    ids = codec.encode("Almost done\n\nUs", add_special_tokens=False)
    out = OutputStream(codec, prompt_ids, ["\n\nUser:"])
    req = _request()
    assert not any(out.on_tokens(req, [t]) for t in ids)
    assert "".join(out._pieces) == "Almost done"
    req.finish_reason = FinishReason.length
    out.on_finish(req)
    assert "".join(out._pieces) == "Almost done\n\nUs"
