#!/usr/bin/env bash
# Two kiln binaries side by side, one run, same machine: each serves the same model with the same
# flags, driven by ../shared/tools/loadgen.py (streaming coding prompts, closed loop, ignore_eos),
# alternating A, B, A, B so drift in the machine's speed hits both. Prints output tok/s per
# concurrency level and the B/A ratio of each round.
#   bash engine/benches/ab.sh OLD_BIN NEW_BIN [kiln serve flags...]
# LEVELS=1,4,16, TOKENS=128, ROUNDS=2, MODEL=the default model.
set -euo pipefail
cd "$(dirname "$0")/../.."
A=$1; B=$2; shift 2
MODEL=${MODEL:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf}
LOADGEN=${LOADGEN:-../shared/tools/loadgen.py}
LEVELS=${LEVELS:-1,4,16}
TOKENS=${TOKENS:-128}
ROUNDS=${ROUNDS:-2}
OUT=${OUT:-target/ab-bench}
mkdir -p "$OUT"
for f in "$A" "$B" "$LOADGEN" "$MODEL"; do [ -e "$f" ] || { echo "ab.sh: $f is missing" >&2; exit 1; }; done

wait_ready() { for _ in $(seq 600); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done; return 1; }
port=18390
run() { # label, binary, then kiln serve flags
  local label=$1 bin=$2; shift 2; port=$((port + 1))
  "$bin" serve --model "$MODEL" --port $port --served-model-name m "$@" >"$OUT/$label.log" 2>&1 &
  local pid=$!
  wait_ready http://127.0.0.1:$port/ready || { echo "$label: never ready (see $OUT/$label.log)" >&2; kill $pid; exit 1; }
  python3 "$LOADGEN" --url http://127.0.0.1:$port --model m --concurrency "$LEVELS" \
    --max-tokens "$TOKENS" --out "$OUT/$label.json" --label "$label" >/dev/null
  kill $pid; wait $pid || true
}
tok_s() { python3 -c 'import json,sys; print(" ".join(str(l["summary"]["output_tok_s"]) for l in json.load(open(sys.argv[1]))["levels"]))' "$1"; }
echo "C = $LEVELS, flags: ${*:-(none)}"
for r in $(seq "$ROUNDS"); do
  run "a$r" "$A" "$@"
  run "b$r" "$B" "$@"
  a=$(tok_s "$OUT/a$r.json"); b=$(tok_s "$OUT/b$r.json")
  ratio=$(python3 -c 'import sys; a=sys.argv[1].split(); b=sys.argv[2].split(); print(" ".join(f"{float(y)/float(x):.3f}" for x,y in zip(a,b)))' "$a" "$b")
  echo "round $r: A $a | B $b | B/A $ratio"
done
