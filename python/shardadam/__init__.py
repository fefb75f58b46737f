"""shardadam: distributed fused Adam (and Lion) for PyTorch on a compiled C++/CUDA core."""
from . import _core, checkpoint, kernels
from .distributed import DistributedFusedAdam, DistributedFusedLion
from ._state_dict import torch_adam_state_dict
from ._storage import BLOCKWISE8
from .fused_adam import FusedAdam
from .fused_lion import FusedLion

__version__ = _core.build_info()["version"]


def build_info() -> dict:
    """What the compiled core contains: CUDA kernels, architectures, runtime, devices."""
    return _core.build_info()


__all__ = ["BLOCKWISE8", "DistributedFusedAdam", "DistributedFusedLion", "FusedAdam", "FusedLion", "build_info", "checkpoint",
           "kernels", "torch_adam_state_dict", "__version__"]
