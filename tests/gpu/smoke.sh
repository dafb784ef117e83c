# Quick pipeline smoke on a CUDA machine: prepare tiny cores (eager and compiled),
# then reproduce their golden replays from a torch-free process.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD FLARE_CACHE_DIR=/tmp/fc
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
IFS=';' read -ra VARIANTS <<< "${SMOKE_VARIANTS:-llama-tiny gather --no-compile;llama-tiny gather}"
for v in "${VARIANTS[@]}"; do
  IFS=' ' read -ra A <<< "$v"; set -- "${A[@]}"
  d=/tmp/core-$1-$2-$#
  echo "=== prepare $v"
  timeout ${SMOKE_TIMEOUT:-240} python3 -m flare.prepare.cli $1 --out $d --device cuda --attention $2 ${@:3} --context-limit 1024 --prefill-chunk-size 256 --kv-pages 256 --qualify 2 --scratch-memory 4 2>&1 | grep -v "^  " | tail -25
  python3 -c "import json,sys; r=json.load(open('$d/prepare_report.json')); print({k: r[k] for k in ('compiled','scratch_pool','seconds')})"
  echo "=== replay_check $v"
  timeout 120 python3 -m flare.runtime.replay_check $d 2>&1 | tail -5 | cut -c1-3000
done
