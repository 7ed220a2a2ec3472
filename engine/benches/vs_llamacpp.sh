#!/usr/bin/env bash
# Side-by-side prefill/decode throughput: kiln (cargo bench --bench engine) and llama.cpp's llama-bench on
# the same GGUF, same threads, interleaved ROUNDS times so both see the same machine load. Only the
# same-run ratio is meaningful on a shared machine.
#
# llama.cpp is built outside this repository, for measurement only (see docs/performance.md):
#   LLAMA_BENCH=/path/to/llama-bench bash engine/benches/vs_llamacpp.sh [MODEL]
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${LLAMA_BENCH:?set LLAMA_BENCH to a llama-bench binary}"
MODEL=${1:-${KILN_BENCH_MODEL:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf}}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
cargo bench --bench engine --no-run >/dev/null 2>&1
for round in $(seq "$ROUNDS"); do
  echo "== round $round"
  "$LLAMA_BENCH" -m "$MODEL" -t "$THREADS" -p 512 -n 128 -r 2 -o md 2>/dev/null | grep -E 'pp512|tg128' |
    awk -F'|' '{gsub(/ /,"",$7); gsub(/^ +| +$/,"",$8); print "llama.cpp " $7 ": " $8 " tok/s"}'
  RAYON_NUM_THREADS=$THREADS KILN_BENCH_THREADS=$THREADS KILN_BENCH_MODEL=$MODEL KILN_BENCH_MODES=fast KILN_BENCH_REPS=2 \
    cargo bench --bench engine 2>/dev/null | grep -E 'fast:' | sed 's/^/kiln /'
done
