#!/usr/bin/env bash
# Serving throughput side by side: kiln serve and llama.cpp's llama-server on the same GGUF and
# machine, one after the other in one run, each driven by ../shared/tools/loadgen.py (streaming,
# closed loop at C = 1, 4, 16, 200-token completions, ignore_eos). Also kiln with --no-overlap, to
# show what moving detokenization off the engine thread buys. Only same-run ratios are meaningful.
#
# llama-server is built outside this repository, for measurement only (see docs/performance.md):
#   LLAMA_SERVER=/path/to/llama-server bash engine/benches/vs_llama_server.sh [MODEL]
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}"
MODEL=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf}
LOADGEN=${LOADGEN:-../shared/tools/loadgen.py}
LEVELS=${LEVELS:-1,4,16}
TOKENS=${TOKENS:-200}
OUT=${OUT:-target/serve-bench}
mkdir -p "$OUT"
cargo build --release --quiet

wait_ready() { for _ in $(seq 600); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; return 1; }
run() { # label url
  python3 "$LOADGEN" --url "$2" --model m --concurrency "$LEVELS" --max-tokens "$TOKENS" \
    --out "$OUT/$1.json" --label "$1" | tail -n +1
}

./target/release/kiln serve --model "$MODEL" --port 18181 --served-model-name m >/dev/null 2>&1 &
pid=$!; wait_ready http://127.0.0.1:18181/ready; run kiln http://127.0.0.1:18181; kill $pid; wait $pid || true

./target/release/kiln serve --model "$MODEL" --port 18182 --served-model-name m --no-overlap >/dev/null 2>&1 &
pid=$!; wait_ready http://127.0.0.1:18182/ready; LEVELS=16 run kiln-no-overlap http://127.0.0.1:18182; kill $pid; wait $pid || true

"$LLAMA_SERVER" -m "$MODEL" --port 18183 -np 16 -c 16384 -t 2 >/dev/null 2>&1 &
pid=$!; wait_ready http://127.0.0.1:18183/health; run llama-server http://127.0.0.1:18183; kill $pid; wait $pid || true
