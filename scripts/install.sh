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
# The framework integrations' tests: transformers (+ accelerate, which its
# Trainer needs) and lightning. They only ask for torch>=2.x, so pip keeps the
# installed torch; the constraint pins it to the exact installed build
# (2.13.0+cpu here, a CUDA build on a GPU box) so that no resolver path can
# swap in another torch (PyPI's default Linux torch is the CUDA one).
for mod in transformers:transformers accelerate:accelerate lightning:lightning; do
  python3 -c "import ${mod%%:*}" 2>/dev/null || missing+=("${mod##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  pin="$(mktemp)"
  python3 -c "import torch; print('torch==' + torch.__version__)" > "$pin"
  python3 -m pip install -q -c "$pin" "${missing[@]}"
  rm -f "$pin"
fi
python3 -m pip install -q --no-build-isolation --no-deps .
python3 -c "import shardadam; print('shardadam', shardadam.__version__, shardadam.build_info())"
