"""The replay floor: decode graphs launched back to back by a minimal harness.

usage: python -m bench.floor CORE OUT.json [steps] [--decode-only]

No scheduler, no HTTP: B slots are set up as endless requests (no stop ids,
huge max_new), then decode.B is launched ``steps`` times; the pending token
stays on the device between steps. Reports GPU time per step (events), wall
time per step with one step in flight (launch, wait) and with two (launch N+1,
wait for N) -- the floor the full server is measured against -- plus the
device copy bandwidth for the roofline.

``verify`` (cores prepared with ``--draft-tokens D``): each verify.B's GPU time per step
against decode.B's, every row verifying D drafts (``verify_times``): the cost of W = D + 1
positions, what an accepted draft must pay for.

``programs``: the GPU time of the programs a first token waits for, one launch
at a time on the same state (``program_times``): what a cold short prompt runs
(admit, prefill of 16 tokens) against what a prefix hit runs (admit, restore,
prefill of an 11-token tail after 4,096 cached tokens), and resume/snapshot.

The slots ask for no log-probabilities, as the serving client's requests (the sampling
programs then skip their log-probability blocks); ``FLARE_BENCH_LOGPROBS=1``: every slot
asks (``slots_ask_logprobs`` in the JSON; bench/timeline.py sets its slots up the same way).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import time

import numpy as np
from cuda.bindings import driver as d

from flare.core import interface as io
from flare.core.manifest import ProgramKind, load_manifest
from flare.core.sampling_params import NEUTRAL
from flare.runtime.cuda_driver import ck, driver_version
from flare.runtime.cuda_executor import CudaExecutor


LOGPROBS = os.environ.get("FLARE_BENCH_LOGPROBS") == "1"


def _setup_slots(ex: CudaExecutor, m, batch: int) -> None:
    c = m.capacities
    per = (m.pages.num_pages - 1) // c.slots
    for s in range(1, c.slots + 1):
        n = min(per, c.max_pages_per_slot)
        rows = io.slot_state(pending=100 + s, generated=0, max_new=1 << 30, seed=s,
                             sampling={**NEUTRAL, "top_k": 20, "top_p": 0.95}, stop_ids=(), stop_capacity=c.stop_ids,
                             pages=range(1 + (s - 1) * per, 1 + (s - 1) * per + n), max_pages=c.max_pages_per_slot,
                             mask_on=False, logprobs=LOGPROBS)
        rows["state.len"] = np.int32(16)  # a short history already in KV
        for name, value in rows.items():
            ex.write(name, value, s)
    slots = np.zeros(max(c.decode_capacities), np.int32)
    slots[:batch] = np.arange(1, batch + 1)
    ex.write(io.DECODE_SLOTS, slots)


def copy_bandwidth(ex: CudaExecutor, m) -> float:
    """Device-to-device copy inside the arena (KV pages), bytes read + written per second."""
    kv = m.buffer("kv")
    n = kv.nbytes // 2 // (1 << 20) * (1 << 20)
    src, dst = ex.arena.base + kv.offset, ex.arena.base + kv.offset + n
    e0, e1 = ck(d.cuEventCreate(0), "event"), ck(d.cuEventCreate(0), "event")
    for _ in range(3):
        ck(d.cuMemcpyDtoDAsync(d.CUdeviceptr(dst), d.CUdeviceptr(src), n, ex.stream), "copy")
    ck(d.cuEventRecord(e0, ex.stream), "record")
    reps = 20
    for _ in range(reps):
        ck(d.cuMemcpyDtoDAsync(d.CUdeviceptr(dst), d.CUdeviceptr(src), n, ex.stream), "copy")
    ck(d.cuEventRecord(e1, ex.stream), "record")
    ck(d.cuEventSynchronize(e1), "sync")
    ms = ck(d.cuEventElapsedTime(e0, e1), "elapsed")
    return 2 * n * reps / (ms / 1e3)


def gpu_ms_per_step(ex: CudaExecutor, program: str, steps: int, *, warmup: int) -> float:
    """GPU time per launch of ``program`` launched ``steps`` times back to back (events
    around them), after ``warmup`` launches."""
    for _ in range(warmup):
        ex.submit(program)
    ex.sync()
    e0, e1 = ck(d.cuEventCreate(0), "event"), ck(d.cuEventCreate(0), "event")
    try:
        ck(d.cuEventRecord(e0, ex.stream), "record")
        for _ in range(steps):
            ex.submit(program)
        ck(d.cuEventRecord(e1, ex.stream), "record")
        ck(d.cuEventSynchronize(e1), "sync")
        return ck(d.cuEventElapsedTime(e0, e1), "elapsed") / steps
    finally:
        d.cuEventDestroy(e0)
        d.cuEventDestroy(e1)


def _timed_launch(ex: CudaExecutor, program: str, writes: list, reps: int = 20, warmup: int = 3) -> float:
    """Median GPU milliseconds of one launch of ``program`` (its completion copy
    included), each launch after ``writes`` (buffer, value, row) are staged."""
    e0, e1 = ck(d.cuEventCreate(0), "event"), ck(d.cuEventCreate(0), "event")
    samples = []
    try:
        for i in range(warmup + reps):
            for buffer, value, row in writes:
                ex.write(buffer, np.asarray(value), row)
            ck(d.cuEventRecord(e0, ex.stream), "record")
            ex.submit(program)
            ck(d.cuEventRecord(e1, ex.stream), "record")
            ex.sync()
            if i >= warmup:
                samples.append(ck(d.cuEventElapsedTime(e0, e1), "elapsed"))
    finally:
        d.cuEventDestroy(e0)
        d.cuEventDestroy(e1)
    return float(np.median(samples))


def prefill_writes(m, start: int, n: int, rng: np.random.Generator) -> tuple[str, list]:
    """The prefill program the scheduler picks for ``n`` new tokens of slot 1 after ``start``
    in KV, and the (buffer, value, row) writes that stage it (random tokens)."""
    c = m.capacities
    cap = next(x for x in c.prefill_capacities if x >= n)
    tokens = np.zeros(max(c.prefill_capacities), np.int32)
    tokens[:n] = rng.integers(1000, min(30000, c.sampling_vocab), n)
    return f"prefill.{cap}", [("state.len", np.int32(start), 1), (io.TOKENS, tokens, None),
                              (io.PrefillInput.buffer, io.pack(io.PrefillInput(1, n, 1)), None)]


def program_times(ex: CudaExecutor, m, history: int = 4096, tail: int = 11, short: int = 16) -> dict:
    """GPU ms of the programs before a first token: a cold ``short``-token prompt runs
    admit + prefill; a prefix hit of ``history`` cached tokens runs admit + restore +
    prefill of its ``tail``. Slot 1 holds the request (``_setup_slots``)."""
    c = m.capacities
    _setup_slots(ex, m, 1)
    ex.sync()
    ps = m.pages.page_size
    # Slot 1's page table is 1, 2, ... (``_setup_slots``): the history and a whole chunk after it must fit.
    pages = min((m.pages.num_pages - 1) // c.slots, c.max_pages_per_slot)
    history = min(history, (pages * ps - max(c.prefill_capacities)) // ps * ps, c.context_limit - c.prefill_chunk)
    page = 1 + history // ps  # the page holding position `history` (a restored tail page)
    rng = np.random.default_rng(0)
    admit = m.programs_of(ProgramKind.admit)[0]

    def prefill(start: int, n: int) -> tuple[str, list]:
        return prefill_writes(m, start, n, rng)

    out = {"history_tokens": history, "tail_tokens": tail, "short_tokens": short}
    tokens = np.zeros(admit.capacity, np.int32)
    out["admit"] = {"program": admit.name, "gpu_ms": _timed_launch(
        ex, admit.name, [(io.TOKENS, tokens, None),
                         (io.AdmitInput.buffer, io.pack(io.AdmitInput(1, short, 1, io.AdmitMode.prompt)), None)])}
    for key, (start, n) in {"prefill_cold_short": (0, short), "prefill_hit_tail": (history, tail),
                            "prefill_cold_tail": (0, tail)}.items():
        name, writes = prefill(start, n)
        out[key] = {"program": name, "gpu_ms": _timed_launch(ex, name, writes)}
    if c.snapshot_rows:
        state = [(io.StateInput.buffer, io.pack(io.StateInput(1, 1, page, history)), None)]
        out["restore"] = {"program": "restore.1", "gpu_ms": _timed_launch(ex, "restore.1", state)}
        out["snapshot"] = {"program": "snapshot.1", "gpu_ms": _timed_launch(
            ex, "snapshot.1", [("state.len", np.int32(history), 1), *state])}
    out["resume"] = {"program": "resume.1", "gpu_ms": _timed_launch(
        ex, "resume.1", [(io.PrefillInput.buffer, io.pack(io.PrefillInput(1, 0, 1)), None)])}
    return out


def verify_times(ex: CudaExecutor, m, steps: int, decode: dict) -> dict:
    """GPU ms per launch of each verify.B with every row verifying the core's D drafts (W = D + 1
    positions; what a step costs does not depend on how many are accepted), against decode.B's."""
    c = m.capacities
    rng = np.random.default_rng(0)
    out = {}
    for p in m.programs_of(ProgramKind.verify):
        b = p.capacity
        _setup_slots(ex, m, b)
        rows = np.zeros((max(c.decode_capacities), len(io.VerifyInput._fields)), np.int32)
        rows[:b] = [io.pack(io.VerifyInput(s, c.draft_tokens, c.context_limit)) for s in range(1, b + 1)]
        ex.write(io.VERIFY_INPUT, rows)
        ex.write(io.DRAFTS, rng.integers(1000, min(30000, c.sampling_vocab),
                                         (max(c.decode_capacities), c.draft_tokens)).astype(np.int32))
        ex.sync()
        ms = gpu_ms_per_step(ex, p.name, steps, warmup=5)
        out[b] = {"width": c.draft_tokens + 1, "gpu_ms_per_step": ms,
                  "over_decode": ms / decode[b]["gpu_ms_per_step"] if b in decode else None}
    return out


def run_meta(m, ex) -> dict:
    """Where and with what a figure was measured: this machine and its driver, the command, and
    the core's preparation (its versions, fingerprint and device, from the manifest)."""
    ident = m.identity
    return {"machine": platform.node(), "device": ex.device.name, "python": sys.version.split()[0],
            "cuda_driver": driver_version(), "command": " ".join(sys.argv),
            "prepared": {"versions": dict(ident.versions), "fingerprint": ident.fingerprint,
                         "model_type": ident.model_type, "device_name": ident.device_name,
                         "compute_capability": ident.compute_capability}}


async def main(core: str, out: str, steps: int, decode_only: bool = False) -> None:
    m = load_manifest(core)
    ex = CudaExecutor(core, m)
    await ex.start()
    results = {"core": core, "device": ex.device.name, "meta": run_meta(m, ex), "steps": steps,
               "slots_ask_logprobs": LOGPROBS, "decode": {}}
    if not decode_only:
        results["copy_bandwidth_Bps"] = copy_bandwidth(ex, m)
    for b in m.capacities.decode_capacities:
        _setup_slots(ex, m, b)
        ex.sync()
        prog = f"decode.{b}"
        gpu_ms = gpu_ms_per_step(ex, prog, steps, warmup=5)
        walls = []
        for _ in range(steps):
            t = time.perf_counter()
            ex.submit(prog)
            await ex.wait()
            ex.read("out.decode_completion")
            walls.append(time.perf_counter() - t)
        wall_ms = float(np.median(walls) * 1e3)
        # Two in flight, as the engine runs a steady batch: launch N+1, then wait for N
        # and read its records.
        walls2 = []
        ticket = ex.submit(prog)
        for _ in range(steps):
            t = time.perf_counter()
            ticket = ex.submit(prog)
            await ex.wait(ticket - 1)
            ex.completion(ticket - 1)
            walls2.append(time.perf_counter() - t)
        await ex.wait()
        wall2_ms = float(np.median(walls2) * 1e3)
        results["decode"][b] = {"gpu_ms_per_step": gpu_ms, "wall_ms_per_step_one_in_flight": wall_ms,
                                "wall_ms_per_step_two_in_flight": wall2_ms,
                                "tokens_per_s_gpu": b / gpu_ms * 1e3, "tokens_per_s_wall": b / wall_ms * 1e3}
    verify = m.programs_of(ProgramKind.verify)
    if verify:
        results["verify"] = verify_times(ex, m, steps, results["decode"])
        print(json.dumps(results["verify"]))
    if not decode_only:
        results["programs"] = program_times(ex, m)
        print(json.dumps(results["programs"]))
    results["executor_stats"] = ex.stats()
    await ex.close()
    assert "torch" not in sys.modules
    json.dump(results, open(out, "w"), indent=1)
    print(json.dumps(results["decode"]))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--decode-only"]
    asyncio.run(main(args[0], args[1], int(args[2]) if len(args) > 2 else 200, "--decode-only" in sys.argv))
