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

Hybrid models: Transformers replaces its torch gated delta rules by
flash-linear-attention's kernels whenever ``fla`` is importable (it is carried
to the GPU machine). Those kernels use TF32 dot products, so the FP32 reference
and the BF16 bound are computed with Transformers' own torch rules
(``torch_delta_rules``); the error of Transformers as installed (with FLA) is
recorded beside them.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import subprocess
import sys
import tempfile

import numpy as np

from tests.gpu.conftest import measured_logit_error_path, record

DECODE_STEPS = 12
LENGTHS = [15, 16, 17, 40, 255, 256, 257, 600, 1100]


def teacher_forced(core, prompts: list[list[int]], steps: int, release: bool = False) -> dict:
    """tests/gpu/drive_teacher.py's arrays for ``prompts``, run in a torch-free subprocess
    (``release``: with the pages that left every layer's window pointing at the null page)."""
    with tempfile.TemporaryDirectory() as tmp:
        pj, out = f"{tmp}/prompts.json", f"{tmp}/out.npz"
        json.dump(prompts, open(pj, "w"))
        proc = subprocess.run([sys.executable, "-m", "tests.gpu.drive_teacher", str(core), pj, out, str(steps),
                               *(["release"] if release else [])], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return dict(np.load(out))


@contextlib.contextmanager
def torch_delta_rules():
    """Transformers' Qwen3.5 runs its torch gated delta rules (the recipe's reference
    rules: unwrapped, heads repeated for the value heads) and torch convolutions instead
    of the kernels its hub decorator substituted. A no-op for other models."""
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as q
    except ImportError:
        yield
        return
    from flare.prepare.recipes.qwen3_5 import _torch_delta_rules

    rules = dict(zip(("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"), _torch_delta_rules()))
    convs = ("causal_conv1d_fn", "causal_conv1d_update")  # hub-substituted too, when installed
    saved = {n: getattr(q, n) for n in (*rules, *convs) if hasattr(q, n)}
    for n, f in saved.items():
        setattr(q, n, rules[n] if n in rules else inspect.unwrap(f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(q, n, f)


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
    window = json.loads(m.reference.config).get("sliding_window")
    if window and 2 * window + 200 < m.capacities.context_limit:
        lengths.append(2 * window + 200)  # past two windows: most keys are outside every row's window
    prompts = [rng.integers(0, m.capacities.sampling_vocab, n).tolist() for n in lengths]
    flare = teacher_forced(core, prompts, DECODE_STEPS)
    hf32, raw = _hf_model(core, torch.float32)
    hf16, _ = _hf_model(core, torch.bfloat16)
    lm_head = hf32.lm_head.weight  # fp32 on GPU
    per_prompt = []
    worst_flare, worst_ref, agree, total, hard_flips = 0.0, 0.0, 0, 0, 0
    worst_installed = 0.0
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            with torch_delta_rules():
                ref = hf32(x).logits[0].float()
                low = hf16(x).logits[0].float()
            installed = hf16(x).logits[0].float()  # Transformers as installed (FLA kernels if importable)
        worst_installed = max(worst_installed, (installed - ref).abs().max().item())
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
        n_pre = len(ids) - DECODE_STEPS
        per_prompt.append({"length": len(ids), "err_flare": err_flare, "err_transformers_bf16": err_ref,
                           "err_flare_prefill_rows": (got[:n_pre] - ref[:n_pre]).abs().max().item(),
                           "err_flare_decode_rows": (got[n_pre:] - ref[n_pre:]).abs().max().item(),
                           "argmax_agreement": same.float().mean().item(), "hard_flips": int(hard.sum())})
        worst_flare, worst_ref = max(worst_flare, err_flare), max(worst_ref, err_ref)
        agree += int(same.sum())
        total += same.numel()
        hard_flips += int(hard.sum())
    summary = {"bound": "max|flare - fp32| <= 2 * max|transformers_bf16 - fp32|", "err_flare": worst_flare,
               "err_transformers_bf16": worst_ref, "argmax_agreement": agree / total, "hard_flips": hard_flips,
               "err_transformers_bf16_as_installed": worst_installed, "prompts": per_prompt}
    record(results_dir, "qualification", {f"{model_name}-numerics": summary})
    measured_logit_error_path(model_name).write_text(json.dumps({"err_flare": worst_flare}))
    assert worst_flare <= 2 * worst_ref, summary
    assert hard_flips == 0, summary


def test_pages_released_out_of_the_window_change_no_bit_on_the_gpu(gpu_shape_core, results_dir):
    """A core whose every layer is windowed (``pages.kv_window``): a prompt past two windows,
    prefilled in chunks and decoded, with the page-table entries the scheduler gives back pointing
    at the null page before each chunk and step, gives the same hidden rows and logits, bit for
    bit, as with every page mapped (the compiled kernels skip or mask every key before a query's
    window)."""
    import pytest

    from flare.core.manifest import load_manifest

    model_name, core = gpu_shape_core
    m = load_manifest(core)
    window = m.pages.kv_window
    if window is None or 2 * window + 200 >= m.capacities.context_limit:
        pytest.skip("the core declares no window (or none a prompt past two of them fits)")
    ids = np.random.default_rng(1).integers(0, m.capacities.sampling_vocab, 2 * window + 200).tolist()
    kept, released = teacher_forced(core, [ids], DECODE_STEPS), teacher_forced(core, [ids], DECODE_STEPS, True)
    same = {k: bool(np.array_equal(kept[k], released[k])) for k in kept}
    record(results_dir, "qualification", {f"{model_name}-window-release": {"window": window, "length": len(ids),
                                                                           "bitwise_equal": same}})
    assert all(same.values()), same


def test_hybrid_triton_path_matches_the_reference_path_on_the_gpu(results_dir):
    """The hybrid's CUDA path (kernels/gdn.py, flash-linear-attention's chunk rule, the
    Triton paged attention) against its reference path (Transformers' torch rules),
    both eager on the GPU in float32 over one reference core's weights: prefill chunks
    of several lengths, then decode steps of a batch with a padded row. No compile, no
    graphs, no BF16: what differs is only the kernels. FLA's chunk rule computes its dot
    products in TF32, so the bound is TF32's, not FP32's."""
    import pytest
    import torch

    from tests.conftest import HYBRID_OPTS, prepare_core
    from tests.gpu.conftest import SHAPES
    from tests.rig import admit, decode, load_rig, prefill

    if "qwen3_5-small-shape" not in SHAPES:
        pytest.skip("the hybrid is not among this run's shapes")

    core = prepare_core("qwen3_5-small-shape", HYBRID_OPTS)
    rigs = {impl: load_rig(core, seed=3, attention=impl, device="cuda") for impl in ("reference", "triton")}
    rng = np.random.default_rng(5)
    prompts = {1: rng.integers(100, 40000, 3).tolist(), 2: rng.integers(100, 40000, 40).tolist(),
               4: rng.integers(100, 40000, 300).tolist()}
    forced = [rng.integers(100, 40000, 3).tolist() for _ in range(4)]
    logits = {}
    for impl, r in rigs.items():
        rows = []
        for slot, p in prompts.items():
            admit(r, slot, p, r.pages(32), seed=slot)
            rows.append(prefill(r, slot, p, splits=(5, 21))[1][None])
        for tokens in forced:
            rows.append(decode(r, [1, 2, 4], tokens)[0])
        logits[impl] = torch.cat(rows).float()
    err = (logits["triton"] - logits["reference"]).abs().max().item()
    scale = logits["reference"].abs().max().item()
    record(results_dir, "qualification", {"qwen3_5-small-shape-triton-vs-reference-fp32": {
        "max_abs_err": err, "logit_scale": scale}})
    assert err <= 5e-3 * scale, (err, scale)


def test_routed_experts_match_transformers(gpu_shape_core, results_dir):
    """Routing as the captured programs compute it (``kernels/moe.py``: ``route_rows``, one
    token per program in every program, over BF16 router logits from ``invariant_linear``)
    against Transformers' FP32 router, on the same rows:
    the FP32 model's own router inputs at every sparse layer (hooks on each ``gate``),
    rounded to BF16 for Flare. The programs expose no expert ids, so the routing kernels run
    here on those rows. A row's BF16 error is err = max |p_bf16 - p_fp32| over its experts
    (softmax probabilities), so swapping an expert in its top k for one outside needs
    FP32's margin between the k-th and (k+1)-th <= 2 * err: wherever the margin exceeds
    that, the routed set must be FP32's. On random weights many rows are near ties, the more
    so the more experts: on the H200, 484 of 1,220 rows were eligible with 128 experts (the
    Qwen3-30B-A3B geometry), 93 of 610 with 256 (Qwen3.5-35B-A3B) and 34 of 610 with 512
    (Qwen3-Next; bench/results/qualification-2026-12-03-moe-shapes.json). So the rows include
    a 1,000-token prompt, and the check must bite on at least 100 rows."""
    import pytest
    import torch

    from flare.core.manifest import load_manifest
    from flare.prepare.kernels import moe as K

    model_name, core = gpu_shape_core
    if "num_experts" not in load_manifest(core).reference.config:
        pytest.skip(f"{model_name} routes no experts")
    hf32, _ = _hf_model(core, torch.float32)
    gates = [m for n, m in hf32.named_modules() if n.endswith("mlp.gate") and hasattr(m, "top_k")]
    seen: list = []
    hooks = [g.register_forward_pre_hook(lambda mod, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
             for g in gates]
    rng = np.random.default_rng(1)
    checked = eligible = mismatched = 0
    per_layer = []
    try:
        for n in (1, 4, 300, 1000):
            x = torch.tensor([rng.integers(0, 30000, n).tolist()], device="cuda")
            seen.clear()
            with torch.no_grad():
                hf32(x)
            for layer, (g, h) in enumerate(zip(gates, seen)):
                k, renorm = g.top_k, getattr(g, "norm_topk_prob", True)
                p32 = torch.softmax(torch.nn.functional.linear(h, g.weight), -1)
                logits16 = K.invariant_linear(h.bfloat16(), g.weight.bfloat16())  # as _routed computes them
                err_rows = (torch.softmax(logits16.float(), -1) - p32).abs().amax(-1)
                err = err_rows.max().item()
                top = p32.topk(k + 1, -1)
                margin = top.values[:, k - 1] - top.values[:, k]
                _, ids = K.route_rows(logits16, k, renorm)
                same = (ids.sort(-1).values == top.indices[:, :k].sort(-1).values).all(-1)
                ok = margin > 2 * err_rows
                checked += same.numel()
                eligible += int(ok.sum())
                mismatched += int((ok & ~same).sum())
                per_layer.append({"tokens": n, "layer": layer, "err_bf16_scores": err, "eligible": int(ok.sum()),
                                  "equal_sets": int(same.sum()), "mismatched_eligible": int((ok & ~same).sum())})
    finally:
        for hook in hooks:
            hook.remove()
    summary = {"rows": checked, "eligible_rows": eligible, "mismatched_eligible_rows": mismatched,
               "per_layer": per_layer}
    record(results_dir, "qualification", {f"{model_name}-routed-experts": summary})
    assert eligible >= 100, summary  # the check bites on enough rows
    assert mismatched == 0, summary
