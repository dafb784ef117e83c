#!/bin/bash
# The GPU suite on a CUDA machine (the H200 device). Wheels for packages the
# machine lacks travel in .whl/ (git-ignored). Results land in $OUT.
#   usage: tests/gpu/run_on_device.sh [pytest args]      one pytest process
#          tests/gpu/run_on_device.sh --phase prepare     prepare every shape's core in parallel, then
#                                                         the tests that tolerate other GPU processes,
#                                                         in parallel (load errors and kernels, numerics)
#          tests/gpu/run_on_device.sh --phase kernels     those parallel tests alone
#          tests/gpu/run_on_device.sh --phase alone [FILES] the tests that compare device-wide free
#                                                         memory (replay, serve, generation, or the
#                                                         FILES given), one process, nothing beside
#          tests/gpu/run_on_device.sh --collect NAME      after a phase killed by a time limit: merge
#                                                         and bundle what it wrote ($OUT holds at most
#                                                         8 files that come back)
# The two phases together are the whole suite; run `alone` right after `prepare` on the
# warm machine so that the cores in .cache/ are reused.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/flare-out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONPATH=$PWD/src:$PWD:$PYTHONPATH
# Caches inside the (git-ignored) .cache/ of the checkout: a warm device keeps them between calls.
export FLARE_CACHE_DIR=$PWD/.cache/flare FLARE_TEST_CACHE=$PWD/.cache/device-cores FLARE_RESULTS_DIR=$OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers, cuda.bindings as cb; print('versions', torch.__version__, triton.__version__, transformers.__version__, cb.__version__)"
PYTEST=(python3 -m pytest -v -rA -p no:cacheprovider)
G=tests/gpu
# Several pytest processes: each writes its own results folder and log under $OUT as it
# goes (a call cut short by its time limit still returns them); one JSON merges them.
R=$OUT/gpu-results
parallel() {  # parallel NAME "pytest args" NAME "pytest args" ...   (NAME=shape: that shape alone)
  local pids=() names=() rc=0
  while [ $# -gt 0 ]; do
    mkdir -p $R/$1
    FLARE_GPU_SHAPES=${GPU_SHAPES[$1]:-$FLARE_GPU_SHAPES} FLARE_RESULTS_DIR=$R/$1 "${PYTEST[@]}" $2 > $R/$1.log 2>&1 &
    pids+=($!); names+=($1); shift 2
  done
  for i in "${!pids[@]}"; do
    wait ${pids[$i]}; local r=$?
    echo "${names[$i]}: exit $r; $(tail -1 $R/${names[$i]}.log)"
    [ $r -eq 0 ] || rc=1
  done
  return $rc
}
collect() {  # merge the processes' results into $OUT/qualification-PHASE.json; bundle the rest
  python3 - "$1" <<'PY'
import json, os, pathlib, sys
merged = {}
for f in sorted(pathlib.Path(os.environ["OUT"], "gpu-results").glob("*/qualification.json")):
    merged.update(json.loads(f.read_text()))
pathlib.Path(os.environ["OUT"], f"qualification-{sys.argv[1]}.json").write_text(json.dumps(merged, indent=1))
# On the console too (a call whose files do not come back still reports its replays):
flags = []
def walk(x):
    if isinstance(x, dict):
        for k, v in x.items():
            if k == "bitwise_equal":
                flags.append(bool(v))
            else:
                walk(v)
    elif isinstance(x, list):
        for v in x:
            walk(v)
walk(merged)
print(f"bitwise_equal: {sum(flags)} of {len(flags)} true ({len(merged)} results, {sys.argv[1]})")
PY
  # A device call returns at most 8 files: the logs and per-process results travel as one.
  tar czf $OUT/gpu-results-$1.tgz -C $OUT gpu-results && rm -rf $R
}
# The load errors in a process of their own: they reserve the core's address range, which
# torch's allocations in the kernel tests could otherwise take. The hybrid's eager
# Triton-vs-reference comparison prepares its own core and compiles flash-linear-attention's
# float32 kernels (autotuned).
RIG=$G/test_numerics.py::test_hybrid_triton_path_matches_the_reference_path_on_the_gpu
side_tests() {  # the kernel tests compile a Triton kernel for nearly every case: three xdist workers
  parallel load-errors "$G/test_load_errors.py $G/test_export_scan.py" \
    kernels "-n 3 $G/test_paged_attention_cuda.py tests/test_paged_attention_triton.py::test_a_prompt_row_is_the_same_bits_however_its_keys_are_split_or_tiled tests/test_paged_attention_triton.py::test_unmasked_key_blocks_give_the_masked_bits tests/test_moe_kernels.py tests/test_gemm_rows.py tests/test_rownorm.py tests/test_gemv.py tests/test_sampler_kernel.py" \
    hybrid-rig "$RIG $G/test_gdn_grid_gpu.py"
}
declare -A GPU_SHAPES
SHAPE_LIST=$(python3 -c "from tests.gpu.conftest import SHAPES; print(*SHAPES)")
case "$1" in
  --phase)
    mkdir -p $R; PHASE=${PHASE_NAME:-$2}
    if [ "$2" = prepare ]; then
      t0=$SECONDS
      preps=(); prep_names=()
      prep() { python3 -c "import sys; from tests.gpu.conftest import gpu_core; print(gpu_core(sys.argv[1]))" "$@"; }
      for m in $SHAPE_LIST; do
        prep $m > $R/prepare-$m.log 2>&1 &
        preps+=($!); prep_names+=($m)
      done
      # The load errors, kernel tests and hybrid rig (side_tests) run beside the preparations
      # and then the numerics, which need only the cores. Not on a card of less than 100 GiB (an
      # H100's 80: the seven preparations and the kernel tests together ran out of memory on
      # 2026-12-05, 118 kernel tests failing on it): after the numerics they ran past the call's
      # 380 s limit (12-07; then whole in a `--phase kernels` call of their own, 171 s), so
      # there they are left to that call, unless SIDE_TESTS=1 asks for them after the numerics.
      # SIDE_TESTS=0 leaves them to that call on any card.
      mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      if [ "${mib:-0}" -ge 100000 ]; then beside=1; else beside=skip; fi
      case "${SIDE_TESTS:-}" in 0) beside=skip ;; 1) [ $beside = skip ] && beside=0 ;; esac
      [ $beside = skip ] && echo "kernel tests left to a --phase kernels call (SIDE_TESTS=1: after the numerics)"
      [ $beside = 1 ] && { side_tests > $R/kernels-phase.txt & kernels=$!; }
      rc=0; again=()
      for i in "${!preps[@]}"; do wait ${preps[$i]} || again+=(${prep_names[$i]}); done
      echo "prepared in $((SECONDS - t0)) s"; grep -h -B2 -A20 Traceback $R/prepare-*.log | tail -40
      # Side by side on an H100's 80 GiB, a preparation can find no device memory for its
      # arena (qwen3_5-moe-small-shape on 2026-12-06, qwen3_5-small-shape on 12-07): its numerics
      # process prepares it again (the tests' gpu_core fixture) beside the other shapes' numerics,
      # rather than a retry alone first (which took the time the 12-07 call's limit then cut the
      # MoE shapes' numerics short by).
      [ ${#again[@]} -gt 0 ] && echo "prepared again by their numerics: ${again[*]}"
      # Numerics: one process per shape, side by side (they share the GPU's memory).
      args=()
      for m in $SHAPE_LIST; do GPU_SHAPES[numerics-$m]=$m; args+=(numerics-$m "$G/test_numerics.py --deselect $RIG"); done
      parallel "${args[@]}"; rc=$((rc | $?))
      if [ $beside = 1 ]; then wait $kernels; elif [ $beside = 0 ]; then side_tests > $R/kernels-phase.txt; fi
      rc=$((rc | $?)); cat $R/kernels-phase.txt 2>/dev/null
    elif [ "$2" = kernels ]; then  # side_tests alone (a call of its own where the card is small)
      side_tests > $R/kernels-phase.txt; rc=$?; cat $R/kernels-phase.txt
    else  # alone [test files]: all three by default; a call's time limit may want them split
      shift 2
      parallel alone "${*:-$G/test_replay.py $G/test_serve.py $G/test_generation.py}"; rc=$?
    fi
    collect "$PHASE"; exit $rc;;
  --collect)  # after a phase cut short by a time limit: what its processes wrote so far
    collect "${2:-partial}"; exit 0;;
esac
[ $# -gt 0 ] || set -- $G/test_load_errors.py $G/test_paged_attention_cuda.py tests/test_moe_kernels.py tests/test_gemm_rows.py $G/test_replay.py \
  $G/test_numerics.py $G/test_generation.py $G/test_serve.py
"${PYTEST[@]}" "$@" 2>&1 | tee "$OUT/pytest.log"
