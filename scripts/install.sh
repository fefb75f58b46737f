#!/usr/bin/env bash
# Installs what shardadam needs to build and test, then builds and installs it.
# Installs only what is missing: on a machine that already has torch (a GPU
# box with a CUDA build, say) its torch is kept. A fresh machine gets the CPU
# build of torch 2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0"
missing=()
for mod in nanobind:nanobind scikit_build_core:scikit-build-core ninja:ninja pytest:pytest \
           hypothesis:hypothesis numpy:numpy; do
  python3 -c "import ${mod%%:*}" 2>/dev/null || missing+=("${mod##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then python3 -m pip install -q "${missing[@]}"; fi
python3 -m pip install -q --no-build-isolation --no-deps .
python3 -c "import shardadam; print('shardadam', shardadam.__version__, shardadam.build_info())"
