set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD FLARE_CACHE_DIR=/tmp/fc
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers, cuda.bindings as cb; print('versions', torch.__version__, triton.__version__, transformers.__version__, cb.__version__)"
for v in "gather --no-compile" "gather"; do
  set -- $v
  d=/tmp/core-$1-$#
  echo "=== prepare llama-tiny attention=$v"
  timeout 240 python3 -m flare.prepare.cli llama-tiny --out $d --device cuda --attention $v --context-limit 1024 --prefill-chunk-size 256 --kv-pages 256 --qualify 2 --scratch-memory 2 2>&1 | tail -40
  cat $d/prepare_report.json 2>/dev/null | head -60
  echo "=== replay_check $v"
  timeout 120 python3 -m flare.runtime.replay_check $d 2>&1 | tail -20
done
