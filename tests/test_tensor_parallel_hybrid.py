"""Tensor parallelism of the hybrid recipes on the CPU reference path (docs/tensor-parallel.md):
Qwen3.5 (Gated DeltaNet + gated attention + dense MLP), Qwen3.5-MoE and Qwen3-Next (the same
mixers, routed experts with a gated shared expert). A TP=2 core, driven by the runtime
executor (two rank workers over gloo) with the writes the scheduler stages, against the TP=1
core of the same options, teacher-forced, then greedy.

Each rank holds half of every Gated DeltaNet's key and value heads (its q | k | v projection
and convolution cut block by block, z, b, a, A_log and dt_bias by value heads, the output
projection row-parallel), half the attention heads, half the experts and half the shared
expert's intermediate rows; its recurrent and convolution state rows are half as wide.

Bound: test_tensor_parallel.py's, |tp2 - tp1| <= 6 * err32 (+ 1e-6), where err32 is the
float32 rounding of Transformers' model on these sequences against its float64 twin (with the
float64 delta rule and norms of test_qwen3_5.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from flare.core.manifest import load_manifest, rank_images
from tests.conftest import HYBRID_OPTS, prepare_core
from tests.rig import transformers_model
from tests.test_qwen3_5 import float64_islands
from tests.test_tensor_parallel import FORCED_STEPS, _drive, _prompts

# config -> (Transformers module, its class prefix): for the float64 delta rule and norms.
# (qwen3_5-tiny is not among them: its Gated DeltaNet geometry, one key head a rank, is
# qwen3_5-moe-tiny's, and its dense MLP is qwen3_5-tiny-wide's.)
FAMILIES = {"qwen3_5-moe-tiny": ("qwen3_5_moe", "Qwen3_5Moe"), "qwen3-next-tiny": ("qwen3_next", "Qwen3Next"),
            # 4 key heads of 16, 8 value heads of 32: two key heads a rank, unequal widths
            "qwen3_5-tiny-wide": ("qwen3_5", "Qwen3_5")}
# The TP driver decodes its prompts in fresh slots after the teacher-forced ones: 8 slots.
OPTS = [*HYBRID_OPTS, "--decode-capacities", "1,2,4,8"]


def _conv_rank(full: np.ndarray, t, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s rows of a q | k | v convolution weight: its slice of each block."""
    key, value = t.linear_num_key_heads * t.linear_key_head_dim, t.linear_num_value_heads * t.linear_value_head_dim
    out, start = [], 0
    for block in (key, key, value):
        n = block // size
        out.append(full[start + rank * n : start + (rank + 1) * n])
        start += block
    return np.concatenate(out)


@pytest.mark.parametrize("model", sorted(FAMILIES))
def test_tp2_hybrid_matches_tp1(model):
    from flare.prepare.recipes import by_name

    tp1, tp2 = prepare_core(model, OPTS), prepare_core(model, [*OPTS, "--tp", "2"])
    m1, m2 = load_manifest(tp1), load_manifest(tp2)
    t = by_name(m1.reference.recipe).config_from_json(m1.reference.config).get_text_config()
    whole = load_file(str(tp1 / m1.arena.image))
    ranks = [load_file(str(p)) for p in rank_images(tp2, m2)]
    gdn = "w.model.layers.0.linear_attn."
    for r, image in enumerate(ranks):
        assert np.array_equal(image[gdn + "conv1d.weight"], _conv_rank(whole[gdn + "conv1d.weight"], t, r, 2))
        assert image[gdn + "A_log"].shape == (t.linear_num_value_heads // 2,)
    shapes = {b.name: b.shape for b in m2.buffers}
    assert shapes["state.gdn.recurrent"][2] == t.linear_num_value_heads // 2  # [rows, layers, Hv / 2, Dk, Dv]
    assert shapes["kv"][4] == t.num_key_value_heads // 2
    if "moe" in model or "next" in model:
        mlp = "w.model.layers.0.mlp."
        assert ranks[0][mlp + "experts.gate_up_proj"].shape[0] == t.num_experts // 2
        assert ranks[0][mlp + "gate.weight"].shape[0] == t.num_experts  # the router sees every expert
        assert ranks[0][mlp + "shared_expert.gate_up_proj.weight"].shape[0] == t.shared_expert_intermediate_size

    prompts = _prompts(m1.capacities.sampling_vocab)
    rng = np.random.default_rng(8)
    forced = [rng.integers(3, m1.capacities.sampling_vocab, FORCED_STEPS).tolist() for _ in prompts]
    r1, r2 = asyncio.run(_drive(tp1, prompts, forced)), asyncio.run(_drive(tp2, prompts, forced))
    hf32, hf64 = (transformers_model(tp1, m1, dtype) for dtype in (torch.float32, torch.float64))
    err32 = 0.0
    with torch.inference_mode(), float64_islands(hf64, *FAMILIES[model]):
        for p, f in zip(prompts, forced):
            x = torch.tensor([p + f])
            err32 = max(err32, float((hf32(input_ids=x).logits[0].double() - hf64(input_ids=x).logits[0]).abs().max()))
    bound = 6 * err32 + 1e-6
    pairs = list(zip(r1["prefill_logits"], r2["prefill_logits"])) + list(zip(r1["decode_logits"], r2["decode_logits"]))
    worst = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in pairs)
    print(f"\n{model} TP=2 vs TP=1: err32 {err32:.3g}, bound {bound:.3g}, max {worst:.3g}")
    assert 0 < worst <= bound  # not zero: the ranks really split the sums
    assert r1["greedy"] == r2["greedy"]


def test_a_block_shard_takes_each_blocks_slice():
    """``Shard.blocks``: rank r's rows of a q | k | v weight are its slice of q, of k and of v."""
    from flare.prepare.parallel import Shard, ShardingError

    full = torch.arange(20).reshape(10, 2)  # blocks of 4, 4 and 2 rows
    assert Shard(0, 1, 2, (4, 4, 2)).of(full)[:, 0].tolist() == [4, 6, 12, 14, 18]
    assert Shard(0, 0, 2, (4, 4, 2)).of(full)[:, 0].tolist() == [0, 2, 8, 10, 16]
    assert Shard(0, 1, 2).of(full)[:, 0].tolist() == [10, 12, 14, 16, 18]  # one block: contiguous
    with pytest.raises(ShardingError, match="do not cut"):
        Shard(0, 0, 2, (4, 3, 3)).of(full)


def test_every_gated_deltanet_weight_is_declared_as_the_forward_reads_it():
    """The shard of each Gated DeltaNet weight of a TP=2 rank, from the recipe's tables: q|k|v
    projection and convolution by q, k and v blocks, z / b / a / A_log / dt_bias by value heads
    (contiguous), the output projection by input columns, the gated norm replicated. (The random
    source fills A_log and dt_bias with zeros, so the end-to-end test cannot see their slices.)"""
    from flare.prepare.parallel import Shard, TensorParallel
    from flare.prepare.recipes import by_name
    from flare.prepare.sources import resolve

    from flare.prepare.recipes.mtp import without_mtp

    config = resolve("qwen3_5-tiny-wide").config
    without_mtp(config)  # as preparation without --mtp
    t = config.get_text_config()
    recipe = by_name("qwen3_5")
    pm = recipe.build(config, torch.float32, tp=TensorParallel(1, 2))
    specs = {s.names[0].removeprefix("model.layers.0.linear_attn."): s for s in recipe.weights(pm)
             if s.names[0].startswith("model.layers.0.linear_attn.")}
    key, value = t.linear_num_key_heads * t.linear_key_head_dim, t.linear_num_value_heads * t.linear_value_head_dim
    assert (key, value) == (64, 256)
    by_value_heads = Shard(0, 1, 2)
    assert specs["A_log"].shard == specs["dt_bias"].shard == by_value_heads
    assert specs["conv1d.weight"].shard == Shard(0, 1, 2, (key, key, value))
    assert specs["out_proj.weight"].shard == Shard(1, 1, 2)
    assert specs["norm.weight"].shard is None
    parts = {p.name.rsplit(".", 2)[-2]: p for p in specs["in_proj.weight"].parts}
    assert parts["in_proj_qkv"].shard == Shard(0, 1, 2, (key, key, value)) and parts["in_proj_qkv"].rows == key + value // 2
    assert all(parts[n].shard == by_value_heads for n in ("in_proj_z", "in_proj_b", "in_proj_a"))
    gdn = pm.module.model.layers[0].linear_attn
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.key_dim, gdn.value_dim) == (2, 4, 32, 128)
    assert gdn.conv_dim == 2 * 32 + 128
