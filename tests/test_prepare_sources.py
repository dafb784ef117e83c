"""flare-prepare's model sources and command line: where a core's sampling defaults come
from (a named config's [sampling], else a checkpoint's generation_config.json, else
neutral; --sampling over any of them, recorded with its source in the manifest), and the
time it reports (the command's own wall time)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flare import zygote
from flare.core.sampling_params import NEUTRAL
from flare.prepare.sources import configs_dir, resolve

CPU = ["--device", "cpu", "--context-limit", "256", "--prefill-chunk-size", "128", "--kv-pages", "32",
       "--decode-capacities", "1,2"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint directory as Transformers writes one, with SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama-hf")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=49152, max_position_embeddings=512, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(configs_dir() / "tokenizers" / "smollm2" / f, d / f)
    (d / "generation_config.json").unlink(missing_ok=True)
    return d


def _with_generation_config(hf_dir: Path, tmp_path: Path, fields: dict) -> Path:
    d = tmp_path / "model"
    shutil.copytree(hf_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "do_sample": True, **fields}))
    return d


def test_generation_config_sampling_fields_become_the_defaults(hf_dir, tmp_path):
    d = _with_generation_config(hf_dir, tmp_path, {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                   "max_new_tokens": 99})
    src = resolve(str(d))
    assert src.sampling_source == "generation_config.json"
    assert src.sampling == {**NEUTRAL, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


def test_without_generation_config_the_defaults_are_neutral(hf_dir):
    src = resolve(str(hf_dir))
    assert src.sampling_source == "neutral" and src.sampling == NEUTRAL


def test_a_named_configs_sampling_wins():
    src = resolve("smollm2-135m-shape")
    assert src.sampling_source == "config [sampling]"


def _prepare(model: str, out: Path, *extra: str, fresh: bool = False) -> subprocess.CompletedProcess:
    """``fresh``: its worker started afresh, not forked from the suite's zygote (conftest.py)."""
    env = {k: v for k, v in os.environ.items() if not (fresh and k == zygote.ENV)}
    return subprocess.run([sys.executable, "-m", "flare.prepare.cli", model, "--out", str(out), *CPU, *extra],
                          capture_output=True, text=True, timeout=300, env=env)


def test_sampling_option_overrides_and_is_recorded_with_its_source(hf_dir, tmp_path):
    d = _with_generation_config(hf_dir, tmp_path, {"temperature": 0.7, "top_p": 0.8})
    t0 = time.time()
    # A worker started afresh: its imports are inside the reported time (the worker's own clock would leave
    # them out), where a forked one's take nothing.
    proc = _prepare(str(d), tmp_path / "core", "--sampling", "temperature=0.5", "--sampling",
                    "temperature=0.6,min_p=0.05", fresh=True)
    wall = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = json.loads((tmp_path / "core" / "manifest.json").read_text())["sampling"]
    assert (s["temperature"], s["top_p"], s["min_p"]) == (0.6, 0.8, 0.05)
    assert s["source"] == "--sampling over generation_config.json"
    assert "sampling defaults (--sampling over generation_config.json): temperature=0.6, top_p=0.8, min_p=0.05" \
        in proc.stdout
    # The reported time is the command's: the clock of its last line, close to the wall time.
    clock, done = map(float, re.search(r"\[flare-prepare +([0-9.]+)s\] done in ([0-9.]+) s", proc.stdout).groups())
    assert abs(done - clock) <= 0.1 and done <= wall and done >= 0.6 * wall, (done, clock, wall)


@pytest.mark.parametrize("value, message", [("temperature=9", "outside the range"),
                                            ("top_k=49200", "outside the range [0.0, 49158]"),
                                            ("tempo=1", "expected NAME=VALUE"), ("top_k=x", "is not an integer")])
def test_bad_sampling_options_are_errors(value, message, tmp_path):
    # qwen3-tiny declares top_k up to its padded vocabulary (49,216); its tokenizer has 49,158 ids.
    proc = _prepare("qwen3-tiny", tmp_path / "core", "--sampling", value)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-1000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "core").exists()


@pytest.mark.parametrize("option, message", [
    (("--step-norms", "invariant"), "--split-prompt-gemms leaves to the compiler"),
    (("--prompt-gemms", "measure"), "--split-prompt-gemms leaves to cuBLAS")])
def test_row_invariant_options_without_the_prompt_programs_unsplit_products_are_refused(tmp_path, option, message):
    """``--step-norms invariant`` takes the prompt programs' row-invariant norms, which
    ``--split-prompt-gemms`` leaves to the compiler, and ``--prompt-gemms measure`` times their
    unsplit GEMM, which it leaves to cuBLAS: refused before any program is built, a typed error,
    no core."""
    proc = _prepare("qwen3-tiny", tmp_path / "core", *option, "--split-prompt-gemms")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-1000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "core").exists()


def test_dependent_launch_is_refused_off_cuda(tmp_path):
    """``--dependent-launch on`` (Hopper's programmatic dependent launch of the MoE decode kernels) on
    the CPU: a typed error before any program is built, no core."""
    proc = _prepare("qwen3-moe-tiny", tmp_path / "core", "--dependent-launch", "on")
    assert proc.returncode == 2 and "--dependent-launch on is a CUDA option" in proc.stderr, proc.stderr[-1000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "core").exists()


WINDOW = 24


@pytest.fixture(scope="module")
def mistral_core(tmp_path_factory) -> Path:
    """A tiny Mistral checkpoint (every layer windowed to 24 tokens) prepared with a context
    ten times its window."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    d = tmp_path_factory.mktemp("tiny-mistral-hf")
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, eos_token_id=2,
                        sliding_window=WINDOW, initializer_range=0.2)
    MistralForCausalLM(cfg).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(configs_dir() / "tokenizers" / "smollm2" / f, d / f)
    (d / "generation_config.json").unlink(missing_ok=True)
    out = tmp_path_factory.mktemp("tiny-mistral-core") / "core"
    proc = _prepare(str(d), out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sliding-window attention: 24 tokens" in proc.stdout, proc.stdout[-2000:]
    return out


def test_sliding_window_attention_matches_transformers(mistral_core):
    """Teacher-forced logits of a 200-token prompt (prefill chunks cut inside and across the
    window) and 8 decode steps after it, against Transformers' FP32 forward with its own
    sliding-window mask; the same prompt without the window differs, so the window is
    what is being checked."""
    import torch

    from flare.core.manifest import load_manifest
    from tests.rig import admit, decode, load_rig, prefill, transformers_model

    m = load_manifest(mistral_core)
    assert m.capacities.context_limit == 256
    rig = load_rig(mistral_core)
    hf = transformers_model(mistral_core, m, torch.float32)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 49152, (208,), generator=g).tolist()
    prompt, forced = ids[:200], ids[200:]
    admit(rig, 1, prompt, list(range(1, 15)), seed=1)
    hidden, _, _ = prefill(rig, 1, prompt, splits=(10, 37, 150))
    rows = [hidden @ rig.model.lm_head.weight.detach().T]
    for t in forced:
        rows.append(decode(rig, [1], [t])[0])
    got = torch.cat(rows)  # row j predicts token j + 1
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0][: len(got)]
        hf.config.sliding_window = None
        full = hf(torch.tensor([ids])).logits[0][: len(got)]
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item() + 1e-5
    assert (full - want)[WINDOW:].abs().max().item() > 100 * (got - want).abs().max().item()
    assert torch.allclose(full[:WINDOW], want[:WINDOW], atol=1e-5)


def test_a_windowed_core_declares_its_window_and_a_full_one_none(mistral_core, tiny_core):
    """``pages.kv_window``: the largest window of the layers that own KV pages (every tiny Mistral
    layer: 24); a core whose layers read their whole history (the tiny Llama) declares none."""
    from flare.core.manifest import load_manifest

    assert load_manifest(mistral_core).pages.kv_window == WINDOW
    assert load_manifest(tiny_core).pages.kv_window is None


def test_pages_that_leave_every_window_are_released_and_nothing_changes(mistral_core):
    """A two-turn conversation on the windowed core (window 24, pages of 16): the first turn
    generates 150 tokens past a 40-token prompt, the second continues its history from the
    first's terminal checkpoint. With the release (the manifest's ``kv_window``), the request holds
    at most the pages of its window and the margin once it is past them, the second turn restores
    a checkpoint whose segment has released (null) entries, and every generated token and every
    logit at a generated position is the same as without the release (``kv_window`` None), the
    tokens also as with the prefix cache off; the scheduler's invariants hold after every step."""
    import asyncio

    import msgspec
    import numpy as np

    from flare.core.manifest import load_manifest
    from flare.runtime.reference import ReferenceExecutor
    from flare.runtime.request import Request
    from flare.runtime.scheduler import Scheduler
    from flare.server.params import resolve_sampling
    from tests.test_conversation_cache import _step

    m = load_manifest(mistral_core)
    ps, window = m.pages.page_size, m.pages.kv_window
    assert (ps, window) == (16, WINDOW)
    rng = np.random.default_rng(5)
    first, extra = rng.integers(3, 49152, 40).tolist(), rng.integers(3, 49152, 10).tolist()
    bound = -(-window // ps) + 3  # the window's pages, the one before it, the margin, the next page

    async def converse(manifest, prefix_cache):
        ex = ReferenceExecutor(mistral_core, manifest)
        await ex.start()
        sched = Scheduler(manifest, prefix_cache=prefix_cache)
        outputs, logits, held = [], [], []
        prompt = first
        try:
            for i, n in enumerate((150, 20)):
                params = resolve_sampling(manifest, prompt_len=len(prompt), fields={"top_k": 1}, max_tokens=n,
                                          seed=7 + i, stop_token_ids=None, ignore_eos=True)
                req = Request(list(prompt), params, request_id=f"turn{i}")
                sched.add(req)
                rows = []

                def on_logits(r, row, rows=rows, req=req):
                    rows.append(row.copy())
                    # the request's own pages (the prompt end's checkpoint holds the first ones too)
                    held.append((i, r.consumed, sum(p != m.pages.null_page and sched.pages.refcount(p) == 1
                                                    for p in req.pages)))

                while await _step(ex, sched, on_logits):
                    pass
                assert req.finished and req.error is None and len(req.output) == n
                outputs.append(list(req.output))
                logits.append(np.stack(rows))
                if i == 1:
                    cached = req.cached_tokens
                prompt = prompt + list(req.output) + extra
        finally:
            await ex.close()
        return outputs, logits, held, cached, sched

    plain = msgspec.structs.replace(m, pages=msgspec.structs.replace(m.pages, kv_window=None))
    out, lg, held, cached, sched = asyncio.run(converse(m, True))
    out_kept, lg_kept, held_kept, cached_kept, sched_kept = asyncio.run(converse(plain, True))
    out_off, lg_off, _, _, _ = asyncio.run(converse(m, False))
    assert out == out_kept == out_off
    # The release changes no bit; the cache off changes the second turn's prefill partition (the
    # whole history, not the tail after the checkpoint), which rounds otherwise (tests/test_conversation_cache.py).
    assert all(np.array_equal(a, b) for a, b in zip(lg, lg_kept))
    assert np.array_equal(lg[0], lg_off[0])
    assert np.abs(lg[1] - lg_off[1]).max() < 1e-4 * np.abs(lg_off[1]).max()
    # Released as they left the window; the second turn resumed the first's whole history.
    assert sched.window_pages_released_total > 0 and sched_kept.window_pages_released_total == 0
    assert cached == cached_kept >= 180
    # (the first turn: the second's anchor chain, shared with the cache, is not the request's to release)
    late = [h for i, c, h in held if i == 0 and c >= window + 3 * ps]
    assert late and max(late) <= bound, held
    assert max(h for _, _, h in held_kept) >= (40 + 150) // ps - 40 // ps  # (the prompt's pages: the cache's)

    # Through the engine, two steps in flight: a steady decode batch's steps are scheduled ahead.
    async def engine_turn():
        from flare.runtime.engine import Engine
        from tests.test_pipeline import Sink

        engine = Engine(ReferenceExecutor(mistral_core, m), steps_in_flight=2)
        await engine.start()
        try:
            params = resolve_sampling(m, prompt_len=len(first), fields={"top_k": 1}, max_tokens=150, seed=7,
                                      stop_token_ids=None, ignore_eos=True)
            req = Request(list(first), params, Sink())
            engine.submit(req)
            await asyncio.wait_for(req.sink.done.wait(), 300)
            return list(req.output), engine.gauges()
        finally:
            await engine.shutdown(1.0)

    tokens, gauges = asyncio.run(engine_turn())
    assert tokens == out[0] and gauges["flare_engine_steps_ahead_total"] > 100
    # (the prompt's pages are its checkpoint's; one page of margin before the window)
    assert gauges["flare_kv_window_pages_released_total"] >= (40 + 150 - window) // ps - 40 // ps - 2, gauges
