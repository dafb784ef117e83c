"""Checkpoint placement: which endpoints of a request are snapshotted (docs/prefix-cache.md).

Pure functions of numbers, so the policy is tested on its own:

* Budget: new snapshots per request = snapshot rows // maximum concurrency,
  capped at eight; a nonempty pool permits at least one, an empty one none.
* The budget reserves a terminal snapshot and, when generation can continue
  beyond the prompt and the budget permits, a prompt snapshot (with a single
  output token the prompt and terminal endpoints coincide).
* The rest selects message endpoints inside the uncached suffix: all of them
  when they fit; otherwise targets at equal intervals between the reused prefix
  and the prompt end, each taking the nearest eligible endpoint (ties to the
  earlier one), deduplicated.

Only selected endpoints interrupt prefill; the number of messages never
enlarges the snapshot pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

MAX_SNAPSHOTS = 8


@dataclass(frozen=True)
class SnapshotPlan:
    messages: tuple[int, ...]  # selected message endpoints, ascending, inside (reused, prompt)
    prompt: bool  # snapshot at the prompt boundary
    terminal: bool  # snapshot at the terminal consumed boundary


NO_SNAPSHOTS = SnapshotPlan((), False, False)


def snapshot_budget(snapshot_rows: int, max_concurrency: int) -> int:
    if snapshot_rows <= 0:
        return 0
    return max(1, min(MAX_SNAPSHOTS, snapshot_rows // max(1, max_concurrency)))


def plan_snapshots(*, budget: int, reused: int, prompt_len: int, max_tokens: int,
                  endpoints: Sequence[int]) -> SnapshotPlan:
    """``reused``: the consumed count restored from the cache (0 on a miss);
    ``endpoints``: message endpoints of the prompt (token counts)."""
    if budget <= 0:
        return NO_SNAPSHOTS
    left = budget - 1  # the terminal snapshot
    prompt = max_tokens > 1 and reused < prompt_len and left > 0
    left -= int(prompt)
    eligible = sorted({e for e in endpoints if reused < e < prompt_len})
    if len(eligible) <= left:
        chosen = eligible
    else:
        chosen = []
        span = prompt_len - reused
        for i in range(1, left + 1):
            target = reused + span * i / (left + 1)
            best = min(eligible, key=lambda e: (abs(e - target), e))
            if best not in chosen:
                chosen.append(best)
        chosen.sort()
    return SnapshotPlan(tuple(chosen), prompt, True)
