#!/usr/bin/env bash
# On a CUDA machine: build turbomq._native with the kernels (cmake, no pip),
# run tests/gpu, then the kernel benchmark. Logs and results go to $OUT
# (default build/gpu-results); copy kernels.md/kernels.json to docs/benchmarks/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-results}
PY=${PYTHON:-python3}
BUILD=build/cuda
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
  | tee "$OUT/env.txt"
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/env.txt"

cmake -S native -B "$BUILD" -G Ninja -DTURBOMQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -Dpybind11_DIR="$($PY -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v "$PY")" \
  > "$OUT/build.log" 2>&1 \
  && cmake --build "$BUILD" -j "$(nproc)" >> "$OUT/build.log" 2>&1
status=$?
tail -n 5 "$OUT/build.log"
if [ $status -ne 0 ]; then
  cat "$OUT/build.log"
  echo "BUILD FAILED"
  exit 1
fi

# A turbomq package tree: the Python sources plus the freshly built extension.
PKG="$BUILD/pkg/turbomq"
mkdir -p "$PKG"
for d in broker worker clients monitoring; do ln -sfn "$PWD/$d" "$PKG/$d"; done
cp "$BUILD"/_native*.so "$PKG/"
export PYTHONPATH="$PWD/$BUILD/pkg"

$PY -m pytest tests/gpu tests/test_cuda_sources.py -q -rs -p no:cacheprovider 2>&1 \
  | tee "$OUT/tests.log" | tail -n 40
tests=${PIPESTATUS[0]}

$PY benchmarks/gpu_kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, benchmark exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
