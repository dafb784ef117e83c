"""GPU tests: skipped cleanly without a CUDA device; run on the H200 before resolving
an issue that touches GPU code (see docs/gpu.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import prepare_core


def _cuda_available() -> bool:
    try:
        from cuda.bindings import driver as d

        if d.cuInit(0)[0] != d.CUresult.CUDA_SUCCESS:
            return False
        err, n = d.cuDeviceGetCount()
        return err == d.CUresult.CUDA_SUCCESS and n > 0
    except Exception:
        return False


HAS_CUDA = _cuda_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if not HAS_CUDA:
                item.add_marker(skip)


ATTENTION = os.environ.get("FLARE_GPU_ATTENTION", "triton")
COMPILE = [] if os.environ.get("FLARE_GPU_COMPILE", "1") == "1" else ["--no-compile"]
SHAPES = {
    "smollm2-135m-shape": ["--context-limit", "2048", "--prefill-chunk-size", "256", "--kv-pages", "512"],
    # With pack programs (packed prompts, decode steps that carry a chunk) and verify programs
    # (speculative decoding; its serve test then speculates, the default): replayed like the rest.
    "llama-3.2-1b-shape": ["--context-limit", "4096", "--prefill-chunk-size", "512", "--kv-pages", "1024",
                           "--pack-capacities", "64,256", "--draft-tokens", "5"],
    # The hybrid: Gated DeltaNet state in every checkpoint and program (docs/gpu.md), and
    # verify programs with per-position state (speculative decoding's rollback).
    # Decode and verify steps on the GEMV (--step-gemms gemv: every step row count, at most 8,
    # so one draft token): the MLP's activation in its loads, the residual add in its epilogue;
    # and their RMS norms on the row-invariant mean of squares (--step-norms invariant: Inductor
    # compiles a norm's reduction per step program, timed per program past 1,024 values a row).
    "qwen3_5-small-shape": ["--context-limit", "2048", "--prefill-chunk-size", "256", "--kv-pages", "512",
                            "--draft-tokens", "1", "--step-gemms", "gemv", "--step-norms", "invariant"],
    # Routed experts (recipes/moe.py): Qwen3-30B-A3B's per-layer geometry at 4 layers, its steps as
    # the MoE shapes are served (the step GEMMs and norms the same bits at every row count, the
    # post-attention norm in the router's and experts' loads, the q/k norms in the launch that
    # writes the pages). Without them (cuBLAS picking a kernel per row count, Inductor's norms) a
    # decode row's bits depended on its batch on the H200 on 2026-12-06: the batch-invariance test
    # and the prefix cache's exact repeat failed.
    "qwen3-moe-small-shape": ["--context-limit", "2048", "--prefill-chunk-size", "256", "--kv-pages", "512",
                              "--step-gemms", "gemv", "--step-norms", "invariant"],
    # Hybrid and routed experts with a gated shared expert: Qwen3.5-35B-A3B's and
    # Qwen3-Next-80B-A3B's per-layer geometry at 2 layers (Gated DeltaNet, attention).
    # The first with the MTP head (an experts layer: its KV rows in every program, its drafts
    # chained in verify programs; the serve test speculates with them, the default on such a core).
    "qwen3_5-moe-small-shape": ["--context-limit", "2048", "--prefill-chunk-size", "256", "--kv-pages", "512",
                                "--draft-tokens", "3", "--mtp"],
    "qwen3-next-small-shape": ["--context-limit", "2048", "--prefill-chunk-size", "256", "--kv-pages", "512",
                               "--step-gemms", "gemv", "--step-norms", "invariant"],
    # Sliding-window attention: Mistral-7B-v0.1's per-layer geometry (window 4,096) at 4 layers.
    "mistral-small-shape": ["--context-limit", "9216", "--prefill-chunk-size", "2048", "--kv-pages", "1200"],
}
# FLARE_GPU_SHAPES=a,b narrows the parametrised tests to some shapes (a first look at a new
# one); tests that name their core (load errors: the SmolLM2 shape) still find its options.
ALL_SHAPES = SHAPES
if os.environ.get("FLARE_GPU_SHAPES"):
    SHAPES = {m: SHAPES[m] for m in os.environ["FLARE_GPU_SHAPES"].split(",")}


def gpu_core(model: str) -> Path:
    opts = ["--device", "cuda", "--page-size", "16", "--decode-capacities", "1,2,4", "--qualify", "3",
            "--attention", ATTENTION, "--scratch-memory", "8", *COMPILE, *ALL_SHAPES[model]]
    return prepare_core(model, opts, name=f"{model}-gpu")


@pytest.fixture(scope="session", params=list(SHAPES))
def gpu_shape_core(request):
    return request.param, gpu_core(request.param)


@pytest.fixture(scope="session")
def results_dir() -> Path:
    d = Path(os.environ.get("FLARE_RESULTS_DIR", Path(__file__).resolve().parents[2] / ".cache" / "gpu-results"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def measured_logit_error_path(model: str) -> Path:
    """Where test_numerics leaves a shape's largest teacher-forced logit error against
    Transformers FP32 (beside the device's cores), for the generation tests of a shape that
    has no recorded figure yet."""
    from tests.conftest import CACHE

    return CACHE / f"logit-error-{model}.json"


def record(results_dir: Path, name: str, payload: dict) -> None:
    path = results_dir / f"{name}.json"
    existing = json.loads(path.read_text()) if path.exists() else {}
    existing.update(payload)
    path.write_text(json.dumps(existing, indent=1, default=str))
