#!/usr/bin/env bash
# One call on the GPU machine: build for Hopper, run the tests (GPU ones
# included) and bench_kernels.py with the given arguments, keeping logs under
# $OUT. Usage: bash scripts/device_run.sh [pytest args] -- [bench_kernels args]
# e.g. bash scripts/device_run.sh -q tests -- --device cuda --out $OUT/k.json
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES:-90} SHARDADAM_CUDA=ON
pytest_args=() bench_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do pytest_args+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift && bench_args=("$@")
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -m pip show nanobind scikit-build-core torch 2>/dev/null | grep -E "^(Name|Version)" | paste - - | tee -a "$out/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps . > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
python3 -c "import shardadam; print(shardadam.build_info())" | tee -a "$out/gpu.txt"
if [ ${#pytest_args[@]} -gt 0 ]; then
  python3 -m pytest "${pytest_args[@]}" 2>&1 | tee "$out/pytest.log" | tail -25
fi
if [ ${#bench_args[@]} -gt 0 ]; then
  python3 benchmarks/bench_kernels.py "${bench_args[@]}" 2>&1 | tee "$out/bench.log"
fi
