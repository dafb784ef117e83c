"""Which prefill chunks share a pack program, and where their rows go.

A ``pack.C`` program (``flare.core.interface``) runs segments of several slots in C
rows: prefill chunks of prompts that arrived together, and, in a decode step that
carries a prompt's chunk (``flare-serve --decode-with-prefill``), one row per decoder
for its pending token. The attention kernel tiles query rows (``capacities.pack_align``
tokens per tile) and shares a tile's key reads only when every row of the tile belongs
to one slot; a tile of mixed slots goes token by token, each row reading its own
history. That costs nothing for rows with short histories (a cold prompt, one decode
row each), but a chunk that continues a long history (a follow-up turn after a cached
prefix, the second chunk of a long prompt) would make each of its rows in a mixed tile
read that whole history. So such a chunk takes whole tiles: it starts on a multiple of
the alignment and the next segment starts on the next one. Everything else packs densely.

Pure functions over counts, so that the policy is tested without a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Chunk:
    """A prefilling request's next chunk as the scheduler would run it alone."""

    tokens: int
    continues: bool  # the slot already holds history: the chunk takes whole tiles


def _up(n: int, align: int) -> int:
    return -(-n // align) * align


def layout(segments: Sequence[tuple[int, bool]], align: int) -> tuple[list[int], int]:
    """The first row of each segment ``(rows, whole_tiles)`` in order, and the rows they
    span (up to the last segment's last row)."""
    starts, row, end = [], 0, 0
    for count, whole in segments:
        if whole:
            row = _up(row, align)
        starts.append(row)
        row += count
        end = row
        if whole:
            row = _up(row, align)
    return starts, end


def plan(chunks: Sequence[Chunk], decoders: int, capacities: Sequence[int], align: int,
         max_segments: int, max_tokens: int | None = None) -> tuple[int, list[int]] | None:
    """(pack capacity, tokens of each chunk taken) for the longest prefix of ``chunks`` that
    fits one pack of the largest of ``capacities`` with ``decoders`` one-token rows after
    them, or None. Without decoders a pack needs two chunks or more, each whole (a prompt
    alone runs its own prefill program). With decoders the first chunk is cut to the rows
    they leave (to whole tiles when it continues a history), but not below half the pack
    unless that finishes its prompt: a prompt that would crawl forward a few tokens per
    step waits for a plain prefill chunk instead. ``max_tokens`` bounds the chunks' tokens
    together (``--prefill-while-decoding`` beside decoders). The capacity is the smallest
    that holds the rows."""
    if not capacities or decoders >= max_segments:
        return None
    top = capacities[-1]
    taken: list[int] = []
    rows = 0
    for i, c in enumerate(chunks):
        if decoders + len(taken) == max_segments:
            break
        n = c.tokens
        if decoders and i == 0:
            room = top - decoders
            n = min(n, room // align * align if c.continues else room)
            if n < min(c.tokens, top // 2) or n < 1:
                return None
        trial = [(t, ch.continues) for t, ch in zip([*taken, n], chunks)] + [(1, False)] * decoders
        end = layout(trial, align)[1]
        if end > top or (max_tokens is not None and sum(taken) + n > max_tokens):
            break
        taken.append(n)
        rows = end
    if not taken or (not decoders and len(taken) < 2):
        return None
    return next(cap for cap in capacities if cap >= rows), taken
