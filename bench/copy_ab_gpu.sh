#!/bin/bash
# Real SmolLM2 on the GPU device: join the GGUF parts that scripts/gguf-parts.sh made (two in
# .cache/ from the previous calls, the last in .w2/), prepare a core with verify programs,
# then bench.ab_serve --speculative off against copy (issue 20's copy-heavy and no-copy
# workloads). Results in $OUT.
#   usage: bash bench/copy_ab_gpu.sh [extra bench.ab_serve --b options]
#   env:   AB_LIMIT  seconds for the A/B (default 240); SCENARIOS (default rewrite,decode)
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .w2/*.whl 2>/dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD FLARE_CACHE_DIR=$PWD/.cache/flare
OUT=${OUT:-/tmp/flare-bench}; mkdir -p "$OUT" .cache/gg
G=.cache/gg/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $G ]; then
  cat .cache/gguf.part00 .cache/gguf.part01 .w2/gguf.part02 > $G && rm -f .cache/gguf.part0*
fi
[ "$(sha256sum $G | cut -d' ' -f1)" = "$(cat .w2/gguf.sha256)" ] || { echo "GGUF sha256 mismatch"; exit 3; }
CORE=.cache/smol-spec
S=$SECONDS
[ -f $CORE/manifest.json ] || python3 -m flare.prepare.cli $G --out $CORE --device cuda --draft-tokens 5 \
  --context-limit 8192 --kv-memory 8 2>&1 | grep -v "^  " | tail -2
echo "prepared at $((SECONDS - S)) s"
timeout -k 5 ${AB_LIMIT:-240} python3 -m bench.ab_serve $CORE $OUT/ab-copy.json --a='--speculative off' \
  --b="--speculative copy $*" -- --scenarios ${SCENARIOS:-rewrite,decode} --concurrency 1,4 --tokens 512 \
  --rewrite-tokens 256 --repeats 5 --decode-rounds ${DECODE_ROUNDS:-5} 2>&1 | tail -8
echo "done at $((SECONDS - S)) s"
