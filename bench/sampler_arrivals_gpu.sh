#!/bin/bash
# Two A/Bs on one GPU device call, for a model shape (default llama-3.2-1b-shape):
#   1. the sampler after the sort as one Triton program a row (--sampler kernel) against the
#      tensor ops (--sampler ops; kernel is the default since 2026-12-04): two cores prepared side by side, the kernel
#      core's programs replayed bitwise by the torch-free runtime (replay_check), then
#      bench.ab_decode (decode GPU ms per step, alternating rounds);
#   2. flare-serve --admission-window-ms 0 against the default on the kernel core:
#      bench.ab_serve's arrivals scenario (token-id and chat prompts sent together).
# The cores have pack programs and 16/32/64-token prefill programs (the arrivals' subject)
# and verify programs (the sampler kernel's verification path).
#   usage: bash bench/sampler_arrivals_gpu.sh [MODEL]       results in $OUT
#   env:   STEPS="sampler"  the sampler A/B alone, on lean cores (decode 1/2/4, 512-token prefill
#                           chunks, verify programs; no pack or small prefill programs, one
#                           qualification input set): what fits a device call with time left
#          PREPARE_ONLY=1  stop after preparing (the cores stay in .cache/ of a warm device);
#                          a first call on 2026-12-03 (1B shape) had not finished preparing the
#                          two cores side by side after 400 s (both logs end after the captures)
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODEL=${1:-llama-3.2-1b-shape}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD FLARE_CACHE_DIR=$PWD/.cache/flare
OUT=${OUT:-/tmp/flare-bench}; mkdir -p "$OUT" .cache
S=$SECONDS
python3 -m pytest -q -p no:cacheprovider tests/test_sampler_kernel.py 2>&1 | tail -2
STEPS=" ${STEPS:-sampler arrivals} "
OPTS=(--device cuda --context-limit 8192 --kv-memory 8 --scratch-memory 6 --pack-capacities 64,256
      --min-prefill-capacity 16 --draft-tokens 5 --qualify 1)
C=.cache/ab
if [[ "$STEPS" != *" arrivals "* ]]; then
  # 2 GiB of KV: qualification digests every runtime buffer after each program and input set,
  # so its time grows with the KV pool (with 8 GiB, 340 s for 14 programs on the H200).
  OPTS=(--device cuda --context-limit 8192 --kv-memory 2 --scratch-memory 6 --prefill-chunk-size 512 --draft-tokens 5
        --qualify 1)
  C=.cache/ab-lean-$MODEL
fi
for s in ops kernel; do
  [ -f $C-$s/manifest.json ] || python3 -m flare.prepare.cli $MODEL --out $C-$s --sampler $s "${OPTS[@]}" \
    > $OUT/prepare-$s.log 2>&1 &
done
wait
tail -n 2 $OUT/prepare-ops.log $OUT/prepare-kernel.log
echo "prepared at $((SECONDS - S)) s"
[ "${PREPARE_ONLY:-0}" = 1 ] && exit 0
python3 -m flare.runtime.replay_check $C-kernel > $OUT/replay-kernel.json 2> $OUT/replay-kernel.err
python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); \
print('replay', r['all_bitwise_equal'], len(r['programs']), 'programs', r['mismatches'][:3], r['torch_imported'])" \
  $OUT/replay-kernel.json
echo "replayed at $((SECONDS - S)) s"
python3 -m bench.ab_decode $C-ops $C-kernel $OUT/ab-decode-sampler.json --rounds 3 --steps 200 2>&1 | tail -6
echo "decode A/B at $((SECONDS - S)) s"
[[ "$STEPS" == *" arrivals "* ]] || exit 0
timeout -k 5 ${SERVE_LIMIT:-200} python3 -m bench.ab_serve $C-kernel $OUT/ab-arrivals.json \
  --a='--admission-window-ms 0' --b='' -- --scenarios arrivals --repeats 7 2>&1 | tail -6
echo "done at $((SECONDS - S)) s"
