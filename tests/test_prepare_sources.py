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


def test_row_invariant_step_norms_without_the_prompt_programs_norms_are_refused(tmp_path):
    """``--step-norms invariant`` takes the prompt programs' row-invariant norms, which
    ``--split-prompt-gemms`` leaves to the compiler: refused before any program is built, a
    typed error, no core."""
    proc = _prepare("qwen3-tiny", tmp_path / "core", "--step-norms", "invariant", "--split-prompt-gemms")
    assert proc.returncode == 2 and "--split-prompt-gemms leaves to the compiler" in proc.stderr, proc.stderr[-1000:]
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
