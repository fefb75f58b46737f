# Sourced by scripts/install.sh and examples/run.sh: what this machine has, so
# that the scripts install and build only what it can run.

# [Note: which torch]
# A machine without torch gets torch==2.13.0. On Linux, PyPI's torch is the CUDA
# build (about 0.5 GB plus several GB of nvidia-* wheels), which a machine
# without a GPU cannot use; PyTorch's CPU index serves the CPU build (2.13.0+cpu).
# SHARDADAM_TORCH chooses:
#   auto (default)  cpu on Linux when no NVIDIA GPU is visible, pypi otherwise
#                   (macOS and Windows: PyPI's wheel is the CPU build already)
#   cpu             torch from SHARDADAM_TORCH_CPU_INDEX
#                   (default https://download.pytorch.org/whl/cpu)
#   pypi            the plain pin through pip's configured indexes
# When the CPU index cannot be reached (an offline machine whose pip reads a
# local mirror, CI), cpu falls back to the plain pin, saying so: a mirror then
# decides which build comes. An installed torch is always kept.

# True when an NVIDIA GPU is visible: nvidia-smi lists one and
# CUDA_VISIBLE_DEVICES does not hide them all (set empty, or -1).
gpu_visible() {
  if [ "${CUDA_VISIBLE_DEVICES+set}" = set ]; then
    case "$CUDA_VISIBLE_DEVICES" in ""|-1) return 1 ;; esac
  fi
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

# The visible GPUs' architectures as CMake wants them ("90", or "80;90" for a
# mixed host); empty when the driver cannot say (the build then takes its default).
gpu_architectures() {
  nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
    | tr -d ' .' | grep -E '^[0-9]+$' | sort -u | paste -sd ';' -
}

# Prints cpu or pypi (see [Note: which torch]); fails on any other SHARDADAM_TORCH.
torch_choice() {
  case "${SHARDADAM_TORCH:-auto}" in
    cpu | pypi) echo "$SHARDADAM_TORCH" ;;
    auto)
      if [ "$(uname -s)" = Linux ] && ! gpu_visible; then echo cpu; else echo pypi; fi ;;
    *)
      echo "SHARDADAM_TORCH='$SHARDADAM_TORCH' is not one of auto, cpu, pypi" >&2
      return 2 ;;
  esac
}

# True when a package index answers within 5 seconds.
index_reachable() {
  python3 - "$1" <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(urllib.request.Request(sys.argv[1].rstrip("/") + "/torch/", method="HEAD"),
                           timeout=5).close()
except Exception:
    sys.exit(1)
PY
}

# The pip arguments that install torch on this machine ([Note: which torch]);
# explains its choice on stderr.
torch_install_args() {
  local choice index
  choice="$(torch_choice)" || return
  index="${SHARDADAM_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  if [ "$choice" = cpu ]; then
    if index_reachable "$index"; then
      echo "torch: no NVIDIA GPU visible (or SHARDADAM_TORCH=cpu): the CPU build from $index" >&2
      echo "torch==2.13.0 --index-url $index"
      return
    fi
    echo "torch: $index cannot be reached: torch==2.13.0 through pip's configured indexes" \
         "(on PyPI for Linux that is the CUDA build)" >&2
  else
    echo "torch: torch==2.13.0 through pip's configured indexes (SHARDADAM_TORCH=$choice)" >&2
  fi
  echo "torch==2.13.0"
}
