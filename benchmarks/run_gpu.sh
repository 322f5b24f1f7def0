#!/usr/bin/env bash
# On a CUDA machine: build turbomq._native with the kernels (cmake, no pip),
# run tests/gpu, then the benchmarks named in $BENCH (default: kernels engine).
# Logs and results go to $OUT (default build/gpu-results); copy the .md/.json/.png
# results to docs/benchmarks/. Extra engine-benchmark flags: $ENGINE_ARGS.
# TESTS=0 skips tests/gpu; TEST_ARGS adds pytest arguments. BENCH=tensor_parallel
# needs 2 GPUs; BENCH= (empty) runs none. TURBOMQ_BROKER=ON (with CMAKE_ARGS pointing at libzmq where it
# is not installed) builds the broker's data plane too, for `turbomq up`.
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

# The broker's data plane (libzmq) is not needed for GPU checks.
# shellcheck disable=SC2086
cmake -S native -B "$BUILD" -G Ninja -DTURBOMQ_CUDA=ON -DTURBOMQ_BROKER="${TURBOMQ_BROKER:-OFF}" \
  -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-} \
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

tests=0
if [ "${TESTS:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  $PY -m pytest tests/gpu tests/native/test_cuda_sources.py -q -rs -p no:cacheprovider ${TEST_ARGS:-} 2>&1 \
    | tee "$OUT/tests.log" | tail -n 40
  tests=${PIPESTATUS[0]}
fi

bench=0
for b in ${BENCH-kernels engine}; do
  extra=""
  [ "$b" = engine ] && extra=${ENGINE_ARGS:-}
  # shellcheck disable=SC2086
  $PY "benchmarks/gpu_$b.py" --out "$OUT" $extra 2>&1 | tee "$OUT/bench-$b.log" | tail -n 60
  [ "${PIPESTATUS[0]}" -eq 0 ] || bench=1
done
echo "tests exit $tests, benchmarks exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
