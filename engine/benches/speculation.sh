#!/usr/bin/env bash
# Speculation side by side, one run, same machine: kiln serve without speculation, with n-gram
# drafts verified every step (fixed, S=3), and with the adaptive policy (K in 0..=3 per step), each
# driven by ../shared/tools/loadgen.py (streaming coding prompts, closed loop, 200-token
# completions, ignore_eos). After each config the accept length is read from /metrics.
# With EAGLE3_DRAFT set to a draft-head directory (e.g. one made by engine/train/train_eagle3.py),
# EAGLE-3 chain drafts run too, fixed and adaptive, and trees (topk 4, 8 tokens verified).
# With LLAMA_SERVER set, llama.cpp's llama-server runs too, plain and with its n-gram speculation
# (`--spec-type ngram-simple`), for the peer comparison (built outside this repository).
#   [EAGLE3_DRAFT=DIR] [LLAMA_SERVER=...] bash engine/benches/speculation.sh [MODEL]        (LEVELS=1,4,16 by default)
# MODE=exact runs kiln's rows in exact mode (f32 weights and arithmetic) instead of fast.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf}
LOADGEN=${LOADGEN:-../shared/tools/loadgen.py}
LEVELS=${LEVELS:-1,4,16}
TOKENS=${TOKENS:-200}
MODE=${MODE:-fast}
ENDPOINT=${ENDPOINT:-completions}   # or chat (the chat template, as the EAGLE-3 head was trained)
# EOS=stop ends each completion at the model's end of turn (what users see); the default runs all
# TOKENS past it, where a small model loops (prompt lookup's best case, a trained draft's worst).
eos_flag=(); [ "${EOS:-ignore}" = stop ] && eos_flag=(--no-ignore-eos)
OUT=${OUT:-target/spec-bench}
mkdir -p "$OUT"
cargo build --release --quiet

wait_ready() { for _ in $(seq 600); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; return 1; }
port=18290
bench() { # label, then kiln serve flags
  local label=$1; shift; port=$((port + 1))
  [[ -n "${ROWS:-}" && ! "$label" =~ ^($ROWS) ]] && return 0   # ROWS='baseline|eagle3': a subset
  ./target/release/kiln serve --model "$MODEL" --port $port --served-model-name m --mode "$MODE" "$@" >/dev/null 2>&1 &
  local pid=$!
  wait_ready http://127.0.0.1:$port/ready
  python3 "$LOADGEN" --url http://127.0.0.1:$port --model m --concurrency "$LEVELS" \
    --max-tokens "$TOKENS" --endpoint "$ENDPOINT" "${eos_flag[@]}" --out "$OUT/$label.json" --label "$label"
  curl -s http://127.0.0.1:$port/metrics | awk -v l="$label" '
    /^kiln_spec_draft_tokens_total/ {d=$NF} /^kiln_spec_accepted_tokens_total/ {a=$NF}
    /^kiln_spec_accept_length_sum/ {s+=$NF} /^kiln_spec_accept_length_count/ {c+=$NF}
    END { if (c > 0) printf "%s: drafted %d, accepted %d (%.0f%%), mean accept length %.2f\n", l, d, a, 100*a/d, s/c;
          else printf "%s: no drafts\n", l }'
  kill $pid; wait $pid || true
}
bench baseline
bench ngram-fixed --speculative-algorithm ngram --speculative-policy fixed --speculative-num-steps 3
bench ngram-adaptive --speculative-algorithm ngram --speculative-num-steps 3
if [ -n "${EAGLE3_DRAFT:-}" ]; then
  eagle=(--speculative-algorithm eagle3 --speculative-draft-model-path "$EAGLE3_DRAFT" --speculative-num-steps 3)
  bench eagle3-fixed "${eagle[@]}" --speculative-policy fixed
  bench eagle3-adaptive "${eagle[@]}"
  tree=(--speculative-eagle-topk 4 --speculative-num-draft-tokens 8)
  bench eagle3-tree-fixed "${eagle[@]}" "${tree[@]}" --speculative-policy fixed
  bench eagle3-tree-adaptive "${eagle[@]}" "${tree[@]}"
fi
if [ -n "${LLAMA_SERVER:-}" ]; then
  peer() { # label, then llama-server flags
    local label=$1; shift; port=$((port + 1))
    "$LLAMA_SERVER" -m "$MODEL" --port $port -np 16 -c 16384 -t 2 "$@" >/dev/null 2>&1 &
    local pid=$!
    wait_ready http://127.0.0.1:$port/health
    python3 "$LOADGEN" --url http://127.0.0.1:$port --model m --concurrency "$LEVELS" \
      --max-tokens "$TOKENS" --endpoint "$ENDPOINT" "${eos_flag[@]}" --out "$OUT/$label.json" --label "$label"
    kill $pid; wait $pid || true
  }
  peer llama-server
  peer llama-server-ngram --spec-type ngram-simple
fi
