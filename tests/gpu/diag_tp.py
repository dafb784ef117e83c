"""Temporary diagnostic (not committed): TP=2 variants against TP=1 on one GPU."""
import json, subprocess, sys, tempfile
import numpy as np
from tests.conftest import prepare_core
from tests.gpu.test_tensor_parallel_cuda import MODEL, OPTS, LENGTHS, _teacher

rng = np.random.default_rng(1)
tp1 = prepare_core(MODEL, OPTS, name=f"{MODEL}-cuda-tp1")
from flare.core.manifest import load_manifest
m = load_manifest(tp1)
prompts = [rng.integers(0, m.capacities.sampling_vocab, n).tolist() for n in LENGTHS]
one = _teacher(tp1, prompts)
def bf(a): return (a.astype(np.int32) << 16).view(np.float32)
variants = {"default": [], "gather": ["--attention", "gather"], "nocompile": ["--no-compile"]}
for name, extra in variants.items():
    o = [x for x in OPTS if x != "--no-compile"] + extra + ["--tp", "2"]
    try:
        core = prepare_core(MODEL, o, name=f"{MODEL}-cuda-tp2-{name}")
        two = _teacher(core, prompts)
    except Exception as e:
        print(name, "FAILED", repr(e)[:2000]); continue
    for i, n in enumerate(LENGTHS):
        h1, h2 = bf(one[f"hidden_{i}"]), bf(two[f"hidden_{i}"])
        dh = np.abs(h1 - h2).max(axis=-1)
        dl = np.abs(one[f"logits_{i}"] - two[f"logits_{i}"]).max(axis=-1)
        print(name, n, "hidden rows max diff", np.round(dh[:6], 4), "... max", dh.max(), "| hidden scale", np.abs(h1).max(),
              "| decode logits diff", np.round(dl, 3))
