#!/usr/bin/env bash
# The GPU check for a lent device: one call, about 5 minutes on an H100 or H200. Runs in the
# repository root on a bare GPU machine with python3 (torch, transformers, safetensors, tokenizers,
# the NVIDIA wheels) and no network.
#
#   KILN_BIN=path/to/kiln  bash engine/benches/gpu-check.sh
#
# KILN_BIN: a release build (the CUDA backend is in the default build) made elsewhere and carried, stripped to fit the
# carry limit:  cargo build --release && strip -o carry/kiln target/release/kiln
# Without it the script builds one (needs cargo and the crates cached). Every model it uses is
# generated here. Results: tables on stdout as it goes, JSON under $OUT (default ./gpu-check-out).
#
# 1. nvidia-smi and the CUDA libraries found (NVRTC, cuBLASLt, NCCL);
# 2. kiln doctor, then kiln gpu-check: every kernel against a CPU reference, every op of the CUDA
#    backend against the CPU backend through the op trait, the NCCL all-reduce sweep, the one-shot
#    all-reduce kernel's protocol over 4 ranks (several per GPU here: real launches and flags, every
#    sum checked bit for bit; its speed against NCCL needs 2+ GPUs and is not measured here), and
#    one Kimi-K2-sized MoE layer (384 INT4 experts, 8 a token) at batch 1, 8, 64 and 128 with each
#    expert kernel (FMAs, tensor cores) forced in turn, beside its roofline;
# 3. gpu_check.py: tiny Llama 3 / Qwen2 / Qwen3 / Mistral served with --device cuda against
#    transformers on the GPU (greedy tokens, logprobs), then decode and prefill speed of a
#    Llama-3-8B-shaped model against its roofline and transformers, and kiln serve under kiln bench
#    at C = 1, 8, 64 with and without n-gram speculation. SKIP_SPEED=1 stops after parity.
set -uo pipefail
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
status=0
step() { echo; echo "=== $* ($(date +%T))"; }

step "nvidia-smi"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv | tee "$OUT/nvidia-smi.csv"

step "CUDA libraries"
# The toolkit's, else the ones pip's NVIDIA wheels (torch's dependencies) put under nvidia/.
dirs=$(python3 - <<'PY'
import glob, os
roots = ["/usr/local/cuda/lib64"] + glob.glob("/usr/local/cuda-13*/lib64")
try:
    import nvidia
    for p in nvidia.__path__:
        roots += glob.glob(os.path.join(p, "*", "lib"))
except ImportError:
    pass
print(":".join(r for r in roots if os.path.isdir(r)))
PY
)
export LD_LIBRARY_PATH="$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for lib in libnvrtc.so.13 libcublasLt.so.13 libnccl.so.2; do
  found=$(IFS=:; for d in $LD_LIBRARY_PATH; do ls "$d/$lib" 2>/dev/null; done | head -1)
  echo "$lib: ${found:-MISSING}"
done
# cudarc looks for libnccl.so (no soname suffix): give it a link beside the others.
nccl=$(IFS=:; for d in $LD_LIBRARY_PATH; do ls "$d/libnccl.so.2" 2>/dev/null; done | head -1)
if [ -n "$nccl" ]; then mkdir -p "$OUT/lib" && ln -sf "$nccl" "$OUT/lib/libnccl.so" && export LD_LIBRARY_PATH="$PWD/$OUT/lib:$LD_LIBRARY_PATH"; fi

BIN=${KILN_BIN:-}
if [ -z "$BIN" ]; then
  step "building kiln (no KILN_BIN given)"
  cargo build --release --offline || exit 1
  BIN=target/release/kiln
fi
BIN=$(realpath "$BIN")
"$BIN" --version

step "kiln doctor"
"$BIN" doctor 2>&1 | tee "$OUT/doctor.txt"

step "kiln gpu-check: kernels and backend ops against the CPU, NCCL sweep, one-shot protocol"
"$BIN" gpu-check --json "$OUT/gpu-check.json" 2>&1 | tee "$OUT/gpu-check.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "end to end: parity with transformers, speed, serving"
extra=()
[ "${SKIP_SPEED:-0}" = 1 ] && extra+=(--skip-speed)
python3 engine/benches/gpu_check.py --kiln "$BIN" --out "$OUT" "${extra[@]}" || status=1

step "done: status $status"
exit $status
