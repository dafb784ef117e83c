"""A decode step's sampling tail inside a CUDA graph: the tensor operations against the
sampler kernels (CUDA only).

The tail after ``lm_head``: scores (penalties, temperature), the filters and draw
(``sampling.choose``: softmax and sort, then ATen ops or ``kernels/sampler.draw_sorted``),
and the log-probability block (``sampling.logprob_block``: ATen's log_softmax and topk,
or ``kernels/sampler.logprob_block``); the kernels also with the draw's block walk alone
(``CHUNK_BLOCKS`` 0: no chunk sums), with ATen's softmax instead of ``softmax_rows``, and for
rows that ask for no log-probabilities (the block's kernels gated off). One CUDA graph holds
CALLS tails on rotating rows of random logits; its replay time over CALLS is a tail's time as a
program pays it, launches included. Sampling parameters: temperature 1.0, top-p 0.95, top-k 20 (the serving
benchmarks'), and no filter at all. The tokens and the log-probability ids of both ways are
compared (they may differ only where a draw falls within rounding of a boundary).

    python -m bench.sampler_tail OUT.json [--vocabs 49152,128256,151936,248320] [--rows 1,4]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch
import triton

from bench.graphs import graph_ms
from flare.prepare import sampling as S
from flare.prepare.kernels import sampler as SK

CALLS = 20
LOGPROBS = 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--vocabs", default="49152,128256,151936,248320")
    p.add_argument("--rows", default="1,4")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    meta = {"machine": platform.node(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": sys.version.split()[0], "calls_per_graph": CALLS,
            "logprobs": LOGPROBS, "timing": "CUDA graph of CALLS tails, median of 10 replays, per tail",
            "command": "python -m bench.sampler_tail " + " ".join(sys.argv[1:] if argv is None else argv)}
    results = {}
    for vocab in [int(v) for v in a.vocabs.split(",")]:
        for rows in [int(r) for r in a.rows.split(",")]:
            g = torch.Generator(device=dev).manual_seed(vocab + rows)
            logits = [torch.randn((rows, vocab), generator=g, device=dev) * 3 for _ in range(CALLS)]
            hist = torch.zeros((rows, vocab), dtype=torch.int32, device=dev)
            ones = torch.ones(rows, device=dev)
            zeros = torch.zeros(rows, device=dev)
            u = torch.rand(rows, generator=g, device=dev)
            entry = {}
            for label, top_k, top_p in (("top_p0.95_top_k20", 20, 0.95), ("unfiltered", 0, 1.0)):
                tk = torch.full((rows,), top_k, dtype=torch.int32, device=dev)
                tp = torch.full((rows,), top_p, device=dev)
                outs = {}

                def tail(kernel, keep, wants=None):
                    for i, lg in enumerate(logits):
                        x = S.scores(lg, hist, ones, ones, zeros, zeros, vocab)
                        tok = S.choose(x, tk, tp, zeros, u, kernel=kernel)
                        lp = S.logprob_block(lg, tok, LOGPROBS, vocab, kernel=kernel, wants=wants)
                        if keep:
                            outs.setdefault(kernel, []).append((tok, lp))

                tail(False, True)
                tail(True, True)
                same_tok = sum(torch.equal(t0, t1) for (t0, _), (t1, _) in zip(outs[False], outs[True]))
                same_ids = sum(torch.equal(l0[:, 1 + LOGPROBS:], l1[:, 1 + LOGPROBS:])
                               for (_, l0), (_, l1) in zip(outs[False], outs[True]))
                ops = graph_ms(lambda: tail(False, False), CALLS)
                ker = graph_ms(lambda: tail(True, False), CALLS)
                chunks, SK.CHUNK_BLOCKS = SK.CHUNK_BLOCKS, 0  # the draw's block walk without chunk sums
                try:
                    walk = graph_ms(lambda: tail(True, False), CALLS)
                finally:
                    SK.CHUNK_BLOCKS = chunks
                split, SK.softmax_rows = SK.softmax_rows, lambda x, chunk=0: torch.softmax(x, dim=-1)
                try:  # the kernels with ATen's one-block softmax before the sort
                    aten_sm = graph_ms(lambda: tail(True, False), CALLS)
                finally:
                    SK.softmax_rows = split
                # rows whose slots ask for no log-probabilities (state.logprobs_on 0: the block's kernels skip them)
                off = (torch.arange(rows, device=dev), torch.zeros(rows, dtype=torch.int32, device=dev))
                no_lp = graph_ms(lambda: tail(True, False, off), CALLS)
                entry[label] = {"ops_ms": ops, "kernel_ms": ker, "kernel_over_ops": ker / ops,
                                "kernel_block_walk_ms": walk, "kernel_aten_softmax_ms": aten_sm,
                                "kernel_no_logprobs_ms": no_lp,
                                "same_tokens": f"{same_tok}/{CALLS}", "same_logprob_ids": f"{same_ids}/{CALLS}"}
                print(f"vocab {vocab} rows {rows} {label}: ops {ops * 1e3:.1f} us, kernel {ker * 1e3:.1f} us "
                      f"(block walk {walk * 1e3:.1f}, ATen softmax {aten_sm * 1e3:.1f}, no log-probabilities "
                      f"{no_lp * 1e3:.1f}), tokens {same_tok}/{CALLS}, ids {same_ids}/{CALLS}", flush=True)
            results[f"{vocab}@{rows}"] = entry
            json.dump({"meta": meta, "results": results}, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
