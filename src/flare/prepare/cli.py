"""``flare-prepare MODEL --out DIR``: prepare a runtime core in a subprocess."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from flare.core import interface as io
from flare.zygote import worker_command


def _capacities(text: str) -> list[int]:
    try:
        caps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not caps:
        raise argparse.ArgumentTypeError("at least one capacity is required")
    return caps


def _gpu_count() -> int:
    """The GPUs the driver shows this process; 0 without a driver or bindings."""
    try:
        from cuda.bindings import driver

        if driver.cuInit(0)[0] == driver.CUresult.CUDA_SUCCESS:
            err, n = driver.cuDeviceGetCount()
            if err == driver.CUresult.CUDA_SUCCESS:
                return int(n)
    except Exception:  # no driver, no bindings: a CPU machine
        pass
    return 0


def _default_device() -> str:
    return "cuda" if _gpu_count() > 0 else "cpu"


def _visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    return [str(i) for i in range(_gpu_count())]


def _sampling(text: str) -> dict[str, float]:
    from flare.core.sampling_params import SAMPLING_PARAMS

    types = {p.name: p.type for p in SAMPLING_PARAMS}
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name.strip() not in types:
            raise argparse.ArgumentTypeError(f"{item!r}: expected NAME=VALUE with NAME one of {', '.join(types)}")
        try:
            out[name.strip()] = types[name.strip()](value)
        except ValueError:
            kind = "an integer" if types[name.strip()] is int else "a number"
            raise argparse.ArgumentTypeError(f"{item!r}: {value!r} is not {kind}") from None
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flare-prepare", description=__doc__)
    p.add_argument("model", help="config name from configs/, a Hugging Face directory, or a .gguf file")
    p.add_argument("--out", required=True, help="directory to write the runtime core into")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weight/activation dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--prefill-chunk-size", type=int, default=None,
                   help="largest prefill chunk, a multiple of 64 (default 512 on cpu, 2048 on cuda)")
    p.add_argument("--decode-capacities", type=_capacities, default=[1, 2, 4],
                   help="comma-separated decode batch capacities (default 1,2,4)")
    p.add_argument("--context-limit", type=int, default=None, help="longest request, tokens")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (power of two)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-pages", type=int, default=None, help="number of KV pages")
    kv.add_argument("--kv-memory", type=float, default=None, help="KV page budget in GiB")
    p.add_argument("--snapshot-rows", type=int, default=None,
                   help="prefix-cache checkpoint rows (default: 4 per request slot; 0 disables the cache)")
    p.add_argument("--min-prefill-capacity", type=int, choices=(16, 32, 64, 128), default=128,
                   help="smallest prefill program: 16, 32 or 64 add programs so that a short prompt (a chat turn, "
                        "a tool result) does not pay a 128-token prefill (default 128)")
    p.add_argument("--pack-capacities", type=_capacities, default=(), metavar="ROWS,...",
                   help="add pack programs of these row counts (multiples of 16, at most the prefill chunk): "
                        "the prefill chunks of several queued prompts run in one program instead of one each, "
                        "and decode steps carry a prompt's chunk while it prefills (default: none; models "
                        "with recurrent state cannot pack)")
    p.add_argument("--draft-tokens", type=int, default=0, metavar="D",
                   help="add verify programs (one per decode capacity up to 16) that check up to D draft tokens "
                        "per request in one step, for speculative decoding (default 0: none; at most "
                        f"{io.MAX_DRAFT_TOKENS}; a model with recurrent state keeps its state after every verified "
                        f"position, D + 1 rows of it per verified request)")
    p.add_argument("--mtp", action="store_true",
                   help="keep the checkpoint's multi-token-prediction head (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): "
                        "its KV is kept by every program and each verify program ends with D learned drafts for "
                        "the next step (flare-serve --speculative mtp); needs --draft-tokens (default: the head is "
                        "left out)")
    p.add_argument("--max-logprobs", type=int, default=io.MAX_LOGPROBS,
                   help=f"top log-probabilities the sampling programs return per token (default {io.MAX_LOGPROBS}, "
                        f"OpenAI's limit; 0: requests for log-probabilities are refused)")
    p.add_argument("--attention", choices=("reference", "gather", "triton"), default=None)
    p.add_argument("--sampler", choices=("ops", "kernel"), default="kernel",
                   help="CUDA: the sampler's filters and draw after the sort, and the log-probability block, in "
                        "Triton kernels (kernel, the default: one program a row for the draw, two for the block) "
                        "or as tensor operations (ops: some 65 kernels a step)")
    p.add_argument("--no-compile", action="store_true", help="capture without torch.compile (development)")
    p.add_argument("--combo-kernels", action="store_true",
                   help="CUDA: let Inductor launch independent kernels as one (combo kernels) in everything the "
                        "preparation compiles: fewer launches a decode step; not yet measured on the GPU")
    p.add_argument("--split-prompt-gemms", action="store_true",
                   help="CUDA: let prompt programs use cuBLAS's split-K GEMMs where it picks them for few rows, "
                        "and Inductor's norm reductions (faster short prefills, but a prompt prefilled in pieces, "
                        "as with the prefix cache, may then generate other tokens than the same prompt prefilled "
                        "whole)")
    p.add_argument("--prompt-gemms", choices=("default", "measure"), default="default",
                   help="CUDA: where prompt programs take the unsplit Triton GEMM (layers cuBLAS splits at their row "
                        "count), its fixed tiling (default) or the fastest of several timed at preparation for each "
                        "layer shape and row count (measure: the same bits; not yet measured on the GPU)")
    p.add_argument("--step-gemms", choices=("cublas", "measure", "gemv"), default="cublas",
                   help="CUDA: decode and verify steps' linear layers on cuBLAS, or on the unsplit Triton GEMM or "
                        "(no bias) the few-row GEMV where one times faster at preparation (no split-K reduce "
                        "kernels), one product a layer for every step row count (so a row's bits in the decoder's "
                        "linear layers do not depend on its batch; it may then be slower than cuBLAS where cuBLAS's "
                        "own rows differ between counts); 'gemv': every layer without a bias on the GEMV at every step "
                        "row count (at most 8), "
                        "untimed (the folds it carries, exercised on small shapes whatever times faster)")
    p.add_argument("--step-norms", choices=("compiled", "invariant"), default="compiled",
                   help="CUDA: decode and verify steps' RMS norms as Inductor compiles them (its reduction's blocks "
                        "and warps picked per program, by the row count and by timing, so a row's bits may depend on "
                        "its batch), or row-invariant: each norm one launch, one program a row, with the residual add "
                        "before a layer's post-attention norm in it where the layer's forward has Transformers' shape; with --step-gemms measure or gemv, the norms' share of a decode row's dependence on "
                        "its batch removed (lm_head and the decode attention's even split remain)")
    p.add_argument("--dependent-launch", choices=("off", "on"), default="off",
                   help="CUDA, compute capability 9.0 or later: decode steps' mixture-of-experts kernels (the router "
                        "and the two expert launches) launched dependent (programmatic dependent launch: each starts "
                        "while the one before runs and waits for it in the kernel; the down launch loads its first "
                        "weight tiles before it waits); the same bits")
    p.add_argument("--scratch-memory", type=float, default=None,
                   help="CUDA: GiB of arena for torch's pool during preparation (only the used part is kept; "
                        "default: 6 or a fifth of the weights, whichever is larger)")
    p.add_argument("--gpu-reserve", type=float, default=4.0,
                   help="CUDA: GiB of device memory left free when sizing KV pages from free memory")
    p.add_argument("--qualify", type=int, default=0,
                   help="record N golden replays per program for replay qualification (flare.runtime.replay_check)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: one preparation process per rank (CPU reference path; "
                        "see docs/tensor-parallel.md)")
    p.add_argument("--served-name", default=None, help="model id the server reports (default: config or dir name)")
    p.add_argument("--sampling", type=_sampling, action="append", default=[],
                   help="sampling defaults over the model's, e.g. temperature=0.6,top_p=0.95 (default: a named "
                        "config's [sampling], else the checkpoint's generation_config.json, else neutral)")
    return p


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    a = parser().parse_args(argv)
    args = {
        "model": a.model,
        "out": a.out,
        "device": a.device or _default_device(),
        "dtype": a.dtype,
        "prefill_chunk_size": a.prefill_chunk_size,
        "decode_capacities": a.decode_capacities,
        "context_limit": a.context_limit,
        "page_size": a.page_size,
        "kv_pages": a.kv_pages,
        "kv_memory_gib": a.kv_memory,
        "snapshot_rows": a.snapshot_rows,
        "max_logprobs": a.max_logprobs,
        "min_prefill_capacity": a.min_prefill_capacity,
        "pack_capacities": a.pack_capacities,
        "draft_tokens": a.draft_tokens,
        "mtp": a.mtp,
        "attention": a.attention,
        "sampler": a.sampler,
        "compile": not a.no_compile,
        "combo_kernels": a.combo_kernels,
        "split_prompt_gemms": a.split_prompt_gemms,
        "step_gemms": a.step_gemms,
        "prompt_gemms": a.prompt_gemms,
        "step_norms": a.step_norms,
        "dependent_launch": a.dependent_launch,
        "served_name": a.served_name,
        "scratch_memory_gib": a.scratch_memory,
        "reserve_gib": a.gpu_reserve,
        "qualify": a.qualify,
        "tp_size": a.tp,
        "sampling": {k: v for d in a.sampling for k, v in d.items()},  # repeated: merged, later wins
        "started_at": started,  # the worker's clock starts here: "done in" is the command's wall time
    }
    if a.tp < 1:
        print(f"flare-prepare: error: --tp must be at least 1, got {a.tp}", file=sys.stderr)
        return 2
    if a.tp == 1:
        return subprocess.run([*worker_command("flare.prepare.worker"), json.dumps(args)]).returncode
    return _run_ranks(args, a.tp)


def _run_ranks(args: dict, size: int) -> int:
    """One preparation process per rank, joined in a gloo group on a free local port.
    The first rank to fail stops the others (a peer waiting in a collective would
    otherwise wait for the collective timeout)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    gpus = _visible_gpus() if args.get("device") == "cuda" else []
    procs = []
    for r in range(size):
        env = dict(os.environ)
        if gpus:  # rank r on GPU r (round-robin when there are fewer GPUs than ranks)
            env["CUDA_VISIBLE_DEVICES"] = gpus[r % len(gpus)]
        procs.append(subprocess.Popen([*worker_command("flare.prepare.worker"),
                                       json.dumps({**args, "tp_rank": r, "tp_addr": addr})], env=env))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    sys.exit(main())
