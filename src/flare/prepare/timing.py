"""Timing work as a program pays it: inside a CUDA graph (CUDA only). Used where prepare
measures kernels to choose between them (``kernels/gemm.step_tiling``) and by the benchmarks
(``bench/graphs.py``)."""

from __future__ import annotations

import torch


def graph_ms(fn, per: int = 1, replays: int = 10) -> float:
    """Capture ``fn`` (run once before, outside the graph: compilation and warm-up) in a CUDA
    graph; the median of ``replays`` replays' GPU time (events), divided by ``per`` (the
    number of units of work ``fn`` does), in ms. A kernel timed alone between two events
    pays its launch; inside a graph of several it pays what a captured program pays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / per)
    del graph
    return sorted(times)[len(times) // 2]
