"""``Scheduler.schedule_ahead`` against the fake device of test_pages_scheduler: the
engine's loop with two steps in flight (launch N, build and launch N+1, complete
N, ...), ``check_integrity`` after every completion.

* Page growth for the step ahead under cache pressure: two decoders cross a page
  boundary in the same step ahead with one page free and the rest of the pool
  held by evictable checkpoints (a review found the eviction asked for too
  little and the engine failed with PoolExhausted).
* A fuzz of small pools, prefix-cache hits, host-side and device-side stops and
  two waves of requests: outputs and finish reasons equal one step at a time
  (requests that were preempted are skipped: readmission reseeds by design).
"""

from __future__ import annotations

import random

import pytest

from flare.runtime.request import Request
from tests.test_pages_scheduler import Driver, Sink, params, small_manifest, token_fn
from tests.test_scheduler_cache import req


def pipelined_run(d: Driver, limit: int = 5000) -> None:
    """Engine._run with steps_in_flight=2, the device running programs in submission order."""
    s = d.sched
    for _ in range(limit):
        step = s.schedule()
        if step is None:
            return
        rec = d.dev.run(step)
        while step is not None:
            ahead = s.schedule_ahead(step)
            ahead_rec = d.dev.run(ahead) if ahead is not None else None
            s.complete(step, rec)
            s.check_integrity()
            step, rec = ahead, ahead_rec
    raise AssertionError("the scheduler did not settle")


def _warm_cache(d: Driver) -> None:
    """Two finished conversations leave prompt checkpoints holding most of the pool."""
    d.add(req("X", [300 + i for i in range(40)], 2, seed=1), req("Y", [500 + i for i in range(40)], 2, seed=2))
    d.run()


@pytest.mark.parametrize("pages", [10, 11, 12, 13])
def test_step_ahead_grows_pages_by_evicting_checkpoints(tiny_core, pages):
    outputs = {}
    for mode in ("one", "two"):
        d = Driver(small_manifest(tiny_core, num_pages=pages, slots=2, snapshot_rows=8))
        _warm_cache(d)
        assert d.sched.page_usage()[2] > 0
        # Prompts of 20 and 21 tokens stay aligned at page boundaries while decoding.
        a, b = req("A", [700 + i for i in range(20)], 40, seed=3), req("B", [900 + i for i in range(21)], 40, seed=4)
        d.add(a, b)
        d.run() if mode == "one" else pipelined_run(d)
        assert a.error is None and b.error is None
        outputs[mode] = (a.output, a.finish_reason, b.output, b.finish_reason)
        if mode == "two":
            assert d.sched.steps_ahead_total > 0
    assert outputs["one"] == outputs["two"]


def _wave(rng: random.Random) -> list[Request]:
    shared = [100 + (5 * i) % 300 for i in range(60)]
    out = []
    for i in range(rng.randint(2, 6)):
        seed, n, max_tokens = rng.randint(1, 50), rng.choice([16, 20, 21, 31, 32, 33, 40]), rng.randint(2, 40)
        prompt = shared[:n] if rng.random() < 0.5 else [400 + 3 * i + 7 * k for k in range(n)]
        stop = token_fn(seed, rng.randint(0, max_tokens - 1))
        kind = rng.choice(["none", "host", "device"])
        p = params(seed, max_tokens, stop_token_ids=(stop,)) if kind == "device" else params(seed, max_tokens)
        out.append(Request(prompt, p, Sink(stop if kind == "host" else None), request_id=f"R{i}"))
    return out


@pytest.mark.parametrize("seed", range(60))
def test_two_steps_in_flight_fuzz(tiny_core, seed):
    rng = random.Random(seed)
    pages = rng.choice([8, 10, 12, 16, 40])
    state = rng.getstate()
    results = []
    for mode in ("one", "two"):
        rng.setstate(state)
        d = Driver(small_manifest(tiny_core, num_pages=pages, slots=4, snapshot_rows=8))
        done = []
        for _ in range(2):
            wave = _wave(rng)
            d.add(*wave)
            d.run() if mode == "one" else pipelined_run(d)
            done += wave
        d.sched.check_integrity()
        assert d.sched.page_usage()[1] == 0
        results.append([(r.id, r.output, r.finish_reason, r.preemptions) for r in done])
    for a, b in zip(*results):
        if not (a[3] or b[3]):
            assert a[:3] == b[:3], (a, b)
