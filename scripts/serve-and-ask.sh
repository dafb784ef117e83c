#!/bin/bash
# Serve a prepared core, ask it one real question once it is ready, keep serving.
#   usage: scripts/serve-and-ask.sh CORE [PORT]
set -euo pipefail
CORE=$1
PORT=${2:-8000}
VENV=${VENV:-.venv}
"$VENV/bin/flare-serve" "$CORE" --port "$PORT" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT INT TERM
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "flare-serve exited during startup" >&2; exit 1; }
  sleep 0.5
done
MODEL_ID=$(curl -s "http://127.0.0.1:$PORT/v1/models" | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "== asking $MODEL_ID: What is the capital of France?"
curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d "{\"model\": \"$MODEL_ID\", \"seed\": 1, \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France? Answer in one word.\"}]}"
echo
echo "== serving on http://127.0.0.1:$PORT (Ctrl-C to stop)"
wait $SERVER
