#!/usr/bin/env bash
# Installs what shardadam needs to build and test, then builds and installs it
# from this checkout. Only what is missing is installed, and an installed torch
# is kept (a GPU box's CUDA build, say). A machine without torch gets
# torch==2.13.0, the CPU build where no GPU is visible: [Note: which torch] in
# scripts/machine.sh (SHARDADAM_TORCH=auto|cpu|pypi).
# Usage: bash scripts/install.sh [--dry-run]   (--dry-run: print the pip
# commands it would run, run none)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/machine.sh

dry_run=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    *) echo "scripts/install.sh: unknown argument '$arg' (accepted: --dry-run)" >&2; exit 2 ;;
  esac
done
run() {
  if [ "$dry_run" = 1 ]; then echo "would run: $*"; else "$@"; fi
}
# Looks a module up without importing it: importing torch before numpy is
# installed prints "Failed to initialize NumPy".
installed() {
  python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"
}

# numpy before torch, for the same reason.
installed numpy || run python3 -m pip install -q numpy
if ! installed torch; then
  torch_args="$(torch_install_args)"
  # shellcheck disable=SC2086  # the arguments are split on purpose
  run python3 -m pip install -q $torch_args
fi
missing=()
for mod in nanobind:nanobind scikit_build_core:scikit-build-core ninja:ninja pytest:pytest \
           hypothesis:hypothesis; do
  installed "${mod%%:*}" || missing+=("${mod##*:}")
done
# The framework integrations' tests: transformers (+ accelerate, which its
# Trainer needs) and lightning. They only ask for torch>=2.x, so pip keeps the
# installed torch; the constraint pins it to the exact installed build
# (2.13.0+cpu, or a CUDA build on a GPU box) so that no resolver path can
# swap in another torch (PyPI's default Linux torch is the CUDA one).
for mod in transformers:transformers accelerate:accelerate lightning:lightning; do
  installed "${mod%%:*}" || missing+=("${mod##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  pin="$(mktemp)"
  if [ "$dry_run" = 1 ] && ! installed torch; then
    echo "torch==<the torch installed above>" > "$pin"
  else
    python3 -c "import torch; print('torch==' + torch.__version__)" > "$pin"
  fi
  [ "$dry_run" = 1 ] && echo "constraint: $(cat "$pin")"
  run python3 -m pip install -q -c "$pin" "${missing[@]}"
  rm -f "$pin"
fi
echo "building shardadam: SHARDADAM_CUDA=${SHARDADAM_CUDA:-AUTO}" \
     "CMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES:-default (80;90)}"
run python3 -m pip install -q --no-build-isolation --no-deps .
if [ "$dry_run" = 0 ]; then
  python3 -c "import shardadam; print('shardadam', shardadam.__version__, shardadam.build_info())"
fi
