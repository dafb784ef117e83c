"""The Gated DeltaNet, mixture-of-experts, GEMM and paged-attention kernels compile for the H200 (sm_90) here,
without a GPU.

Triton's CPU interpreter (which runs the kernels' numerical tests) executes the
kernel source as Python and accepts code the real compiler rejects: a name
whose type differs between an ``if`` block and the code before it compiled in
the interpreter and failed on the H200. This test runs the real front end and
ptxas (Triton ships ptxas) for every kernel of ``kernels/gdn.py``, ``gdn_grid.py``,
``gemm.py``, ``gemv.py``, ``rownorm.py``, ``moe.py``, ``paged_attention.py``,
``kv_write.py`` and ``sampler.py`` at the dtypes and block shapes the recipe launches,
so such an error fails CI instead of a device call. It runs
in a subprocess: the interpreter switch of the test session would otherwise stand in for
the compiler.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is not installed")

SCRIPT = textwrap.dedent(r'''
    import collections
    import re

    import triton

    from flare.prepare.kernels import gdn as K
    from flare.prepare.kernels import gdn_grid as GG
    from flare.prepare.kernels import gemm as G
    from flare.prepare.kernels import gemv as GV
    from flare.prepare.kernels import moe as M
    from flare.prepare.kernels import paged_attention as A
    from flare.prepare.kernels import rownorm as RN
    from flare.prepare.kernels import sampler as SK
    from flare.prepare.kernels import sm90

    def compile_for_sm90(fn, types, constexprs, num_warps=4, num_stages=3, aligned=()):
        kernel = sm90.compile_for_sm90(fn, types, constexprs, num_warps, num_stages, aligned)
        print("compiled", fn.__name__)
        return kernel

    def ex2_feeds(ptx):
        """What instruction computes each ex2's operand, counted."""
        defs, fed = {}, collections.Counter()
        for line in ptx.splitlines():
            m = re.match(r"\s*([a-z0-9.]+)\s+(%\w+),", line)
            if m:
                defs[m.group(2)] = m.group(1)
            if "ex2.approx" in line:
                fed[defs.get(re.findall(r"%\w+", line)[1], "?")] += 1
        return dict(fed)

    bf16 = lambda *names: {n: "*bf16" for n in names}
    f32 = lambda *names: {n: "*fp32" for n in names}
    # The recipe's dtypes: bf16 activations and parameters, an fp32 state, int64 slots,
    # bool live masks, an int32 count.
    compile_for_sm90(K._decode_step_kernel,
                     {**bf16("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "a_log_ptr", "dt_bias_ptr", "out_ptr"),
                      **f32("state_ptr"), "slots_ptr": "*i64", "live_ptr": "*i1", "scale": "fp32"},
                     dict(GROUP=2, DK=128, DV=128, BK=128, BV=32, EPS=1e-6))
    compile_for_sm90(K._prefill_recurrent_kernel,
                     {**bf16("q_ptr", "k_ptr", "v_ptr", "beta_ptr", "out_ptr"), **f32("g_ptr", "state_ptr"),
                      "slot_ptr": "*i64", "count_ptr": "*i32", "scale": "fp32"},
                     dict(GROUP=2, DK=128, DV=128, BK=128, BV=16, EPS=1e-6), num_warps=1)
    compile_for_sm90(K._gated_norm_kernel, {**bf16("x_ptr", "z_ptr", "w_ptr", "out_ptr"), "eps": "fp32"},
                     dict(BLOCK=128), num_warps=1)
    compile_for_sm90(K._conv_step_kernel,
                     {**bf16("x_ptr", "state_ptr", "w_ptr", "bias_ptr", "out_ptr"), "slots_ptr": "*i64",
                      "live_ptr": "*i1"}, dict(W=4, HAS_BIAS=False, BLOCK_C=256))
    compile_for_sm90(K._conv_chunk_kernel,
                     {**bf16("x_ptr", "state_ptr", "w_ptr", "bias_ptr", "out_ptr"), "slot_ptr": "*i64",
                      "count_ptr": "*i32"}, dict(W=4, HAS_BIAS=False, BLOCK_T=32, BLOCK_C=128))
    for gate_up in (True, False):
        compile_for_sm90(M._grouped_kernel,
                         {**bf16("a_ptr", "w_ptr", "out_ptr"), "order_ptr": "*i32", "tile_expert_ptr": "*i32",
                          "tile_start_ptr": "*i32", "tile_end_ptr": "*i32"},
                         dict(GATE_UP=gate_up, BM=16, BN=64, BK=64, PRECISION="tf32"))
    # routing in its launch or not; the add and post-attention norm in the loads (NORM: 1 Qwen3.5's, 2 Qwen3's)
    for bn, has_s, route, norm in ((4, True, True, 0), (8, False, False, 0), (2, False, True, 0), (1, True, True, 1),
                                   (1, False, True, 2)):
        compile_for_sm90(M._router_gemv_kernel,
                         {**bf16("x_ptr", "w_ptr", "s_ptr", "out_ptr", "g_ptr", "r_ptr", "nw_ptr", "t_ptr"),
                          "valid_ptr": "*i1", "rw_ptr": "*fp32", "ids_ptr": "*i64", "count_ptr": "*i32", "eps": "fp32"},
                         dict(BN=bn, BK=512, HAS_S=has_s, ROUTE=route, TOPK=8, RENORM=True, BE=256, BKK=8, NORM=norm))
    # routing by ranks (ROUTE_RANKS): 256 experts, top 8
    compile_for_sm90(M._router_gemv_kernel,
                     {**bf16("x_ptr", "w_ptr", "s_ptr", "out_ptr", "g_ptr", "r_ptr", "nw_ptr", "t_ptr"),
                      "valid_ptr": "*i1", "rw_ptr": "*fp32", "ids_ptr": "*i64", "count_ptr": "*i32", "eps": "fp32"},
                     dict(BN=1, BK=512, HAS_S=True, ROUTE=True, TOPK=8, RENORM=True, BE=256, BKK=8, NORM=1, RANKS=True))
    # launched dependent (PDL: ``pdl``, griddepcontrol in the code): the router, gate/up and wide down kernels
    pdl = [compile_for_sm90(M._router_gemv_kernel,
                            {**bf16("x_ptr", "w_ptr", "s_ptr", "out_ptr", "g_ptr", "r_ptr", "nw_ptr", "t_ptr"),
                             "valid_ptr": "*i1", "rw_ptr": "*fp32", "ids_ptr": "*i64", "count_ptr": "*i32",
                             "eps": "fp32"},
                            dict(BN=1, BK=512, HAS_S=True, ROUTE=True, TOPK=8, RENORM=True, BE=256, BKK=8, NORM=1,
                                 PDL=True)),
           compile_for_sm90(M._decode_gate_up_kernel,
                            {**bf16("x_ptr", "w_ptr", "s_ptr", "out_ptr", "nw_ptr"), "ids_ptr": "*i64", "eps": "fp32"},
                            dict(BN=16, BK=512, NORM=2, PDL=True)),
           compile_for_sm90(M._decode_down_wide_kernel,
                            {**bf16("h_ptr", "w_ptr", "s_ptr", "g_ptr", "r_ptr", "out_ptr"), "ids_ptr": "*i64",
                             "weights_ptr": "*fp32"},
                            dict(TOPK=8, KP=8, BN=8, BK=128, SHARED=True, RESIDUAL=True, PDL=True), num_warps=4)]
    for kernel in pdl:
        ptx = kernel.asm["ptx"]
        before = ptx[: ptx.find("griddepcontrol.wait")]  # (the weight tiles the down kernel loads first)
        print("griddepcontrol", ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents"),
              "ld.global.cg", ptx.count("ld.global.cg"), "loads_before_wait", before.count("ld.global"))
    for norm in (0, 1, 2):
        compile_for_sm90(M._decode_gate_up_kernel,
                         {**bf16("x_ptr", "w_ptr", "s_ptr", "out_ptr", "nw_ptr"), "ids_ptr": "*i64", "eps": "fp32"},
                         dict(BN=16, BK=512, NORM=norm))
    compile_for_sm90(M._decode_down_kernel, {**bf16("h_ptr", "w_ptr", "out_ptr"), "ids_ptr": "*i64",
                                             "weights_ptr": "*fp32"}, dict(TOPK=8, BN=4, BK=512))
    # a gated shared expert or none, the residual added or not
    for topk, kp, shared, res in ((8, 8, True, False), (8, 8, False, True), (10, 16, True, True)):
        compile_for_sm90(M._decode_down_wide_kernel,
                         {**bf16("h_ptr", "w_ptr", "s_ptr", "g_ptr", "r_ptr", "out_ptr"), "ids_ptr": "*i64",
                          "weights_ptr": "*fp32"}, dict(TOPK=topk, KP=kp, BN=8, BK=128, SHARED=shared, RESIDUAL=res),
                         num_warps=8)
    # the masked loads, K whole steps, K and N whole tiles (four stages); the last two as a launch on
    # Llama-8B's weights specializes them (aligned pointers, sizes and strides): their loads pipelined,
    # a tile's shared memory for each stage
    aligned = ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "N", "K", "stride_xt", "stride_wn", "stride_ot")
    for bm, bn, bk, bias, even_k, even_n, stages in ((16, 16, 128, False, False, False, 3),
                                                      (16, 64, 128, True, False, False, 3),
                                                      (64, 128, 64, False, False, False, 3),
                                                      (64, 64, 64, False, True, False, 3),
                                                      (128, 128, 64, False, True, True, 4)):
        kernel = compile_for_sm90(G.nonsplit_kernel, bf16("x_ptr", "w_ptr", "b_ptr", "out_ptr"),
                                  dict(BM=bm, BN=bn, BK=bk, PRECISION="tf32", HAS_BIAS=bias, EVEN_K=even_k,
                                       EVEN_N=even_n), num_warps=8 if bm == 128 else 4, num_stages=stages,
                                  aligned=aligned if even_k else ())
        if even_k:
            assert kernel.metadata.shared >= stages * (bm + bn) * bk * 2, (bm, bn, bk, kernel.metadata.shared)
    compile_for_sm90(M._combine_kernel, {**bf16("y_ptr", "out_ptr"), "ids_ptr": "*i64", "weights_ptr": "*fp32"},
                     dict(TOPK=8, BN=512))
    # plan_triton: int64 expert ids (the routing's), the columns of 256 and of 512 experts and the sentinel
    compile_for_sm90(M._plan_count_kernel, {"ids_ptr": "*i64", "count_ptr": "*i32"}, dict(CH=1024))
    for be in (512, 1024):
        compile_for_sm90(M._plan_place_kernel,
                         {"ids_ptr": "*i64", "count_ptr": "*i32", "order_ptr": "*i32", "tile_expert_ptr": "*i32",
                          "tile_start_ptr": "*i32", "tile_end_ptr": "*i32"}, dict(BM=64, CH=1024, BE=be, TB=16))
    compile_for_sm90(M._route_plan_kernel,
                     {"logits_ptr": "*bf16", "valid_ptr": "*i1", "w_ptr": "*fp32", "ids_ptr": "*i64",
                      "order_ptr": "*i32", "tile_expert_ptr": "*i32", "tile_start_ptr": "*i32", "tile_end_ptr": "*i32"},
                     dict(K=8, RENORM=True, BM=16, BT=16, BE=512, BK=8, BP=128, MT=128, PLAN=True), num_warps=8)
    compile_for_sm90(M._route_plan_kernel,  # route_rows: one token per program, no plan
                     {"logits_ptr": "*bf16", "valid_ptr": "*i1", "w_ptr": "*fp32", "ids_ptr": "*i64",
                      "order_ptr": "*i64", "tile_expert_ptr": "*i64", "tile_start_ptr": "*i64", "tile_end_ptr": "*i64"},
                     dict(K=8, RENORM=True, BM=16, BT=1, BE=512, BK=8, BP=8, MT=1, PLAN=False), num_warps=4)
    compile_for_sm90(K._verify_conv_kernel,
                     {**bf16("x_ptr", "state_ptr", "w_ptr", "bias_ptr", "out_ptr", "steps_ptr"), "slots_ptr": "*i64",
                      "valid_ptr": "*i1"}, dict(W=4, HAS_BIAS=False, BLOCK_C=256))
    compile_for_sm90(K._verify_rule_kernel,
                     {**bf16("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "a_log_ptr", "dt_bias_ptr", "out_ptr"),
                      **f32("state_ptr", "steps_ptr"), "slots_ptr": "*i64", "valid_ptr": "*i1", "scale": "fp32"},
                     dict(GROUP=2, DK=128, DV=128, BK=128, BV=32, EPS=1e-6))
    compile_for_sm90(K._gates_kernel,
                     {**bf16("a_ptr", "b_ptr", "a_log_ptr", "dt_bias_ptr", "beta_ptr"), **f32("g_ptr"),
                      "count_ptr": "*i32"}, dict(BLOCK_T=32, BLOCK_H=32))
    for d, zc, page, norm in ((128, False, 0, True), (256, True, 0, True), (128, False, 16, True),
                              (256, True, 16, True), (128, False, 16, False)):
        # Qwen3's heads, Qwen3.5's; to tensors and (page > 0) with the keys and values to the pages;
        # Llama's (no norms) to the pages
        compile_for_sm90(RN._qk_norm_rotary_kernel,
                         {**bf16("q_ptr", "k_ptr", "v_ptr", "wq_ptr", "wk_ptr", "cos_ptr", "sin_ptr", "qo_ptr",
                                 "ko_ptr", "vo_ptr"), "slot_ptr": "*i64", "eps": "fp32"},
                         dict(D=d, ZERO_CENTRED=zc, PAGE=page, NORM=norm), num_warps=RN._warps(d))
    for block in (1024, 4096):  # hidden 576 .. 1,024 and 4,096 (8B); the norms pass float32 rows
        compile_for_sm90(RN._mean_square_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32"}, dict(BLOCK=block),
                         num_warps=RN._warps(block))
    for add, zero in ((True, True), (False, False)):  # a step's whole norm in one launch, bf16 rows
        compile_for_sm90(RN._rms_norm_kernel, {**bf16("x_ptr", "r_ptr", "w_ptr", "out_ptr", "sum_ptr"), "eps": "fp32"},
                         dict(BLOCK=4096, ADD=add, ZERO_CENTRED=zero), num_warps=RN._warps(4096))
    # The block grid's movement: the stash and rows in bf16, states fp32, int32 grid rows and
    # meta, the slot and start int64, an int32 count.
    grid = {"grid_ptr": "*i32", "slot_ptr": "*i64", "start_ptr": "*i64", "count_ptr": "*i32", "meta_ptr": "*i32"}
    compile_for_sm90(GG._grid_rows_kernel, {**bf16("rows_ptr", "stash_ptr", "seq_ptr"), **grid},
                     dict(BLOCK=64, BLOCK_T=16, BLOCK_C=256))
    compile_for_sm90(GG._grid_initial_kernel, {**f32("block_ptr", "rec_ptr", "out_ptr"), **grid}, dict(BLOCK_N=1024))
    compile_for_sm90(GG._grid_commit_kernel,
                     {**bf16("whole_ptr", "tail_ptr", "core_ptr", "seq_ptr", "stash_rows_ptr"),
                      **f32("final_ptr", "block_ptr", "rec_rows_ptr", "block_rows_ptr"), **grid},
                     dict(BLOCK=64, BLOCK_N=1024))
    # Paged attention: decode's even split (SEG 0) and prompt programs' segments (8B at 131K).
    attend = sm90.ATTEND_TYPES
    # As cores launch it (decode masked, prompt launches with the unmasked path for whole key
    # blocks, FULL_BLOCKS), a decode launch unmasked and a prompt launch masked (the flag set
    # either way), at a head dim the loads must mask (80 in 128), Qwen3.5's 256 (32-key
    # blocks), and 128- and 256-row prompt tiles of 8 warps (bench/attention_prefill.py's).
    # A decode launch folds its splits in its last program (FOLD, with a CUDA core's tickets), at 128
    # and at Qwen3.5's 256; decode launches give a split at least SPLIT_BLOCKS key blocks.
    for block_t, heads, splits, seg, nseg, rtiles, full, d, warps, fold in (
            (1, 16, 32, 0, 0, 0, False, 128, 4, False), (1, 16, 32, 0, 0, 0, True, 128, 4, False),
            (16, 4, 32, 16, 128, 3, True, 128, 4, False), (16, 4, 1, 16, 128, 1, True, 128, 4, False),
            (16, 4, 1, 16, 128, 1, False, 128, 4, False), (16, 4, 32, 16, 128, 3, True, 80, 4, False),
            (16, 4, 32, 16, 128, 3, True, 256, 4, False), (32, 4, 1, 16, 128, 1, True, 128, 8, False),
            (64, 4, 32, 16, 128, 3, True, 128, 8, False), (1, 16, 32, 0, 0, 0, False, 128, 4, True),
            (1, 16, 32, 0, 0, 0, False, 256, 4, True)):
        kernel = compile_for_sm90(A._attend_kernel, attend,
                                  dict(GROUP=4, HEADS=heads, BLOCK_T=block_t, PAGE=16, D=d,
                                       D_PAD=max(128, d), BLOCK_N=64 if d <= 128 else 32,
                                       SPLITS=splits, PRECISION="tf32", TILES_PAD=16, TARGET=264, SEG=seg, NSEG=nseg,
                                       RTILES=rtiles, FULL_BLOCKS=full, FOLD=fold,
                                       SPLITS_PAD=triton.next_power_of_2(splits),
                                       FOLD_CH=A.fold_splits(block_t * heads, max(128, d), splits),
                                       SPLIT_BLOCKS=A.SPLIT_BLOCKS if seg == 0 else 0),
                                  num_warps=warps, num_stages=2)
        print("ex2", ex2_feeds(kernel.asm["ptx"]))
    for seg, nseg in ((0, 0), (16, 128)):
        compile_for_sm90(A._combine_kernel, {**bf16("out_ptr"), **f32("part_acc", "part_m", "part_l"),
                                             "part_eff": "*i32", "valid": "*u8", "positions": "*i64"},
                         dict(SPLITS=32, SPLITS_PAD=32, D=128, D_PAD=128, SEG=seg, NSEG=nseg, BLOCK_N=64,
                              BLOCK_T=16, TILES_PAD=16, H_PAD=32 if seg else 1))  # (segments: a token's 32 heads)
    # The few-row GEMV at the step tilings (no split: no workspace), one and four rows, and
    # with the gated MLP's activation in its loads (and the residual add after it in its
    # epilogue) at the tilings that may take them.
    # The tensor-core tile (dot) has 16 rows at every count and keeps the activation apart.
    for t in G.STEP_GEMV_TILINGS:
        if t.bn < G.FOLD_MIN_BN:
            folds = ((False, False),)
        elif G.folds_swiglu(t):
            folds = ((False, False), (True, False), (True, True))
        else:
            folds = ((False, False), (False, True))
        for bm in (GV.DOT_ROWS,) if t.dot else (1, 4):
            for swiglu, residual in folds:
                compile_for_sm90(GV.gemv_kernel, {**bf16("x_ptr", "w_ptr", "out_ptr", "r_ptr"), **f32("part_ptr"),
                                                  "count_ptr": "*i32"},
                                 dict(BM=bm, BN=t.bn, BK=t.bk, KS=t.bk, SPLIT=t.split, DEFER=bool(t.defer),
                                      SWIGLU=swiglu, RESIDUAL=residual, ROWLOOP=bool(t.rowloop), DOT=bool(t.dot),
                                      PRECISION="tf32", TICKETS=False),
                                 num_warps=t.warps, num_stages=t.stages)
    # A core's split steps: the slices added by the last ticket's program (counters in the arena).
    for t in G.STEP_GEMV_TILINGS:
        for residual in (False, True) if t.split > 1 else ():
            compile_for_sm90(GV.gemv_kernel, {**bf16("x_ptr", "w_ptr", "out_ptr", "r_ptr"), **f32("part_ptr"),
                                              "count_ptr": "*i32"},
                             dict(BM=GV.DOT_ROWS, BN=t.bn, BK=t.bk, KS=t.bk, SPLIT=t.split, DEFER=False, SWIGLU=False,
                                  RESIDUAL=residual, ROWLOOP=False, DOT=True, PRECISION="tf32", TICKETS=True),
                             num_warps=t.warps, num_stages=t.stages)
    # A gated MLP's [gate; up] projection with the activation in the epilogue.
    for t in G.GLU_TILINGS:
        compile_for_sm90(GV.gemv_kernel, {**bf16("x_ptr", "w_ptr", "out_ptr", "r_ptr"), **f32("part_ptr"),
                                          "count_ptr": "*i32"},
                         dict(BM=GV.DOT_ROWS, BN=t.bn, BK=t.bk, KS=t.bk, SPLIT=1, DEFER=False, SWIGLU=False,
                              RESIDUAL=False, ROWLOOP=False, DOT=True, PRECISION="tf32", TICKETS=False, GLU=True),
                         num_warps=t.warps, num_stages=t.stages)
    # The norm before it (with the residual add, or without) in its loads: Qwen3.5's zero-centred
    # and Llama's forms; the input norm (no add) in every tensor-core tiling without a split, in both
    # forms, and with a Gated DeltaNet's convolution in the epilogue too.
    norm_types = {**bf16("x_ptr", "w_ptr", "out_ptr", "r_ptr", "nr_ptr", "nw_ptr", "nt_ptr", "c_ptr", "cw_ptr",
                         "cb_ptr"), **f32("part_ptr"), "count_ptr": "*i32", "eps": "fp32", "slots_ptr": "*i64",
                  "live_ptr": "*i1"}
    inputs = [t for t in G.STEP_GEMV_TILINGS if t.dot and t.split == 1]
    norm_cases = [(t, form, True, 0) for t in G.GLU_TILINGS for form in (1, 2)]
    norm_cases += [(t, form, False, 0) for t in inputs for form in (1, 2)]
    norm_cases += [(t, 1, False, 4) for t in inputs]
    # (and the input norm in the tensor-core tilings with a split: their sums of squares added by
    # the last ticket's program)
    norm_cases += [(t, form, False, 0) for t in G.STEP_GEMV_TILINGS if t.dot and t.split > 1 for form in (1, 2)]
    for t, form, add, width in norm_cases:
        compile_for_sm90(GV.gemv_kernel, {**norm_types, **f32("ss_ptr")},
                         dict(BM=GV.DOT_ROWS, BN=t.bn, BK=t.bk, KS=t.bk, SPLIT=t.split, DEFER=False, SWIGLU=False,
                              RESIDUAL=False, ROWLOOP=False, DOT=True, PRECISION="tf32", TICKETS=t.split > 1,
                              GLU=bool(t.glu), NORM=form, NORM_ADD=add, CONV_W=width, CONV_BIAS=False),
                         num_warps=t.warps, num_stages=t.stages)
    # A Gated DeltaNet's input projection with the decode step's convolution in the epilogue: every
    # tiling without a split (4 taps, no bias; the tensor-core tile at its 16 rows, the others at one
    # row), and --step-gemms gemv's tiling at eight rows and with other widths and a bias at four.
    conv_types = {**bf16("x_ptr", "w_ptr", "out_ptr", "r_ptr", "c_ptr", "cw_ptr", "cb_ptr"), **f32("part_ptr"),
                  "count_ptr": "*i32", "slots_ptr": "*i64", "live_ptr": "*i1"}
    conv_cases = [(t, GV.DOT_ROWS if t.dot else 1, 4, False) for t in G.STEP_GEMV_TILINGS if t.split == 1]
    conv_cases += [(G.FORCED_GEMV, 8, 4, False)]
    conv_cases += [(G.FORCED_GEMV, 4, w, bias) for w, bias in ((2, True), (3, False), (4, True))]
    for t, bm, width, bias in conv_cases:
        compile_for_sm90(GV.gemv_kernel, conv_types,
                         dict(BM=bm, BN=t.bn, BK=t.bk, KS=t.bk, SPLIT=1, DEFER=bool(t.defer), SWIGLU=False,
                              RESIDUAL=False, ROWLOOP=bool(t.rowloop), DOT=bool(t.dot), PRECISION="tf32",
                              TICKETS=False, CONV_W=width, CONV_BIAS=bias),
                         num_warps=t.warps, num_stages=t.stages)
    # A split's slices added by a second launch, with and without the residual.
    for residual in (False, True):
        compile_for_sm90(GV.sum_slices_kernel, {**bf16("out_ptr", "r_ptr"), **f32("part_ptr")},
                         dict(BM=GV.DOT_ROWS, SPLIT=4, BLOCK=GV.SUM_BLOCK, RESIDUAL=residual))
    # --step-gemms gemv's tiling at the other step row counts it serves (2 and 8 rows).
    t = G.FORCED_GEMV
    for bm in (2, 8):
        compile_for_sm90(GV.gemv_kernel, {**bf16("x_ptr", "w_ptr", "out_ptr", "r_ptr"), **f32("part_ptr"),
                                          "count_ptr": "*i32"},
                         dict(BM=bm, BN=t.bn, BK=t.bk, KS=t.bk, SPLIT=1, DEFER=bool(t.defer), SWIGLU=True,
                              RESIDUAL=True, ROWLOOP=bool(t.rowloop), DOT=False, PRECISION="tf32", TICKETS=False),
                         num_warps=t.warps)
    # The KV write of a program's rows (int64 slot mapping; 8 KV heads of 128, 16-token pages).
    from flare.prepare.kernels import kv_write as KW
    compile_for_sm90(KW._write_kv_kernel, {**bf16("k_ptr", "v_ptr", "k_cache", "v_cache"), "slot_mapping": "*i64",
                                           "pool_rows": "i64"}, dict(KVH=8, KVH_PAD=8, D=128, D_PAD=128, PAGE=16))
    # The sampler: the softmax before the sort, the draw after it, and the log-probability block (float32 logits,
    # 64-bit candidate keys; 20 values, a 248,320-token vocabulary's 61 blocks).
    for verify in (False, True):
        compile_for_sm90(SK._draw_sorted_kernel,
                         {**f32("sp_ptr", "top_p_ptr", "min_p_ptr", "u_ptr", "u_rej_ptr"), "si_ptr": "*i64",
                          "top_k_ptr": "*i32", "prop_ptr": "*i64", "tok_ptr": "*i64", "vtok_ptr": "*i64",
                          "acc_ptr": "*i8", "sums_ptr": "*fp32"},
                         dict(VERIFY=verify, BLOCK=2048, CHUNK=0 if verify else 8192, NCP=32), num_warps=8)
    compile_for_sm90(SK._softmax_part_kernel, f32("x_ptr", "m_ptr", "s_ptr"), dict(CHUNK=SK.SM_CHUNK), num_warps=8)
    compile_for_sm90(SK._softmax_norm_kernel, f32("x_ptr", "p_ptr", "m_ptr", "s_ptr"), dict(CHUNK=SK.SM_CHUNK, NCP=64),
                     num_warps=8)
    compile_for_sm90(SK._chunk_sums_kernel, {**f32("sp_ptr", "sums_ptr", "min_p_ptr"), "top_k_ptr": "*i32"},
                     dict(CHUNK=8192), num_warps=8)
    # (gated: a row's slot's flag, int32 state.logprobs_on, says whether it computes its block)
    lp = {**f32("x_ptr", "m_ptr", "s_ptr"), "key_ptr": "*u64", "slots_ptr": "*i64", "on_ptr": "*i32"}
    for gated in (False, True):
        compile_for_sm90(SK._logprob_part_kernel, lp, dict(N=20, NP=32, BLOCK=SK.LP_BLOCK, GATED=gated), num_warps=8)
        compile_for_sm90(SK._logprob_merge_kernel, {**lp, "tok_ptr": "*i64", "out_ptr": "*i32"},
                         dict(N=20, NP=32, NBP=64, GATED=gated))
    # the commit of a sampled token, as the state buffers' dtypes are
    compile_for_sm90(SK._commit_kernel, {"slots_ptr": "*i64", "live_ptr": "*u8", "tok_ptr": "*i64",
                                         "counter_ptr": "*i64", **{n: "*i32" for n in (
                                             "pending_ptr", "generated_ptr", "done_ptr", "hist_ptr", "stop_ptr",
                                             "max_new_ptr", "rec_ptr")}},
                     dict(NS_PAD=16, RUNNING=0, STOP=1, LENGTH=2, INACTIVE=-1), num_warps=1)
    compile_for_sm90(SK._commit_hidden_kernel, {"slots_ptr": "*i64", "live_ptr": "*u8", **bf16("hidden_ptr", "state_ptr"),
                                                "len_ptr": "*i32"}, dict(BLOCK=4096))
''')


def test_gdn_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == 198, proc.stdout
    # The dependent launches wait and let the next launch start, in every program; the down kernel reads the
    # router's ids through L2 before its wait (what a kernel before it in the chain wrote, not in L1).
    pdl = [line.split() for line in proc.stdout.splitlines() if line.startswith("griddepcontrol")]
    assert [(int(p[1]), int(p[2])) for p in pdl] == [(1, 1)] * 3, pdl
    assert int(pdl[2][4]) > 0 and int(pdl[1][4]) == 0, pdl
    # The gate/up and router wait first; the down kernel issues its ids' and first weight tiles' loads before.
    assert int(pdl[0][6]) == int(pdl[1][6]) == 0 and int(pdl[2][6]) > int(pdl[2][4]), pdl
    # The paged attention's unmasked key blocks (full_blocks) keep the masked blocks' bits on
    # the GPU only if the compiler does not fuse the scores' scaling multiply and the softmax's
    # subtraction into one FMA (without a select between them it does): every ex2 of every
    # attention launch above, with and without the flag, is fed by a subtraction.
    feeds = [ast.literal_eval(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ex2 ")]
    assert len(feeds) == 11, proc.stdout
    for fed in feeds:
        assert set(fed) == {"sub.f32"} and sum(fed.values()) > 0, fed
