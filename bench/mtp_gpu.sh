#!/bin/bash
# Learned MTP drafts on the H200 (issue 20). The GPU suite's hybrid shape (prepared with
# --mtp there) through its prepare phase and its replay and serve tests, then the cost:
# bench.ab_decode of that core's decode programs against a core of the same shape and
# options without the head (what keeping the head's KV rows costs a decode step), and the
# replay floor's verify programs (with the chain of drafts) against its decode programs.
#   usage: bash bench/mtp_gpu.sh            (carry .whl); STEPS="suite cost" by default
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/flare-bench}; mkdir -p "$OUT"
STEPS=" ${STEPS:-suite cost} "
S=$SECONDS
if [[ "$STEPS" == *" suite "* ]]; then
  FLARE_GPU_SHAPES=qwen3_5-small-shape tests/gpu/device_call.sh prepare:${PREPARE_S:-300} replay-serve:${SERVE_S:-170}
fi
if [[ "$STEPS" == *" cost "* ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD FLARE_CACHE_DIR=$PWD/.cache/flare
  MTP=$(ls -d .cache/device-cores/qwen3_5-small-shape-gpu-* | grep -v -e lock -e tmp | head -1)
  PLAIN=.cache/mtp-plain-core
  [ -f $PLAIN/manifest.json ] || python3 -m flare.prepare.cli qwen3_5-small-shape --out $PLAIN --device cuda \
    --page-size 16 --decode-capacities 1,2,4 --scratch-memory 8 --context-limit 2048 --prefill-chunk-size 256 \
    --kv-pages 512 --draft-tokens 3 2>&1 | tail -1
  echo "plain core at $((SECONDS - S)) s"
  python3 -m bench.ab_decode $PLAIN $MTP $OUT/ab-decode-mtp.json --rounds 3 2>&1 | tail -6
  python3 -m bench.floor $MTP $OUT/floor-mtp.json 100 2>&1 | tail -12
  python3 -m bench.floor $PLAIN $OUT/floor-plain.json 100 2>&1 | tail -12
fi
echo "done at $((SECONDS - S)) s"
