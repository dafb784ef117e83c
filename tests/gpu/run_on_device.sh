#!/bin/bash
# The GPU suite on a CUDA machine (the H200 device). Wheels for packages the
# machine lacks travel in .whl/ (git-ignored). Results land in $OUT.
#   usage: tests/gpu/run_on_device.sh [pytest args]
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/flare-out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONPATH=$PWD/src:$PWD:$PYTHONPATH
# Caches inside the (git-ignored) .cache/ of the checkout: a warm device keeps them between calls.
export FLARE_CACHE_DIR=$PWD/.cache/flare FLARE_TEST_CACHE=$PWD/.cache/device-cores FLARE_RESULTS_DIR=$OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers, cuda.bindings as cb; print('versions', torch.__version__, triton.__version__, transformers.__version__, cb.__version__)"
[ $# -gt 0 ] || set -- tests/gpu/test_load_errors.py tests/gpu/test_paged_attention_cuda.py tests/gpu/test_replay.py \
  tests/gpu/test_numerics.py tests/gpu/test_generation.py tests/gpu/test_serve.py
python3 -m pytest -v -rA -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest.log"
