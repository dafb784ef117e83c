#!/bin/bash
# Learned MTP drafts on the H200 (issue 20). STEPS (default "suite cost"):
#   suite  the GPU suite's hybrid-experts shape (prepared there with --draft-tokens 3 --mtp)
#          through its prepare phase and its replay and serve tests;
#   cost   qwen3_5-small-shape (the 9B head geometry, 8 layers) prepared with and without the
#          head: bench.ab_decode of their decode programs (what keeping the head's KV rows
#          costs a decode step), the replay floor of each (verify programs with the chain
#          against plain ones), and bench.ab_serve of the MTP core, --speculative off against
#          mtp-always and mtp (a random head's drafts are rejected: what verifying them costs,
#          and whether the cost model turns them off).
#   usage: bash bench/mtp_gpu.sh     (carry .whl)
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/flare-bench}; mkdir -p "$OUT"
STEPS=" ${STEPS:-suite cost} "
S=$SECONDS
if [[ "$STEPS" == *" suite "* ]]; then
  FLARE_GPU_SHAPES=qwen3_5-moe-small-shape tests/gpu/device_call.sh prepare:${PREPARE_S:-300} \
    replay-serve:${SERVE_S:-170}
fi
if [[ "$STEPS" == *" cost "* ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD FLARE_CACHE_DIR=$PWD/.cache/flare
  OPTS=(--device cuda --page-size 16 --decode-capacities 1,2,4 --context-limit 4096 --prefill-chunk-size 512
        --kv-pages 1024 --draft-tokens 3)
  for v in plain mtp; do
    C=.cache/mtp-cost-$v; X=(); [ $v = mtp ] && X=(--mtp)
    [ -f $C/manifest.json ] || python3 -m flare.prepare.cli qwen3_5-small-shape --out $C "${OPTS[@]}" "${X[@]}" \
      2>&1 | tail -1
  done
  echo "cores at $((SECONDS - S)) s"
  python3 -m bench.ab_decode .cache/mtp-cost-plain .cache/mtp-cost-mtp $OUT/ab-decode-mtp.json --rounds 3 2>&1 | tail -5
  python3 -m bench.floor .cache/mtp-cost-mtp $OUT/floor-mtp.json 100 2>&1 | tail -8
  python3 -m bench.floor .cache/mtp-cost-plain $OUT/floor-plain.json 100 2>&1 | tail -8
  echo "floors at $((SECONDS - S)) s"
  for b in mtp-always mtp; do
    timeout -k 5 ${AB_LIMIT:-100} python3 -m bench.ab_serve .cache/mtp-cost-mtp $OUT/ab-serve-$b.json \
      --a='--speculative off' --b="--speculative $b" -- --scenarios decode --concurrency 1,4 --tokens 256 \
      --repeats 3 2>&1 | tail -6
  done
fi
echo "done at $((SECONDS - S)) s"
