#!/usr/bin/env bash
# The OpenAI-compatible server under load, one provider after another on the same machine:
#   bash scripts/serve_bench.sh [PROVIDER ...]        (default: cuda cpu; embedded model)
# Each server starts on 127.0.0.1 at a free port, gets 1, 16 and 32 streaming clients
# (scripts/serve_load.py, after one untimed request per client), each load read once by the
# openai client and once by a plain httpx line reader (the client's own parsing cost apart),
# prints its graph replays and fallbacks from /metrics and is stopped by its process id. SERVE_ARGS adds arguments (e.g. --model DIR).
# Needs the serve and test extras (starlette, uvicorn, openai). Server logs go to $OUT.
set -u
PY="${PYTHON:-python3}"
LOGDIR="${OUT:-/tmp/serve_bench}"
mkdir -p "$LOGDIR"
PROVIDERS=("$@")
[ ${#PROVIDERS[@]} -gt 0 ] || PROVIDERS=(cuda cpu)
free_port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
for prov in "${PROVIDERS[@]}"; do
  port=$(free_port)
  # shellcheck disable=SC2086
  "$PY" -m onnx_genrt serve --provider "$prov" --max-batch 16 --port "$port" ${SERVE_ARGS:-} \
    >"$LOGDIR/serve-$prov.log" 2>&1 &
  pid=$!
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  echo "== $prov (pid $pid, port $port)"
  for load in "16 1" "64 16" "128 32"; do
    set -- $load
    for reader in openai httpx; do
      "$PY" scripts/serve_load.py --url "http://127.0.0.1:$port" --requests "$1" --clients "$2" \
        --max-tokens 64 --reader "$reader"
    done
  done
  curl -s "http://127.0.0.1:$port/metrics" | grep -E "^onnx_genrt_graph_(replays|fallbacks)"
  kill "$pid"
  wait "$pid"
  echo "server exit code $?"
done
