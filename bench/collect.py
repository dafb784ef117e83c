"""Join one GPU run's raw outputs into bench/results/serving-MODEL-DATE.json.

usage: python -m bench.collect CORE OUT_DIR MODEL RESULT.json

Reads OUT_DIR/{floor,serve,hf}-MODEL.json (the baseline may be missing: its
fields are then null) and the startup figures (serve log, /metrics, prepare time), describes the machine (nvidia-smi, package versions) and
derives, per concurrency c:

  roofline_tokens_per_s = c * copy bandwidth / weight bytes (one weight read per step)
  roofline_fraction     = replay floor tokens/s / roofline tokens/s
  step_bytes            = the bytes a decode step of c rows must move (``step_bytes``):
                          every weight but an untied input embedding, of which c rows
                          are read, and but the routed experts, of which the ones the
                          step's rows route to are read (mixture-of-experts: the
                          *active-bytes* roofline), plus each row's recurrent state read
                          and written
  step_roofline_tokens_per_s, step_roofline_fraction: the same over step_bytes
  runtime_over_floor    = server ITL p50 / floor GPU time per step - 1
  baseline_ratio        = server tokens/s / Transformers tokens/s

Every record carries the machine and the configuration it was measured under.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from flare.core.manifest import BufferRole, Manifest, load_manifest


def gpu_machine() -> dict:
    out = {}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, check=True).stdout.splitlines()[0]
        name, driver, mib = (x.strip() for x in q.split(","))
        out = {"gpu": name, "driver": driver, "memory_mib": int(mib)}
    except (OSError, subprocess.CalledProcessError, IndexError, ValueError) as e:
        out = {"gpu": "unknown", "driver": None, "memory_mib": None, "gpu_error": str(e)}
    for pkg in ("torch", "triton", "transformers", "cuda-bindings", "httpx", "flare"):
        try:
            out[pkg.replace("-", "_")] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg.replace("-", "_")] = None
    out["python"] = platform.python_version()
    return out


def routed_share(m: Manifest, c: int) -> float:
    """The expected fraction of the routed experts' bytes a decode step of ``c`` rows reads:
    one row reads exactly its k of E experts a layer, c rows the union of theirs, counted as
    expected under uniform routing, 1 - (1 - k/E)^c (random-weight routers route near
    uniformly; a trained router's union is smaller, so its roofline higher). E and k are the
    model's (a tensor-parallel rank holds E / tp experts and reads the same fraction of
    them). 0 for a core without routed experts."""
    experts = next((b for b in m.buffers if b.role == BufferRole.weight and ".mlp.experts." in b.name), None)
    if experts is None:
        return 0.0
    cfg = json.loads(m.reference.config)
    cfg = cfg.get("text_config", cfg)
    # Transformers writes the count as num_experts or num_local_experts, by version and model.
    E = int(cfg.get("num_experts") or cfg.get("num_local_experts") or experts.shape[0] * m.parallel.tp_size)
    k = int(cfg["num_experts_per_tok"])
    return 1 - (1 - k / E) ** c


def step_bytes(m: Manifest, c: int) -> dict[str, int]:
    """What a decode step of ``c`` live rows must move through device memory, by part.
    An input embedding with its own buffer (not tied to the head) is read one row per
    token; routed experts (``mlp.experts.*``, dim 0 the expert) only for the experts the
    rows route to (``routed_share``); the head and every other weight are read whole.
    Continuation state other than the hidden vector (recurrent matrices, convolution
    histories) is read and written once per row. KV reads are left out: the decode
    scenario's histories are short."""
    weights = [b for b in m.buffers if b.role == BufferRole.weight]
    embed = next((b for b in weights if b.name.endswith("embed_tokens.weight")), None)
    names = {b.name for b in weights}
    untied = embed is not None and any(n.endswith("lm_head.weight") for n in names)
    expert_bytes = sum(b.nbytes for b in weights if ".mlp.experts." in b.name)
    routed = round(expert_bytes * routed_share(m, c))
    dense = sum(b.nbytes for b in weights) - expert_bytes - (embed.nbytes if untied else 0)
    embed_rows = c * embed.nbytes // embed.shape[0] if untied else 0
    state = sum(b.nbytes // b.shape[0] for b in m.buffers
                if b.name in m.continuation.state and b.name != "state.hidden")
    return {"weights": dense + routed, "routed_experts": routed, "routed_experts_all": expert_bytes,
            "embedding_rows": embed_rows, "state_read_write": 2 * c * state,
            "total": dense + routed + embed_rows + 2 * c * state}


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def collect(core: str, out_dir: Path, model: str) -> dict:
    m = load_manifest(core)
    floor, serve, hf = (_load(out_dir / f"{k}-{model}.json") for k in ("floor", "serve", "hf"))
    depth1 = _load(out_dir / f"serve-{model}-depth1.json") or {}
    if floor is None or serve is None:
        raise SystemExit(f"missing floor-{model}.json or serve-{model}.json in {out_dir}")
    weight_bytes = sum(b.nbytes for b in m.buffers if b.role == BufferRole.weight)
    machine = gpu_machine()
    config = {"weights_bytes_per_token": weight_bytes, "copy_bandwidth_Bps": floor["copy_bandwidth_Bps"],
              "generated_tokens": serve["tokens"], "sampling": serve["sampling"],
              "context_limit": m.capacities.context_limit, "prefill_chunk": m.capacities.prefill_chunk,
              "kv_pages": m.pages.num_pages, "page_size": m.pages.page_size,
              "decode_capacities": list(m.capacities.decode_capacities), "snapshot_rows": m.capacities.snapshot_rows,
              "baseline": "transformers generate, static cache, built-in torch.compile",
              # Per batch, the mode the baseline ran (default-eager where static/compiled failed).
              "baseline_modes": (hf or {}).get("modes"),
              "client": serve.get("options", {})}
    records = []
    for c, s in serve.get("concurrency", {}).items():
        f = floor["decode"].get(c)
        if f is None:
            continue
        roofline = int(c) * floor["copy_bandwidth_Bps"] / weight_bytes
        moved = step_bytes(m, int(c))
        step_roofline = int(c) * floor["copy_bandwidth_Bps"] / moved["total"]
        base = (hf or {}).get("batches", {}).get(c, {}).get("decode_tokens_per_s")
        one = depth1.get("concurrency", {}).get(c)
        records.append({
            "gpu": machine["gpu"], "model": model, "dtype": m.reference.dtype, "concurrency": int(c),
            "decode_tokens_per_s": s["decode_tokens_per_s"], "itl_ms_p50": s["itl_s_p50"] * 1e3,
            "itl_ms_p99": s["itl_s_p99"] * 1e3, "ttft_ms_median": s["ttft_s_median"] * 1e3,
            "floor_decode_tokens_per_s": f["tokens_per_s_gpu"], "floor_gpu_ms_per_step": f["gpu_ms_per_step"],
            "floor_wall_ms_per_step_one_in_flight": f["wall_ms_per_step_one_in_flight"],
            "floor_wall_ms_per_step_two_in_flight": f.get("wall_ms_per_step_two_in_flight"),
            # The same server with --steps-in-flight 1 (one step at a time), same run.
            "one_step_decode_tokens_per_s": one["decode_tokens_per_s"] if one else None,
            "one_step_itl_ms_p50": one["itl_s_p50"] * 1e3 if one else None,
            "one_step_runtime_over_floor": one["itl_s_p50"] * 1e3 / f["gpu_ms_per_step"] - 1 if one else None,
            "roofline_tokens_per_s": roofline, "roofline_fraction": f["tokens_per_s_gpu"] / roofline,
            "step_bytes": moved, "step_roofline_tokens_per_s": step_roofline,
            "step_roofline_fraction": f["tokens_per_s_gpu"] / step_roofline,
            "runtime_over_floor": s["itl_s_p50"] * 1e3 / f["gpu_ms_per_step"] - 1,
            "baseline_decode_tokens_per_s": base,
            "baseline_ratio": s["decode_tokens_per_s"] / base if base else None,
            "machine": machine, "configuration": config})
    scenarios = {k: serve[k] for k in ("prefill", "prefix", "agent", "interference") if k in serve}
    return {"date": datetime.date.today().isoformat(), "machine": machine, "model": model, "configuration": config,
            "records": records, "cold_ttft": {n: {k: v for k, v in r.items() if k != "raw"}
                                              for n, r in serve.get("cold_ttft", {}).items()},
            "scenarios": {k: _strip(v) for k, v in scenarios.items()}, "startup": startup(out_dir, model),
            "host_gaps": {name: host_gaps(out_dir / f"metrics-{model}{suffix}.txt")
                          for name, suffix in (("two_steps_in_flight", ""), ("one_step", "-depth1"))},
            "commands": [" ".join(sys.argv)],
            "raw": {"floor": floor, "serve": serve, "baseline": hf, "serve_one_step": depth1 or None}}


def host_gaps(path: Path) -> dict | None:
    """The engine's host-gap counters over a whole server run (its /metrics at the end):
    gaps where the device waited on the host between steps, and steps run ahead."""
    if not path.is_file():
        return None
    v = {k: float(x) for k, x in re.findall(r"^flare_engine_(\w+) ([0-9.e+-]+)$", path.read_text(), re.MULTILINE)}
    gaps, total = v.get("host_gaps_total", 0.0), v.get("host_gap_seconds_total", 0.0)
    return {"gaps": int(gaps), "seconds_total": total, "mean_ms": total / gaps * 1e3 if gaps else None,
            "steps": int(v.get("steps_total", 0)), "steps_ahead": int(v.get("steps_ahead_total", 0))}


def startup(out_dir: Path, model: str) -> dict:
    """flare-serve's ready time (its log), the executor's startup split (its /metrics
    gauges, milliseconds) and flare-prepare's time, where the run left them."""
    out: dict = {}
    log = out_dir / f"serve-{model}.log"
    if log.is_file():
        # "ready in A s (B s after process start)": B counts the interpreter's start and
        # every import too; older logs carry only A (measured from the start of serve()).
        found = re.search(r"ready in ([0-9.]+) s(?: \(([0-9.]+) s after process start\))?", log.read_text())
        out["ready_s"] = (float(found.group(2) or found.group(1))) if found else None
        if found and found.group(2):
            out["ready_since_serve_s"] = float(found.group(1))
    metrics = out_dir / f"startup-{model}.txt"
    if metrics.is_file():
        for name, value in re.findall(r"^flare_executor_startup_(\w+)_ms ([0-9.]+)$", metrics.read_text(), re.MULTILINE):
            out[f"{name}_ms"] = float(value)
    prep = out_dir / f"prepare_time-{model}.txt"
    if prep.is_file():
        out["prepare_s"] = float(prep.read_text().split()[-1])
    if "ready_s" in out and out.get("ready_s") and "arena_upload_ms" in out:
        out["ready_minus_upload_s"] = out["ready_s"] - out["arena_upload_ms"] / 1e3
    return out


def _strip(v):
    """A scenario's summary without its raw samples (those stay under raw.serve)."""
    if isinstance(v, dict):
        return {k: _strip(x) for k, x in v.items() if not k.startswith("raw")}
    return v


if __name__ == "__main__":
    core, out_dir, model, result = sys.argv[1:5]
    Path(result).write_text(json.dumps(collect(core, Path(out_dir), model), indent=1))
