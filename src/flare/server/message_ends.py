"""Message ends of a rendered conversation: the token counts where complete messages
end, the prompt's candidate checkpoints (``Request.endpoints``).

The frontend renders the conversation once for the prompt. A message's end is
a character mark in that text: the length of the rendering of the
conversation up to and including that message, without a generation prompt,
when that rendering is a prefix of the full text (a template that rewrites
earlier turns, or injects text after them, yields no mark there rather than a
wrong one). The open assistant header is never a mark: prefixes are rendered
without it, and the prompt boundary is the scheduler's own endpoint.

Marks become token counts through the full prompt's token offsets. A cut is
exact only if every token before it ends at or before the mark and every
token after it starts at or after the mark; a mark inside a token (a BPE merge
across the message boundary, a character split over byte tokens) is dropped.
Endpoints are sorted, deduplicated and strictly inside the prompt.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

from flare.core.errors import FlareError
from flare.server.template import ChatTemplate


# Marks are looked for among the last this many messages only: each costs a render of
# the conversation up to it (quadratic in its length), and captures go to the uncached
# suffix, which in an agent conversation is the last turn or two.
RECENT_MESSAGES = 16


def message_marks(template: ChatTemplate, messages: list[dict[str, Any]], rendered: str, /,
                  **kwargs: Any) -> list[int]:
    """Character offsets in ``rendered`` at which complete messages end, among the last
    ``RECENT_MESSAGES`` messages. Endpoints only steer caching: a prefix the template
    refuses to render (e.g. "no user query yet") yields no mark, not an error."""
    marks = []
    for j in range(max(1, len(messages) - RECENT_MESSAGES + 1), len(messages) + 1):
        try:
            prefix = template.render(messages[:j], add_generation_prompt=False, **kwargs)
        except FlareError:
            continue
        if rendered.startswith(prefix):
            marks.append(len(prefix))
    return marks


def token_endpoints(offsets: Sequence[tuple[int, int]], marks: Sequence[int]) -> tuple[int, ...]:
    """Token counts at which the character ``marks`` cut the token sequence exactly."""
    n = len(offsets)
    prefix_end = [0] * (n + 1)  # max end over tokens[:i]
    for i, (_, end) in enumerate(offsets):
        prefix_end[i + 1] = max(prefix_end[i], end)
    suffix_start = [0] * (n + 1)  # min start over tokens[i:]
    suffix_start[n] = 1 << 62
    for i in range(n - 1, -1, -1):
        suffix_start[i] = min(suffix_start[i + 1], offsets[i][0])
    out = set()
    for mark in marks:
        i = bisect.bisect_right(prefix_end, mark) - 1  # the longest prefix ending at or before the mark
        if 0 < i < n and suffix_start[i] >= mark:
            out.add(i)
    return tuple(sorted(out))
