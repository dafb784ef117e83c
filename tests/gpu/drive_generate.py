"""Greedy generations through the real engine and scheduler on one core.

usage: python -m tests.gpu.drive_generate CORE EXECUTOR CACHE PROMPTS.json OUT.json [--roundtrip] [--batch]

EXECUTOR is ``cuda`` (the torch-free graph runtime) or ``reference`` (eager
torch programs on the CPU); CACHE is ``on`` or ``off`` (the prefix cache).

Phase 1 runs every prompt concurrently (the engine batches them) for
``TOKENS`` greedy tokens, recording the log-probabilities of the first token's most likely
tokens. Phase 2 runs, one at a time, follow-up turns of the
last ``FOLLOW_UPS`` prompts (prompt + its output + an 11-token tail: a tool
result appended to a conversation) and an exact repeat of the last prompt (a
full-prompt hit), recording cached tokens, the prefill work each did and the log-
probabilities of the first token's most likely tokens.

Phase 3 runs one conversation of ``TURNS`` turns, one request at a time: each
turn's prompt is the previous prompt, a fixed 20-token assistant reply and an
11-token tail, so every turn but the first restores the previous prompt's
checkpoint, and the prompts do not depend on what was generated (cache on and
off see the same prompts at every turn).

``--batch`` then runs ``BATCH`` other prompts one at a time (every decode step of one
row) and then together (steps of up to ``BATCH`` rows), recording every token's
log-probability: whether a decode row depends on what it is batched with.

``--roundtrip`` then drives the snapshot and restore programs
directly: random bytes in one slot's continuation rows and KV tail page are
snapshotted, another slot is filled with other random bytes and restored, and
every byte is compared. The script checks that torch was never imported.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np

from flare.core import interface as io
from flare.core.manifest import load_manifest, snapshot_buffer
from flare.core.sampling_params import NEUTRAL
from flare.runtime.engine import Engine
from flare.runtime.executor import NUMPY_DTYPES
from flare.runtime.request import Request, SamplingParams

TOKENS = int(os.environ.get("FLARE_DRIVE_TOKENS", "64"))
FOLLOW_UPS = int(os.environ.get("FLARE_DRIVE_FOLLOW_UPS", "10"))
TAIL = 11
FIRST_LOGPROBS = 5  # every request reports its first token's most likely tokens (near-ties: test_generation.py)
TURNS = 10  # phase 3: one conversation
BATCH = 4  # --batch: prompts decoded alone, then together


class _Done:
    def __init__(self):
        self.event = asyncio.Event()
        self.first = None  # the first token's log-probabilities (requests that ask for them)
        self.logprobs = []  # every token's

    def on_tokens(self, request, ids, logprobs=None):
        if logprobs:
            if self.first is None:
                self.first = logprobs[0]
            self.logprobs += [float(lp.logprob) for lp in logprobs]
        return False

    def on_finish(self, request):
        self.event.set()


def _params(seed: int, max_tokens: int, logprobs: int = -1) -> SamplingParams:
    # top_k = 1: the sampled token is the argmax of the (penalty-free) logits.
    return SamplingParams(**{**NEUTRAL, "top_k": 1}, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=logprobs)


async def _generate(engine: Engine, prompts: list[list[int]], tokens: int, seeds: list[int],
                    logprobs: int = -1) -> list[Request]:
    reqs = []
    for p, s in zip(prompts, seeds):
        sink = _Done()
        req = Request(p, _params(s, tokens, logprobs), sink)
        engine.submit(req)
        reqs.append((req, sink))
    for req, sink in reqs:
        await asyncio.wait_for(sink.event.wait(), 600)
        if req.error is not None:
            raise req.error
    for req, sink in reqs:
        req.first_logprobs, req.token_logprobs = sink.first, sink.logprobs
    return [r for r, _ in reqs]


async def _batch_check(engine: Engine, m) -> dict:
    """``BATCH`` prompts (not those of the other phases) generated one at a time, then
    together: tokens and every token's log-probability (float32 sums: their bits follow
    the logits')."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, m.capacities.sampling_vocab, int(n)).tolist() for n in rng.integers(8, 200, BATCH)]
    alone = [(await _generate(engine, [p], TOKENS, [i], logprobs=0))[0] for i, p in enumerate(prompts)]
    together = await _generate(engine, prompts, TOKENS, list(range(BATCH)), logprobs=0)
    return {run: [{"output": r.output, "logprobs": r.token_logprobs} for r in reqs]
            for run, reqs in (("alone", alone), ("together", together))}


def _top(req: Request) -> list[list]:
    """The request's first token's most likely tokens and their log-probabilities."""
    return [list(req.first_logprobs.top_ids), list(req.first_logprobs.top_logprobs)]


def _executor(kind: str, core: str, m):
    if kind == "cuda":
        from flare.runtime.cuda_executor import CudaExecutor

        return CudaExecutor(core, m)
    from flare.runtime.reference import ReferenceExecutor

    return ReferenceExecutor(core, m, torch_threads=int(os.environ.get("FLARE_DRIVE_THREADS", "8")))


async def _roundtrip(ex, m) -> dict:
    """Snapshot slot 1 into row 1, restore row 1 into slot 2: exact bytes everywhere."""
    rng = np.random.default_rng(5)
    buffers = {b.name: b for b in m.buffers}
    cont, tail = m.continuation.state, m.continuation.tail
    ps = m.pages.page_size
    s1, s2, row, count = 1, 2, 1, 3 * ps + 5  # a partial tail page
    p1, p2 = 7, 11  # slot 1's tail page, slot 2's private page

    def random_row(name: str) -> np.ndarray:
        b = buffers[name]
        n = int(np.prod(b.shape[1:])) * np.dtype(NUMPY_DTYPES[b.dtype]).itemsize
        return rng.integers(0, 256, n, dtype=np.uint8).view(NUMPY_DTYPES[b.dtype]).reshape(b.shape[1:])

    def read_bytes(name: str) -> bytes:
        if hasattr(ex, "read_bytes"):  # the CUDA executor: a synchronous device copy
            return ex.read_bytes(name)
        return ex.view(name).tobytes()  # the reference executor's shared arena

    def row_bytes(name: str, r: int) -> bytes:
        b = buffers[name]
        raw = read_bytes(name)
        stride = len(raw) // b.shape[0]
        return raw[r * stride : (r + 1) * stride]

    def kv_page(page: int) -> np.ndarray:
        b = buffers["kv"]
        return np.frombuffer(read_bytes("kv"), NUMPY_DTYPES[b.dtype]).reshape(b.shape)[:, :, page].copy()

    originals = {}
    ex.write("state.len", np.int32(count), s1)  # the snapshot's record reports the live count
    for name in cont:
        originals[name] = random_row(name)
        ex.write(name, originals[name], s1)
        ex.write(name, random_row(name), s2)
    kv = buffers["kv"]
    ex.write("kv", rng.integers(0, 256, kv.nbytes, dtype=np.uint8).view(NUMPY_DTYPES[kv.dtype]).reshape(kv.shape))
    page_before = kv_page(p1)
    ex.write(io.StateInput.buffer, io.pack(io.StateInput(s1, row, p1, count)))
    ex.submit("snapshot.1")
    await ex.wait()
    snap_record = list(io.unpack(io.StateCompletion, ex.read(io.STATE_COMPLETION)[0]))
    checks = {}
    for name in cont:
        checks[f"snapshot {name}"] = row_bytes(snapshot_buffer(name), row) == originals[name].tobytes()
    checks["snapshot tail page"] = row_bytes(tail, row) == page_before.tobytes()
    snaps_before = {n: read_bytes(snapshot_buffer(n)) for n in cont}
    tail_before = read_bytes(tail)
    ex.write(io.StateInput.buffer, io.pack(io.StateInput(s2, row, p2, count)))
    ex.submit("restore.1")
    await ex.wait()
    restore_record = list(io.unpack(io.StateCompletion, ex.read(io.STATE_COMPLETION)[0]))
    for name in cont:
        checks[f"restore {name}"] = row_bytes(name, s2) == originals[name].tobytes()
        checks[f"source row immutable {name}"] = read_bytes(snapshot_buffer(name)) == snaps_before[name]
    checks["restore tail page"] = kv_page(p2).tobytes() == page_before.tobytes()
    checks["source tail immutable"] = read_bytes(tail) == tail_before
    lens = np.frombuffer(read_bytes("state.len"), np.int32)
    checks["restored length"] = int(lens[s2]) == count
    return {"checks": checks, "snapshot_record": snap_record, "restore_record": restore_record,
            "expected_records": [list(io.StateCompletion(s1, row, count)), list(io.StateCompletion(s2, row, count))]}


async def main(core: str, kind: str, cache: str, prompts_path: str, out: str, roundtrip: bool,
               batch: bool = False) -> None:
    m = load_manifest(core)
    ex = _executor(kind, core, m)
    engine = Engine(ex, prefix_cache=cache == "on")
    await engine.start()
    prompts = json.load(open(prompts_path))
    sched = engine.scheduler
    phase1 = await _generate(engine, prompts, TOKENS, list(range(len(prompts))), logprobs=FIRST_LOGPROBS)
    follow, rng = [], np.random.default_rng(3)
    # The most recent conversations, newest first: checkpoints are evicted least recently
    # used under page and snapshot pressure, and phase 1 left more than the pool holds.
    sources = list(range(len(prompts) - 1, len(prompts) - 1 - FOLLOW_UPS, -1))
    turns = [(prompts[sources[0]], sources[0])]  # an exact repeat: the whole prompt is cached
    turns += [(prompts[i] + phase1[i].output + rng.integers(100, 1000, TAIL).tolist(), i) for i in sources]
    for prompt, i in turns:
        before = sched.prefill_tokens_total
        (r,) = await _generate(engine, [prompt], TOKENS, [i], logprobs=FIRST_LOGPROBS)
        follow.append({"source": i, "prompt_tokens": len(prompt), "previous_prompt_tokens": len(prompts[i]),
                       "cached_tokens": r.cached_tokens, "prefill_tokens": sched.prefill_tokens_total - before,
                       "output": r.output, "first_top": _top(r)})
    conversation, prompt = [], prompts[0]
    for turn in range(TURNS):
        before = sched.prefill_tokens_total
        (r,) = await _generate(engine, [prompt], TOKENS, [1000 + turn])
        conversation.append({"prompt_tokens": len(prompt), "cached_tokens": r.cached_tokens,
                             "prefill_tokens": sched.prefill_tokens_total - before, "output": r.output})
        prompt = prompt + rng.integers(100, 1000, 20 + TAIL).tolist()
    # Last, so that the phases above run as in a drive without it.
    batched = await _batch_check(engine, m) if batch else None
    result = {"executor": kind, "cache": cache, "phase1": [r.output for r in phase1],
              "phase1_first_top": [_top(r) for r in phase1], "follow_ups": follow,
              "conversation": conversation, "stats": ex.stats()}
    if batched is not None:
        result["batch"] = batched
    while sched.has_work():  # terminal captures still running: the engine owns the executor
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    if roundtrip:
        result["roundtrip"] = await _roundtrip(ex, m)
    await engine.shutdown()
    result["torch_imported"] = "torch" in sys.modules
    json.dump(result, open(out, "w"))


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], a[2], a[3], a[4], "--roundtrip" in a, "--batch" in a))
