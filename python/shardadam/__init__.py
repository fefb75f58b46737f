"""shardadam: distributed fused Adam (and Lion) for PyTorch on a compiled C++/CUDA core."""
import os as _os

# The core reads SHARDADAM_CPU_GATHERS when it loads ([Note: CPU gathers] in cpp/cpu_gather.h).
if _os.environ.get("SHARDADAM_CPU_GATHERS", "avx512") not in ("plain", "avx2", "avx512"):
    raise ImportError(f"SHARDADAM_CPU_GATHERS={_os.environ['SHARDADAM_CPU_GATHERS']!r}: use plain, avx2 or "
                      "avx512 (the widest gathers the CPU engine may use), or unset it")

from . import _addresses, _core, checkpoint, kernels
from .distributed import DistributedFusedAdam, DistributedFusedLion, DistributedFusedMuon
from ._state_dict import torch_adam_state_dict
from ._storage import BLOCKWISE8
from .fused_adam import FusedAdam
from .fused_lion import FusedLion
from .fused_muon import FusedMuon

__version__ = _core.build_info()["version"]


def build_info() -> dict:
    """What the compiled core contains: CUDA kernels, architectures, runtime, devices, and the
    CPU engine's instruction sets (cpu_isa; cpu_gathers, its 8-bit states' table reads); and
    tensor_scan: whether each step reads its tensors' addresses in one C pass (built against
    this very torch) or through torch's Python API ([Note: the tensor scan] in _addresses.py)."""
    return _core.build_info() | {"tensor_scan": _addresses.SCAN_IN_C}


__all__ = ["BLOCKWISE8", "DistributedFusedAdam", "DistributedFusedLion", "DistributedFusedMuon", "FusedAdam", "FusedLion", "FusedMuon", "build_info", "checkpoint",
           "kernels", "torch_adam_state_dict", "__version__"]
