#!/usr/bin/env bash
# The per-token cost of constrained decoding: kiln serve on MODEL, the same requests with and
# without a JSON schema, at C = 1 and C = 16, in one run. The schema (an array of at least 100
# short strings) never completes within max_tokens, so every request, constrained or not, makes
# exactly TOKENS tokens and the rates compare token for token. Twice, in one run: without
# speculation, and with n-gram drafts (which guided requests check against their grammar).
#   bash engine/benches/constrained.sh [MODEL]
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf}
TOKENS=${TOKENS:-64}
cargo build --release --quiet
bench() {
./target/release/kiln serve --model "$MODEL" --port 18311 --served-model-name m "$@" >/dev/null 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do curl -sf http://127.0.0.1:18311/ready >/dev/null && break; sleep 0.2; done
python3 - "$TOKENS" <<'PY'
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor

tokens = int(sys.argv[1])
schema = {"type": "array", "minItems": 100,
          "items": {"type": "string", "minLength": 3, "maxLength": 12}}

def ask(i, constrained):
    body = {"model": "m", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"List {i + 3} fruits and vegetables."}]}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "list", "schema": schema}}
    req = urllib.request.Request("http://127.0.0.1:18311/v1/chat/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        v = json.load(r)
    assert v["usage"]["completion_tokens"] == tokens, v
    return v

def level(c, n, constrained):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        list(pool.map(lambda i: ask(i, constrained), range(n)))
    return n * tokens / (time.perf_counter() - t0)

ask(0, True)  # builds the token table once, outside the timings
rows = []
for c, n in [(1, 4), (16, 32)]:
    for rnd in range(2):
        for constrained in (False, True):
            rows.append((c, rnd, constrained, level(c, n, constrained)))
for c in (1, 16):
    free = [r[3] for r in rows if r[0] == c and not r[2]]
    held = [r[3] for r in rows if r[0] == c and r[2]]
    print(f"C={c}: unconstrained {' / '.join(f'{x:.1f}' for x in free)} tok/s, "
          f"JSON schema {' / '.join(f'{x:.1f}' for x in held)} tok/s, "
          f"ratio {sum(held) / sum(free):.3f}")
PY
kill $pid; wait $pid 2>/dev/null || true
}
echo "== without speculation"
bench
echo "== n-gram speculation (fixed policy)"
bench --speculative-algorithm ngram --speculative-policy fixed
