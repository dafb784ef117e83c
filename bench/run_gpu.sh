#!/bin/bash
# Benchmarks on a CUDA machine: replay floor, flare-serve (every serving scenario),
# Transformers baseline, all on the same core in one run. Results (JSON) land in $OUT;
# $OUT/serving-MODEL-DATE.json joins them (bench/collect.py) for bench/report.py.
#   usage: bench/run_gpu.sh MODEL [prepare options]
#   env:   CONTEXT_LIMIT (default 8192: a 4,096-token prompt plus a cached-prefix tail and output)
#          LONG_PROMPT=1  also prefill a 64K-token prompt (context limit 66560 unless CONTEXT_LIMIT
#                         is set); without it the 64K size is recorded as skipped (over the limit)
#          SCENARIOS      serve_bench scenarios (default: all)
#          PREFILL_PROMPTS cold prefill sizes (default 4096,65536)
#          TIMELINE_PREFILLS prefill chunks the timeline also profiles, N@S (N tokens after S in KV;
#                         default 16@0,2048@0; empty: decode steps only)
#          TIMELINE_PACKS  decode steps carrying a chunk it profiles, N@S+D: a prompt with N tokens left
#                         after S and D decoders (a core with pack programs; default none), e.g. 4096@2048+3
#          SERVE_OPTS     extra flare-serve options for the serve step (e.g. --prefill-while-decoding 256)
#          STEPS          which steps to run (default: all, in order): prepare floor timeline serve
#                         depth1 baseline collect. The core and the raw files live in .cache/ of
#                         the checkout, which a warm device keeps between calls: a run too long
#                         for one call is split into calls of a few steps each.
# A --context-limit among the prepare options overrides CONTEXT_LIMIT (it comes last).
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
FINAL=${OUT:-/tmp/flare-bench}; mkdir -p "$FINAL"
# Everything is written to a work folder; $OUT receives the joined serving JSON and one
# archive of the raw files (the device returns at most 8 files per call).
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1; fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD FLARE_CACHE_DIR=${FLARE_CACHE_DIR:-$PWD/.cache/flare}
MODEL=$1; shift
if [ "${LONG_PROMPT:-0}" = 1 ]; then CONTEXT_LIMIT=${CONTEXT_LIMIT:-66560}; else CONTEXT_LIMIT=${CONTEXT_LIMIT:-8192}; fi
PREP=(--context-limit "$CONTEXT_LIMIT" "$@")
# One core per option set: a core prepared with another context limit is never reused.
KEY=$MODEL-$(echo "${PREP[*]}" | md5sum | cut -c1-8)
CORE=$PWD/.cache/bench-core-$KEY
OUT=$PWD/.cache/bench-work-$KEY; mkdir -p $OUT
STEPS=" ${STEPS:-prepare floor timeline serve depth1 baseline collect} "
step() { [[ "$STEPS" == *" $1 "* ]]; }
if step prepare && [ ! -f $CORE/manifest.json ]; then
  t0=$SECONDS
  # The whole log travels in the raw archive (which step GEMMs were chosen, the captures); the
  # console gets its tail.
  python3 -m flare.prepare.cli $MODEL --out $CORE --device cuda "${PREP[@]}" > $OUT/prepare-$MODEL.log 2>&1
  grep -v "^  " $OUT/prepare-$MODEL.log | tail -12
  echo "prepare_s $((SECONDS - t0))" | tee $OUT/prepare_time-$MODEL.txt
  cp $CORE/prepare_report.json $OUT/prepare_report-$MODEL.json
fi
# Each step first removes what it writes (a failed step leaves no older file behind);
# collect joins what the steps run in this work folder left, across calls.
step floor && rm -f $OUT/floor-$MODEL.json && python3 -m bench.floor $CORE $OUT/floor-$MODEL.json 200
step timeline && rm -f $OUT/timeline-$MODEL.* && python3 -m bench.timeline $CORE $OUT/timeline-$MODEL.json --batches 1,4 --prefills "${TIMELINE_PREFILLS-16@0,2048@0}" --packs "${TIMELINE_PACKS-}" 2>&1 | tee $OUT/timeline-$MODEL.txt
PORT=8391
if step serve; then
rm -f $OUT/serve-$MODEL.json $OUT/serve-$MODEL.log $OUT/startup-$MODEL.txt $OUT/metrics-$MODEL.txt
python3 -m flare.server.cli $CORE --port $PORT --served-model-name $MODEL ${SERVE_OPTS:-} > $OUT/serve-$MODEL.log 2>&1 &
SRV=$!
for i in $(seq 1 240); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 0.25; done
curl -s localhost:$PORT/metrics | grep startup > $OUT/startup-$MODEL.txt
python3 -m bench.serve_bench http://127.0.0.1:$PORT $MODEL $OUT/serve-$MODEL.json \
  --scenarios ${SCENARIOS:-decode,cold,prefill,prefix,agent,interference,arrivals} \
  --cold-prompts 512,4096 --prefill-prompts ${PREFILL_PROMPTS:-4096,65536} --prefix-tokens 4096 --tail-tokens 11
curl -s localhost:$PORT/metrics | grep -E "prefix_cache|prefill_tokens|engine_" > $OUT/metrics-$MODEL.txt
kill $SRV; wait $SRV
fi
# The same decode scenario with one step at a time: the host gap that two steps in flight hide.
if step depth1; then
rm -f $OUT/serve-$MODEL-depth1.* $OUT/metrics-$MODEL-depth1.txt
python3 -m flare.server.cli $CORE --port $PORT --served-model-name $MODEL --steps-in-flight 1 \
  > $OUT/serve-$MODEL-depth1.log 2>&1 &
SRV=$!
for i in $(seq 1 240); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 0.25; done
python3 -m bench.serve_bench http://127.0.0.1:$PORT $MODEL $OUT/serve-$MODEL-depth1.json --scenarios decode
curl -s localhost:$PORT/metrics | grep -E "engine_" > $OUT/metrics-$MODEL-depth1.txt
kill $SRV; wait $SRV
fi
step baseline && rm -f $OUT/hf-$MODEL.* && timeout ${HF_TIMEOUT:-300} python3 -m bench.hf_baseline $CORE $OUT/hf-$MODEL.json 2>&1 | tee $OUT/hf-$MODEL.log
if step collect; then
  rm -f $OUT/serving-$MODEL-*.json
  python3 -m bench.collect $CORE $OUT $MODEL $OUT/serving-$MODEL-$(date +%F).json
  cp $OUT/serving-$MODEL-$(date +%F).json $OUT/timeline-$MODEL.json $OUT/timeline-$MODEL.txt "$FINAL"/ 2>/dev/null
fi
tar czf "$FINAL/bench-raw-$MODEL.tgz" -C $OUT .
