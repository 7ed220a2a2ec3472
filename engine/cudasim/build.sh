#!/usr/bin/env bash
# Builds cudasim (CUDA on the CPU, see README.md "CUDA on the CPU") into OUT_DIR: one library
# that answers for the CUDA driver, NVRTC, cuBLAS(Lt) and NCCL, under each name cudarc loads.
# Put OUT_DIR first on LD_LIBRARY_PATH and kiln (whose default build carries the CUDA backend) runs
# `--device cuda` on the CPU.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUT_DIR}
CXX=${CXX:-c++}
command -v "$CXX" >/dev/null || { echo "cudasim needs a C++17 compiler ($CXX not found; Debian: g++)" >&2; exit 1; }
[ "$(uname -m)" = x86_64 ] || { echo "cudasim runs on x86-64 only (its fibers switch stacks in x86-64 code)" >&2; exit 1; }
mkdir -p "$out"
# The kernels' prelude: half.h (shared with cuBLASLt and NCCL here), then kernel_prelude.h.
{ echo 'R"KILNSIM('; cat "$here/half.h" "$here/kernel_prelude.h"; echo ')KILNSIM"'; } > "$out/kernel_prelude.inc"
"$CXX" -std=c++17 -O2 -g -fPIC -shared -Wall -Wextra -Wno-unused-parameter -I"$out" -I"$here" \
  -o "$out/libkilnsim.so.tmp" "$here"/driver.cpp "$here"/nvrtc.cpp "$here"/cublaslt.cpp "$here"/nccl.cpp -ldl -lpthread
mv "$out/libkilnsim.so.tmp" "$out/libkilnsim.so"
for name in libcuda.so libcuda.so.1 libnvrtc.so libnvrtc.so.13 libcublas.so libcublas.so.13 \
  libcublasLt.so libcublasLt.so.13 libnccl.so libnccl.so.2; do
  ln -sf libkilnsim.so "$out/$name"
done
echo "cudasim built in $out"
