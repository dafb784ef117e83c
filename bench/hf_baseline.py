"""The baseline in the same run: Transformers generate with a static cache and
torch.compile, on the core's own weights (BF16), same sampling.

usage: python -m bench.hf_baseline CORE OUT.json [--batches 1,2,4] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def load(core: str):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from flare.core.manifest import load_manifest
    from flare.prepare.recipes import by_name

    m = load_manifest(core)
    recipe = by_name(m.reference.recipe)
    config = recipe.config_from_json(m.reference.config)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = recipe.checkpoint_state(m.reference.config, load_file(f"{core}/{m.arena.image}", device="cuda"))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or any("lm_head" not in k for k in missing):
        raise RuntimeError(f"the core's weights do not fill the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(model.model.config, device="cuda")
    return model.eval(), m


def _measure(model, b: int, tokens: int) -> dict:
    ids = torch.randint(1000, 30000, (b, 32), device="cuda")
    kw = dict(do_sample=True, temperature=1.0, top_k=20, top_p=0.95, pad_token_id=0)
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)  # compile + warm up
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    new = out.shape[1] - ids.shape[1]
    return {"total_s": total, "prefill_s": prefill, "new_tokens": new,
            "decode_tokens_per_s": b * (new - 1) / (total - prefill), "itl_s": (total - prefill) / (new - 1)}


def main(a) -> None:
    model, m = load(a.core)
    # Static cache: generate() compiles the forward itself (CompileConfig, CUDA graphs),
    # the path Transformers documents as its fastest for single-stream decode. A model
    # whose static cache or compiled forward fails there runs its default cache, eager
    # (its own fastest kernels, e.g. flash-linear-attention's, still apply); the mode
    # that ran is recorded.
    results = {"core": a.core, "torch": torch.__version__, "tokens": a.tokens, "batches": {}, "modes": {}}
    for b in a.batches:
        for mode in ("static-compiled", "default-eager"):
            model.generation_config.cache_implementation = "static" if mode == "static-compiled" else None
            model.generation_config.disable_compile = mode == "default-eager"
            try:
                results["batches"][b] = _measure(model, b, a.tokens)
                results["modes"][b] = mode
                break
            except Exception as e:  # recorded, then the next mode
                results.setdefault("failures", []).append({"batch": b, "mode": mode, "error": repr(e)[:2000]})
                print(f"batch {b}: {mode} failed: {e!r}"[:2000], flush=True)
                torch._dynamo.reset()
        print(b, results["modes"].get(b), results["batches"].get(b), flush=True)
        json.dump(results, open(a.out, "w"), indent=1)  # what finished, should a later batch time out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("core")
    p.add_argument("out")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    main(p.parse_args())
