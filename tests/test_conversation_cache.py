"""Acceptance of the prefix cache on the reference executor, for SmolLM2 (real
weights, attention only) and the Qwen3.5 hybrid (recurrent state).

The ten-turn agent conversation of ``agent_conversation`` runs through the
scheduler and the reference executor (the engine's loop, plus a read of
``out.logits`` after every sampling step and ``check_integrity`` after every
step), prompts and message endpoints built by the server's own frontend code.
Then, per turn:

* ``cached_tokens`` is at least the previous request's complete messages and
  equals the deepest endpoint the oracle says is published and prefixes the
  prompt; the cache holds exactly the oracle's endpoints;
* prefill work (tokens through prefill programs) is prompt minus cached;
* with the cache off, the same requests give the same tokens, and the logits at
  every generated position agree within a bound derived from the measured
  repeatability of differently partitioned prefill.

Bound. Restores are bitwise (``test_checkpoint_programs``), so a cache-on turn
computes exactly what one request would compute with prefill cut at the
restored and captured endpoints: cache on vs off is a difference of prefill
partition only. We measure that directly: prefill two turns' prompts with
other partitions (turn 4 cut at every message endpoint and three seeded
random points; turn 10 cut every 29 tokens, more cuts than the cache makes),
teacher-force the cache-off run's output and compare every generated
position's logits with the cache-off run. ``delta`` is the largest difference
seen. The cache-on run is one more draw from the same family of partitions,
compared at five times as many positions (ten turns, not two); we allow its
maximum to reach twice the measured one: ``bound = 2 * delta + 1e-6``.
Generated tokens must be identical; a flip is reported with its logit margin
in the cache-off run. Numbers are printed.

Decoding is greedy (top_k = 1; the seeds are fixed but unused). A *sampled*
draw is not a property worth asserting here: the sampler's inverse CDF runs
over probabilities sorted by value, so any rounding difference that reorders
two nearly equal probabilities moves every token boundary after them; on the
random-weight hybrid, whose distributions are flat, seeded sampling flipped a
token at a logit difference of 2e-5 (one draw in sixty). Greedy identity with
its argmax margin is the meaningful check.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from flare.core import interface as io
from flare.core.manifest import Manifest, ProgramKind, load_manifest
from flare.core.sampling_params import NEUTRAL
from flare.runtime.reference import ReferenceExecutor
from flare.runtime.request import Request
from flare.runtime.scheduler import Scheduler
from flare.server.message_ends import message_marks, token_endpoints
from flare.server.params import resolve_sampling
from flare.server.template import ChatTemplate
from flare.server.text import TextCodec
from tests.agent_conversation import (TURNS, complete_messages_length, deepest_published,
                                      oracle_message_endpoints, turn_messages)
from tests.conftest import TORCH_THREADS

MAX_TOKENS = 6
SAMPLING = (ProgramKind.prefill, ProgramKind.resume, ProgramKind.decode)


@dataclass
class Turn:
    prompt: list[int]
    endpoints: tuple[int, ...]
    output: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    cached: int = 0
    prefilled: int = 0


class Frontend:
    def __init__(self, core: Path, m: Manifest):
        self.template = ChatTemplate((core / m.frontend.chat_template).read_text(), dict(m.frontend.special_tokens))
        self.codec = TextCodec(str(core / m.frontend.tokenizer))

    def turn(self, i: int) -> Turn:
        """As ``/v1/chat/completions`` builds a prompt and its endpoints."""
        messages = turn_messages(i)
        text = self.template.render(messages, add_generation_prompt=True)
        ids, offsets = self.codec.encode_with_offsets(text, add_special_tokens=False)
        return Turn(ids, token_endpoints(offsets, message_marks(self.template, messages, text)))


async def _step(ex, sched: Scheduler, on_logits) -> bool:
    step = sched.schedule()
    sched.check_integrity()
    if step is None:
        return False
    for w in step.writes:
        ex.write(w.buffer, w.value, w.row)
    ex.submit(step.program)
    await ex.wait()
    records = ex.read(step.completion) if step.completion else None
    if step.kind in SAMPLING:
        logits = ex.read("out.logits")
        for i, r in enumerate(step.requests):
            if int(records[i][1]) >= 0:
                on_logits(r, logits[i])
    sched.complete(step, records)
    sched.check_integrity()
    return True


async def converse(ex, m: Manifest, turns: list[Turn], *, prefix_cache: bool) -> Scheduler:
    sched = Scheduler(m, prefix_cache=prefix_cache)
    for i, t in enumerate(turns, start=1):
        params = resolve_sampling(m, prompt_len=len(t.prompt), fields={"top_k": 1}, max_tokens=MAX_TOKENS,
                                  seed=1000 + i, stop_token_ids=None, ignore_eos=False)
        req = Request(t.prompt, params, endpoints=t.endpoints, request_id=f"turn{i}")
        before = sched.prefill_tokens_total
        sched.add(req)
        while await _step(ex, sched, lambda r, row: t.logits.append(row.copy())):
            pass
        assert req.finished and req.error is None
        t.output, t.cached, t.prefilled = list(req.output), req.cached_tokens, sched.prefill_tokens_total - before
    return sched


async def partitioned(ex, m: Manifest, prompt: list[int], cuts: list[int], forced: list[int]) -> list[np.ndarray]:
    """Logits at every generated position when ``prompt`` is prefilled in chunks cut at
    ``cuts`` (and at the chunk capacity) and the generated tokens are teacher-forced."""
    c, ps, slot = m.capacities, m.pages.page_size, 1
    n_pages = -(-(len(prompt) + len(forced)) // ps)
    for name, value in io.slot_state(pending=0, generated=0, max_new=1 << 20, seed=1, sampling=NEUTRAL, stop_ids=(),
                                     stop_capacity=c.stop_ids, pages=range(1, n_pages + 1),
                                     max_pages=c.max_pages_per_slot, mask_on=False, logprobs=False).items():
        ex.write(name, value, slot)
    # Clears the slot's continuation state.
    ex.write(io.AdmitInput.buffer, io.pack(io.AdmitInput(slot, 0, clear=1, mode=io.AdmitMode.prompt)))
    ex.submit(m.programs_of(ProgramKind.admit)[0].name)
    bounds, start = [], 0
    for cut in sorted({*cuts, len(prompt)}):
        while start < cut:
            end = min(cut, start + c.prefill_chunk)
            bounds.append((start, end))
            start = end
    out = []
    for a, b in bounds:
        ex.write(io.TOKENS, np.asarray(prompt[a:b], np.int32))
        ex.write(io.PrefillInput.buffer, io.pack(io.PrefillInput(slot, b - a, int(b == len(prompt)))))
        ex.submit(f"prefill.{next(x for x in c.prefill_capacities if x >= b - a)}")
    await ex.wait()
    out.append(ex.read("out.logits")[0])
    decode = np.zeros(max(c.decode_capacities), np.int32)
    decode[0] = slot
    for tok in forced[:-1]:
        ex.write("state.pending", np.int32(tok), slot)
        ex.write("state.done", np.int32(0), slot)
        ex.write("in.decode_slots", decode)
        ex.submit(f"decode.{c.decode_capacities[0]}")
        await ex.wait()
        out.append(ex.read("out.logits")[0])
    return out


async def acceptance(core: Path) -> dict:
    m = load_manifest(core)
    fe = Frontend(core, m)
    ex = ReferenceExecutor(core, m, torch_threads=TORCH_THREADS)
    await ex.start()
    try:
        on = [fe.turn(i) for i in range(1, TURNS + 1)]
        sched = await converse(ex, m, on, prefix_cache=True)
        off = [fe.turn(i) for i in range(1, TURNS + 1)]
        await converse(ex, m, off, prefix_cache=False)
        delta = 0.0
        rng = random.Random(0)
        partitions = ((4, [*off[3].endpoints, *rng.sample(range(1, len(off[3].prompt)), 3)]),
                      (10, list(range(29, len(off[9].prompt), 29))))
        for i, cuts in partitions:
            t = off[i - 1]
            got = await partitioned(ex, m, t.prompt, cuts, t.output)
            delta = max(delta, max(float(np.abs(a - b).max()) for a, b in zip(got, t.logits)))
        return {"m": m, "fe": fe, "on": on, "off": off, "delta": delta, "sched": sched}
    finally:
        await ex.close()


@pytest.fixture(scope="module", params=["smol_core", "hybrid_core"])
def outcome(request):
    core = request.getfixturevalue(request.param)
    out = asyncio.run(acceptance(core))
    out["name"] = request.param
    return out


def _oracle(outcome) -> list[set[tuple[int, ...]]]:
    """The oracle's published endpoints after each turn (as token tuples)."""
    fe, on = outcome["fe"], outcome["on"]
    published: set[tuple[int, ...]] = set()
    after = []
    for i, t in enumerate(on, start=1):
        for e in oracle_message_endpoints(fe.template, fe.codec, turn_messages(i), t.prompt):
            published.add(tuple(t.prompt[:e]))
        published.add(tuple(t.prompt))
        published.add(tuple((t.prompt + t.output)[: len(t.prompt) + len(t.output) - 1]))
        after.append(set(published))
    return after


def test_cached_tokens_follow_the_published_endpoints(outcome):
    fe, on = outcome["fe"], outcome["on"]
    oracle = _oracle(outcome)
    report = []
    for i, t in enumerate(on, start=1):
        expected = deepest_published(oracle[i - 2], t.prompt) if i > 1 else 0
        report.append((i, len(t.prompt), t.cached, expected))
        assert t.cached == expected, report
        if i > 1:
            assert t.cached >= complete_messages_length(fe.template, fe.codec, turn_messages(i - 1)), report
    print(f"\n{outcome['name']} turns (turn, prompt, cached, oracle):", report)
    # The cache holds exactly the oracle's endpoints (no eviction in this conversation).
    cache = outcome["sched"].checkpoints.cache
    stored = set()
    for c in cache.checkpoints():  # the tokens behind each key, from the histories that produced them
        histories = [t.prompt + t.output for t in on if len(t.prompt) + len(t.output) > c.length]
        (tokens,) = {tuple(h[: c.length]) for h in histories if cache.digests().key(h, c.length) == c.key}
        stored.add(tokens)
    assert stored == oracle[-1] and len(cache) == len(oracle[-1])
    assert cache.evicted_for_pages == cache.evicted_for_rows == cache.thinned == 0


def test_prefill_work_is_prompt_minus_cached(outcome):
    for t in outcome["on"]:
        assert t.prefilled == len(t.prompt) - t.cached
    for t in outcome["off"]:
        assert t.prefilled == len(t.prompt) and t.cached == 0
    total = sum(len(t.prompt) for t in outcome["on"])
    saved = sum(t.cached for t in outcome["on"])
    print(f"\n{outcome['name']}: {total} prompt tokens, {saved} served from the cache ({saved / total:.0%})")
    assert saved > total // 2


def test_cache_on_and_off_agree(outcome):
    delta = outcome["delta"]
    bound = 2 * delta + 1e-6
    worst, flips = 0.0, []
    for i, (a, b) in enumerate(zip(outcome["on"], outcome["off"]), start=1):
        n = min(len(a.output), len(b.output))
        for k in range(n):
            worst = max(worst, float(np.abs(a.logits[k] - b.logits[k]).max()))
            if a.output[k] != b.output[k]:
                row = b.logits[k]
                flips.append({"turn": i, "position": k, "on": a.output[k], "off": b.output[k],
                              "margin": float(row[b.output[k]] - row[a.output[k]])})
                break
    print(f"\n{outcome['name']} cache on vs off:",
          json.dumps({"partition_delta": delta, "bound": bound, "max|on-off|": worst, "flips": flips}))
    assert 0 < delta < 1e-2  # the measurement saw real rounding differences, and small ones
    assert worst <= bound
    assert not flips, flips
    assert [t.output for t in outcome["on"]] == [t.output for t in outcome["off"]]
