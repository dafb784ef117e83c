"""Prepared GPU programs (exported graphs, replayed by the runtime) against the
Transformers model on the same random weights, BF16.

Bound, derived per model: Transformers' own BF16 forward differs from its FP32
forward on the same weights by err_ref = max |logits_bf16 - logits_fp32|; this
is the arithmetic error of a correct BF16 implementation. Flare's programs use
other kernels (paged attention, compiled fusions) with the same BF16 storage,
so their error against FP32 must be of the same size: we require
max |logits_flare - logits_fp32| <= 2 * err_ref. Argmax agreement with FP32 is
required wherever FP32's top-2 margin exceeds 2 * err_ref (elsewhere a flip is
a near-tie that BF16 cannot resolve); the overall agreement is reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import numpy as np

from tests.gpu.conftest import record

DECODE_STEPS = 12
LENGTHS = [15, 16, 17, 40, 255, 256, 257, 600, 1100]


def teacher_forced(core, prompts: list[list[int]], steps: int) -> dict:
    """tests/gpu/drive_teacher.py's arrays for ``prompts``, run in a torch-free subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        pj, out = f"{tmp}/prompts.json", f"{tmp}/out.npz"
        json.dump(prompts, open(pj, "w"))
        proc = subprocess.run([sys.executable, "-m", "tests.gpu.drive_teacher", str(core), pj, out, str(steps)],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return dict(np.load(out))


def _hf_model(core, dtype):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from flare.core.manifest import load_manifest
    from flare.prepare.recipes import by_name

    m = load_manifest(core)
    recipe = by_name(m.reference.recipe)
    config = recipe.config_from_json(m.reference.config)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    raw = load_file(str(core / m.arena.image))
    state = recipe.checkpoint_state(m.reference.config, raw)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k or "rotary" in k for k in missing), (missing, unexpected)
    model.tie_weights()
    return model.to(device="cuda", dtype=dtype).eval(), raw


def test_teacher_forced_logits_match_transformers(gpu_shape_core, results_dir):
    import torch

    model_name, core = gpu_shape_core
    from flare.core.manifest import load_manifest

    m = load_manifest(core)
    rng = np.random.default_rng(0)
    lengths = [n for n in LENGTHS if n + 1 < m.capacities.context_limit]
    prompts = [rng.integers(0, m.capacities.sampling_vocab, n).tolist() for n in lengths]
    flare = teacher_forced(core, prompts, DECODE_STEPS)
    hf32, raw = _hf_model(core, torch.float32)
    hf16, _ = _hf_model(core, torch.bfloat16)
    lm_head = hf32.lm_head.weight  # fp32 on GPU
    per_prompt = []
    worst_flare, worst_ref, agree, total, hard_flips = 0.0, 0.0, 0, 0, 0
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            ref = hf32(x).logits[0].float()
            low = hf16(x).logits[0].float()
        hidden = torch.from_numpy(flare[f"hidden_{i}"].astype(np.int32) << 16).view(torch.float32).cuda()
        got = torch.cat([hidden @ lm_head.T, torch.from_numpy(flare[f"logits_{i}"]).cuda()])
        # hidden row j predicts token j+1; decode step k consumes ids[n_pre + k] -> position n_pre + k
        assert got.shape == ref.shape, (got.shape, ref.shape)
        err_flare = (got - ref).abs().max().item()
        err_ref = (low - ref).abs().max().item()
        top2 = ref.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        same = got.argmax(-1) == ref.argmax(-1)
        hard = (~same) & (margin > 2 * err_ref)
        per_prompt.append({"length": len(ids), "err_flare": err_flare, "err_transformers_bf16": err_ref,
                           "argmax_agreement": same.float().mean().item(), "hard_flips": int(hard.sum())})
        worst_flare, worst_ref = max(worst_flare, err_flare), max(worst_ref, err_ref)
        agree += int(same.sum())
        total += same.numel()
        hard_flips += int(hard.sum())
    summary = {"bound": "max|flare - fp32| <= 2 * max|transformers_bf16 - fp32|", "err_flare": worst_flare,
               "err_transformers_bf16": worst_ref, "argmax_agreement": agree / total, "hard_flips": hard_flips,
               "prompts": per_prompt}
    record(results_dir, "qualification", {f"{model_name}-numerics": summary})
    assert worst_flare <= 2 * worst_ref, summary
    assert hard_flips == 0, summary
