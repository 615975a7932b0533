#!/usr/bin/env bash
# Reproduce the serving figures of docs/benchmarks.md on this machine (about 15 minutes):
# the headline table (bench compare) and the concurrency sweeps of llmaccel and the HF baseline.
# Run from the repository root after `make setup`, on an otherwise quiet machine.
set -euo pipefail
BIN=.venv/bin
OUT=${OUT:-docs/results}
IMG=${IMG:-docs/img}
mkdir -p "$OUT/sweep" "$IMG"

wait_ready() {  # $1: port
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0
    sleep 1
  done
  echo "server on port $1 did not come up" >&2
  return 1
}

# 1. The headline table: HF baseline server vs llmaccel, one after the other.
if [ -z "${SKIP_COMPARE:-}" ]; then
  $BIN/llmaccel bench compare --result-json "$OUT/compare.json" | tee "$OUT/compare.md"
fi

# 2. llmaccel over concurrency 1..64 (64 tokens per request, built-in prompts).
$BIN/llmaccel serve --port 8000 > /tmp/llmaccel-serve.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2> /dev/null || true' EXIT
wait_ready 8000
$BIN/llmaccel bench sweep --base-url http://127.0.0.1:8000 --concurrency 1,4,16,64 --num-prompts 16 \
  --output-len 64 --ignore-eos --label llmaccel --result-dir "$OUT/sweep" --plot-dir /tmp/llmaccel-plots
kill $SERVER; wait $SERVER || true

# 3. The HF baseline (one request at a time) over concurrency 1..16: its throughput cannot grow.
$BIN/llmaccel bench hf-server --port 8001 > /tmp/hf-server.log 2>&1 &
SERVER=$!
wait_ready 8001
$BIN/llmaccel bench sweep --base-url http://127.0.0.1:8001 --concurrency 1,4,16 --num-prompts 8 \
  --min-prompts-per-concurrency 1 --output-len 64 --ignore-eos --label hf-baseline --result-dir "$OUT/sweep" \
  --plot-dir /tmp/llmaccel-plots
kill $SERVER; wait $SERVER || true

# 4. One table and two plots for both servers.
$BIN/llmaccel bench plot "$OUT"/sweep/*.json --out-dir "$IMG" --prefix serve | tee "$OUT/sweep.md"
