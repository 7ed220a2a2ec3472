#!/usr/bin/env bash
# The GPU check for a lent device (one call, well under 10 minutes). Runs in the repository root.
#
#   KILN_BIN=path/to/kiln  bash engine/benches/gpu-check.sh
#
# The device machine has no registry access, so either it has a Rust toolchain and the cargo
# registry cached, or KILN_BIN points at a `--features cuda` binary built elsewhere and carried
# (`cargo build --release --features cuda`, then strip it to fit the carry limit).
# Results: a table on stdout, JSON in $OUT (default ./gpu-check-out).
#
# What it checks today: the driver and libraries as kiln loads them (`kiln doctor`), and every CUDA
# kernel against its CPU reference on fresh random inputs with poisoned outputs (`kiln gpu-check`).
# Not yet: end-to-end greedy parity and decode tok/s against the HBM roofline, which need the CUDA
# backend behind the op trait (not built).
set -euo pipefail
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.csv"

# NVRTC: the toolkit's, else one shipped inside a Python package (torch brings its CUDA libraries).
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
  if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; break; fi
done
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

BIN=${KILN_BIN:-}
if [ -z "$BIN" ]; then
  cargo --version
  cargo build --release --features cuda --offline
  BIN=target/release/kiln
fi
"$BIN" --version
"$BIN" doctor | tee "$OUT/doctor.txt" || true
"$BIN" gpu-check --json "$OUT/gpu-check.json" | tee "$OUT/gpu-check.txt"
