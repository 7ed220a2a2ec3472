#!/usr/bin/env bash
# Prefix caching side by side: kiln serve with its prefix cache (the default) and llama.cpp's
# llama-server with its prompt cache (per-slot prefix reuse, on by default), one after the other in
# one run, on the shared-prefix workloads of `kiln bench` (shared-doc: questions over one
# ~1,400-token document; multi-turn: one conversation growing a turn per request). With
# KILN_OFF=1 kiln also runs with --no-prefix-cache (slow: every prompt prefilled in full).
#
# llama-server is built outside this repository, for measurement only (see docs/performance.md):
#   LLAMA_SERVER=/path/to/llama-server bash engine/benches/prefix_cache.sh [MODEL]
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}"
MODEL=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-target/prefix-bench}
mkdir -p "$OUT"
cargo build --release --quiet
KILN=./target/release/kiln

wait_ready() { for _ in $(seq 600); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; return 1; }
sweep() { # label url: shared-doc at C = 1 and 4 (12 questions), 16 (32); multi-turn at C = 1
  for level in 1:12:shared-doc 4:12:shared-doc 16:32:shared-doc 1:16:multi-turn; do
    IFS=: read -r c n dataset <<<"$level"
    "$KILN" bench --url "$2" --label "$1" --dataset "$dataset" --concurrency "$c" \
      --num-prompts "$n" --max-tokens 32 --out "$OUT/$1-$dataset-c$c" | tail -n 3
  done
}
serve_kiln() { # label port flags...
  local label=$1 port=$2; shift 2
  "$KILN" serve --model "$MODEL" --port "$port" "$@" >/dev/null 2>&1 &
  local pid=$!
  wait_ready "http://127.0.0.1:$port/ready"
  sweep "$label" "http://127.0.0.1:$port"
  echo "$label prefilled tokens: $(curl -s "http://127.0.0.1:$port/metrics" | grep '^kiln_prefill_tokens_total')"
  kill "$pid"; wait "$pid" || true
}

serve_kiln kiln 18191
[ "${KILN_OFF:-0}" = 1 ] && serve_kiln kiln-no-cache 18192 --no-prefix-cache
# 16 slots of 4,096 tokens each: the longest multi-turn request fits a slot.
"$LLAMA_SERVER" -m "$MODEL" --port 18193 -np 16 -c 65536 -t 2 >/dev/null 2>&1 &
pid=$!; wait_ready http://127.0.0.1:18193/health; sweep llama-server http://127.0.0.1:18193
kill $pid; wait $pid || true
