"""Prompt attention at long context (issue 19, item 3): GPU time of one layer's paged
attention for a prefill chunk after a long cached history, our Triton kernel in several
tilings against torch's fused attention kernels over the same keys laid out contiguously.

usage: python bench/attention_prefill.py --out RESULT.json [--histories 0,16384,...] [--chunk 2048]
                                         [--configs default,masked,full.r256.n64.w8.s2,...] [--sdpa cudnn,flash]
       python bench/attention_prefill.py --smoke --out /tmp/attention-prefill-smoke.json   (CPU, interpreter)

For each geometry (default Llama-3.1-8B: 32 query heads over 8 kv heads of 128) and
history ``h``, one slot's chunk of ``--chunk`` query tokens at positions ``h .. h + chunk - 1``
over ``h + chunk`` cached keys (pages of 16 tokens in a shuffled order, bfloat16; the
page table as wide as the context limit ``--context``, so the launch is the one a core
with that limit runs). Candidates:

* ``ours.<config>``: ``attend_triton`` as a prompt program launches it (query tiles,
  key segments). ``default`` is the planned launch, as cores run it (since 2026-12-06 with
  the key blocks every row of a tile sees whole scored unmasked, ``full_blocks``; in the
  results of 2026-12-06 and before, ``default`` was the launch with every block masked);
  ``masked`` and ``full`` that launch with every block masked / whole blocks unmasked;
  ``rR.nN.wW.sS`` a prompt tile of R query rows, key blocks of N, W warps, S stages, with
  the blocks as planned (unmasked where whole; masked in the results of 2026-12-06 and
  before), and ``masked.rR.nN.wW.sS`` / ``full.rR.nN.wW.sS`` that tiling masked / unmasked.
* ``sdpa.<backend>``: ``torch.nn.functional.scaled_dot_product_attention`` with one backend
  (``cudnn``, ``flash``, ``efficient``) over contiguous ``[1, H, keys, D]`` keys (the kv
  heads repeated: no GQA sharing), causal to the bottom right: what torch's fused kernels
  reach on this card without pages (FlashAttention-2 class; cuDNN only without a history,
  where torch has no fused lower-right causal path for it). Not a ceiling: issue 19's 64K
  target needs about 500 TFLOP/s, FlashAttention-3 class.

Per case: ``time_us`` (median graph replay, one call a layer over 2 layers rotated),
``tflops`` (4 x D x H x the visible keys of the chunk's rows over the time),
``max_abs_err`` of 16 rows (of a long chunk: the first, a third, the middle, the last 13)
against float64 attention, and for ours whether the bits
equal the default launch's (``same_bits_as_default``; ``masked`` and ``full`` must). The summary adds,
per candidate with every history measured, the attention time of a whole prompt of
``--prompt`` tokens in ``--chunk`` chunks over ``--layers`` layers (each chunk's time
interpolated linearly in its history between the measured ones; a last partial chunk
counts as a whole one).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.gdn_kernels import Case, kernel_bench_args, run  # noqa: E402
from flare.prepare.attention import PagedBatch  # noqa: E402
from flare.prepare.kernels.paged_attention import _sm_count, attend_triton, plan_launch  # noqa: E402

GEOMETRIES = {"llama-3.1-8b": (32, 8, 128, 32), "qwen3_5-9b": (16, 4, 256, 8)}  # H, KVH, D, attention layers
SMOKE_GEOMETRIES = {"tiny": (4, 2, 16, 2)}
PAGE = 16
SLOT = 1
F64 = torch.float64
CONFIGS = ("default,masked,full.r128.n32.w4.s2,full.r128.n64.w8.s2,full.r256.n64.w8.s2,full.r256.n64.w8.s3,"
           "full.r256.n32.w8.s2,full.r256.n64.w4.s2,full.r512.n64.w8.s2")
SMOKE_CONFIGS = "default,masked,full,full.r32.n32.w4.s2"


def parse_config(name: str) -> tuple[bool | None, dict]:
    """``default``, ``masked``, ``full`` or ``[masked.|full.]rR.nN.wW.sS`` -> (``full_blocks``:
    None as the launch plans it, plan_launch's tiling overrides)."""
    parts = name.split(".")
    full = {"masked": False, "full": True}.get(parts[0])
    tiling = parts[1:] if full is not None else ([] if name == "default" else parts)
    if not tiling:
        return full, {}
    try:
        t = {x[0]: int(x[1:]) for x in tiling}
        return full, dict(rows=t["r"], block_n=t["n"], num_warps=t["w"], num_stages=t["s"])
    except (KeyError, ValueError, IndexError):
        raise SystemExit(f"config {name!r}: expected default, masked, full or [masked.|full.]rR.nN.wW.sS") from None


def visible_keys(history: int, chunk: int) -> int:
    """Keys the chunk's rows see under the causal mask: row i sees history + i + 1."""
    return chunk * history + chunk * (chunk + 1) // 2


def _pool(H, KVH, D, keys, context, layers, device, gen, dtype):
    """Pages for ``keys`` keys of slot 1 in a shuffled order (page 0: the null page), a
    page table as wide as ``context``, and the chunk's queries."""
    per = -(-context // PAGE)
    used = -(-keys // PAGE)
    kv = torch.randn(layers, 2, 1 + used, PAGE, KVH, D, generator=gen, device=device).to(dtype)
    table = torch.zeros(2, per, dtype=torch.int32, device=device)
    table[SLOT, :used] = (torch.randperm(used, generator=gen, device=device) + 1).to(torch.int32)
    return kv, table


def _batch(kv, table, history, chunk, device) -> PagedBatch:
    return PagedBatch(kv, table, token_slot=torch.full((chunk,), SLOT, device=device),
                      positions=torch.arange(history, history + chunk, device=device),
                      slot_mapping=torch.full((chunk,), -1, device=device),
                      valid=torch.ones(chunk, dtype=torch.bool, device=device), impl="triton", single_slot=True)


def _contiguous(kv, table, layer, keys, H):
    """[1, H, keys, D] keys and values of slot 1 (kv heads repeated over their query heads)."""
    pages = table[SLOT, : -(-keys // PAGE)].long()
    k, v = (kv[layer, i, pages].reshape(-1, kv.shape[-2], kv.shape[-1])[:keys] for i in (0, 1))
    group = H // kv.shape[-2]
    return tuple(t.repeat_interleave(group, dim=1).transpose(0, 1)[None].contiguous() for t in (k, v))


def _reference(q, k, v, history, rows, scale):
    """Float64 attention of the chunk's ``rows`` (indices) over the contiguous keys."""
    out = []
    for i in rows:
        n = history + i + 1
        s = torch.einsum("hd,hkd->hk", q[i].to(F64), k[0, :, :n].to(F64)) * scale
        out.append(torch.einsum("hk,hkd->hd", s.softmax(-1), v[0, :, :n].to(F64)))
    return torch.stack(out)


def _sdpa(backend: str):
    """One torch backend's fused attention, causal to the bottom right (the chunk's last row
    sees every key): ``is_causal`` where the chunk is the whole sequence, else the
    lower-right bias, which torch dispatches to a fused kernel for flash and efficient only
    (cuDNN would get a dense mask: not offered)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def call(q4, k, v, scale):
        with sdpa_kernel([kind]):
            if q4.shape[2] == k.shape[2]:
                return torch.nn.functional.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale)
            mask = causal_lower_right(q4.shape[2], k.shape[2])
            return torch.nn.functional.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale)
    return call


def _cases(gname, geo, history, chunk, context, configs, sdpa, device) -> list[Case]:
    H, KVH, D, _ = geo
    scale = D ** -0.5
    keys = history + chunk
    gen = torch.Generator(device=device).manual_seed(history + 1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter truncates bfloat16 casts
    layers = 2
    name = f"{gname}.h{history}.c{chunk}"
    try:
        kv, table = _pool(H, KVH, D, keys, context, layers, device, gen, dtype)
        q = torch.randn(chunk, H, D, generator=gen, device=device).to(dtype)
    except torch.OutOfMemoryError as e:
        return [Case(name=f"{name}.pool", calls=[], state=[], notes=f"pool: {e}"[:300])]
    batch = _batch(kv, table, history, chunk, device)
    flops = 4 * D * H * visible_keys(history, chunk)
    rows = sorted({0, chunk // 3, chunk // 2} | set(range(max(0, chunk - 13), chunk)))  # 16 of a long chunk
    sdpa = sdpa if device == "cuda" else []
    try:  # every layer's keys laid out contiguously where SDPA runs on them; layer 0's for the reference
        kvs = [_contiguous(kv, table, i, keys, H) for i in range(layers if sdpa else 1)]
    except torch.OutOfMemoryError as e:
        return [Case(name=f"{name}.contiguous", calls=[], state=[], notes=f"contiguous keys: {e}"[:300])]
    ref = _reference(q, *kvs[0], history, rows, scale)
    notes = f"H {H}, KVH {KVH}, D {D}, history {history}, chunk {chunk}, context {context}, {flops / 1e12:.3f} TFLOP"
    plain = {}

    def errors(out):  # out [chunk, H, D]
        return dict(max_abs_err=float((out[rows].to(F64) - ref).abs().max()), out_scale=float(ref.abs().max()),
                    tflops_total=flops / 1e12)

    def ours(cfg):
        full, over = parse_config(cfg)
        launch = plan_launch(chunk, H, KVH, D, table.shape[1], PAGE, tile_tokens=True, sm_count=_sm_count(q.device),
                             **over) if over else None
        return lambda layer: (attend_triton(batch, layer, q, scale, full_blocks=full, launch=launch),)

    def check_for(cfg):
        def check(outs, _state):
            out = outs[0]
            if cfg == "default":
                plain["out"] = out.clone()
            return dict(errors(out),
                        same_bits_as_default=bool(torch.equal(out, plain["out"])) if "out" in plain else None)
        return check

    cases = []
    for cfg in configs:
        call = ours(cfg)
        cases.append(Case(name=f"{name}.ours.{cfg}", calls=[lambda i=i, c=call: c(i) for i in range(layers)],
                          state=[], check=check_for(cfg), notes=notes))
    q4 = q.transpose(0, 1)[None].contiguous()
    for backend in sdpa:
        if backend == "cudnn" and history:
            cases.append(Case(name=f"{name}.sdpa.{backend}", calls=[], state=[],
                              notes="not run: torch has no fused lower-right causal path for cuDNN"))
            continue
        try:
            fn = _sdpa(backend)
        except (ImportError, AttributeError) as e:
            cases.append(Case(name=f"{name}.sdpa.{backend}", calls=[], state=[], notes=f"{type(e).__name__}: {e}"[:300]))
            continue

        def check(outs, _state):
            return errors(outs[0][0].transpose(0, 1))
        cases.append(Case(name=f"{name}.sdpa.{backend}", notes=notes + ", contiguous keys, heads repeated",
                          calls=[lambda kv_=kv_, fn=fn: (fn(q4, kv_[0], kv_[1], scale),) for kv_ in kvs],
                          state=[], check=check))
    return cases


def prompt_estimates(results: list[dict], geos: dict, histories: list[int], chunk: int, prompt: int) -> dict:
    """Attention seconds of a ``prompt``-token prompt in ``chunk`` chunks over every attention
    layer, per candidate and geometry: each chunk's time interpolated linearly in its
    history between the measured histories (extrapolated from the last two past them)."""
    out = {}
    for gname, geo in geos.items():
        layers = geo[3]
        by = {}
        for r in results:
            if r.get("error") or r.get("time_us") is None or not r["name"].startswith(gname + "."):
                continue
            parts = r["name"][len(gname) + 1:].split(".")  # h<history>.c<chunk>.<candidate...>
            by.setdefault(".".join(parts[2:]), {})[int(parts[0][1:])] = r["time_us"]
        for cand, times in by.items():
            if sorted(times) != sorted(histories) or len(times) < 2:
                continue
            hs = sorted(times)
            total = 0.0
            for start in range(0, prompt, chunk):
                j = min(max(next((k for k, h in enumerate(hs) if h >= start), len(hs) - 1), 1), len(hs) - 1)
                h0, h1 = hs[j - 1], hs[j]
                total += times[h0] + (times[h1] - times[h0]) * (start - h0) / (h1 - h0)
            out[f"{gname}.{cand}"] = dict(attention_s=round(total * layers / 1e6, 4), layers=layers, prompt=prompt,
                                          chunk=chunk)
    return out


def main(argv=None) -> int:
    def add(p):
        p.add_argument("--geometries", default=None, help=f"comma separated, of {', '.join(GEOMETRIES)}")
        p.add_argument("--histories", default=None, help="cached tokens before the chunk (default 0,16384,32768,63488)")
        p.add_argument("--chunk", type=int, default=None, help="query tokens (default 2048)")
        p.add_argument("--context", type=int, default=None, help="the page table's width in tokens (default 131072)")
        p.add_argument("--prompt", type=int, default=None, help="prompt of the summary's estimate (default 65536)")
        p.add_argument("--configs", default=None, help=f"ours' tilings (default {CONFIGS})")
        p.add_argument("--sdpa", default="cudnn,flash", help="torch backends to compare (cudnn, flash, efficient; none)")
    p, args, device = kernel_bench_args(__doc__, argv, add, replays=20, budget_s=400.0)
    if device is None:
        return 2
    cuda = device == "cuda"
    geos = SMOKE_GEOMETRIES if args.smoke else {g: GEOMETRIES[g] for g in (args.geometries or "llama-3.1-8b").split(",")}
    histories = [int(h) for h in (args.histories or ("0,100" if args.smoke else "0,16384,32768,63488")).split(",")]
    chunk = args.chunk or (24 if args.smoke else 2048)
    context = args.context or (128 if args.smoke else 131072)
    prompt = args.prompt or (64 if args.smoke else 65536)
    configs = (args.configs or (SMOKE_CONFIGS if args.smoke else CONFIGS)).split(",")
    for c in configs:
        parse_config(c)
    sdpa = [] if args.sdpa in ("", "none") else args.sdpa.split(",")
    if max(histories) + chunk > context:
        p.error(f"history {max(histories)} + chunk {chunk} exceeds the context {context}")
    meta = {"machine": platform.node(), "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
            "page_size": PAGE, "kv_dtype": "bfloat16" if cuda else "float32", "replays": args.replays,
            "chunk": chunk, "context": context, "histories": histories,
            "command": "python bench/attention_prefill.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    started = time.perf_counter()
    results = []
    for gname, geo in geos.items():
        for h in histories:
            results += run(_cases(gname, geo, h, chunk, context, configs, sdpa, device), args, cuda, started, print)
    for r in results:
        if r.get("time_us") and r.get("tflops_total"):
            r["tflops"] = round(r["tflops_total"] / (r["time_us"] / 1e6), 1)
    summary = prompt_estimates(results, geos, histories, chunk, prompt)
    for k, v in summary.items():
        print(f"{k:<48} {v['attention_s']:.3f} s of attention for a {prompt}-token prompt over {v['layers']} layers")
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results, "prompt_estimates": summary}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
