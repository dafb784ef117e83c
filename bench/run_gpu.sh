#!/bin/bash
# Benchmarks on a CUDA machine: replay floor, flare-serve, Transformers baseline,
# all on the same core in one run. Results (JSON) land in $OUT.
#   usage: bench/run_gpu.sh MODEL [prepare options]
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/flare-bench}; mkdir -p "$OUT"
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1; fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD FLARE_CACHE_DIR=${FLARE_CACHE_DIR:-/tmp/flare-cache}
MODEL=$1; shift
CORE=/tmp/bench-core-$MODEL
if [ ! -f $CORE/manifest.json ]; then
  t0=$SECONDS
  python3 -m flare.prepare.cli $MODEL --out $CORE --device cuda "$@" 2>&1 | grep -v "^  " | tail -12
  echo "prepare_s $((SECONDS - t0))" | tee $OUT/prepare_time-$MODEL.txt
  cp $CORE/prepare_report.json $OUT/prepare_report-$MODEL.json
fi
python3 -m bench.floor $CORE $OUT/floor-$MODEL.json 200
PORT=8391
python3 -m flare.server.cli $CORE --port $PORT > $OUT/serve-$MODEL.log 2>&1 &
SRV=$!
for i in $(seq 1 240); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 0.25; done
curl -s localhost:$PORT/metrics | grep startup > $OUT/startup-$MODEL.txt
python3 -m bench.serve_bench http://127.0.0.1:$PORT $(basename $CORE | sed 's/bench-core-//') $OUT/serve-$MODEL.json
kill $SRV; wait $SRV
timeout ${HF_TIMEOUT:-300} python3 -m bench.hf_baseline $CORE $OUT/hf-$MODEL.json
