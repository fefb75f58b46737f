"""DTensor parameters (FSDP2's fully_shard, tensor parallelism) in the fused optimizers.

[Note: DTensor parameters] A DTensor parameter is one rank's piece of a
global tensor (its local tensor: a shard, a replica, or nothing on a rank that
owns none of an unevenly sharded dim), and its gradient is a DTensor of the
same mesh and placements. The update rules are element-wise, so FusedAdam and
FusedLion step the local pieces exactly as they step plain tensors: a bucket
holds the local tensors (one launch per bucket, flat state), and LocalShards
maps the optimizer's parameters and their gradients to their local pieces
every step in C-level passes (``_local_tensor`` is the DTensor slot that
``to_local()`` returns without autograd), so the address checks of [Note:
tracked storage] see the memory the kernels use. What the optimizer hands out
(``state[p]``, ``state_dict()``) are DTensors of the parameter's mesh and
placements around the local pieces, so torch.distributed.checkpoint saves,
reshards and loads them as it does torch.optim's state; a load copies the
local pieces (of a full tensor: this rank's piece). Partial placements are
refused: their local values are not the parameter's. A host-state bucket
([Note: host state] in _host_state.py) keeps host copies of the local tensors
and hands out its state alike.

A step talks to other ranks only to agree on skipping non-finite gradients
(agree_on_flag): each rank sees its own shards only.
"""
from __future__ import annotations

import operator

import torch

from . import _addresses
from ._torch import check_tensor
from ._tracked import GRAD
from .kernels import FLOATS

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - a torch built without distributed support
    DTensor = None

LOCAL = operator.attrgetter("_local_tensor")
SPEC = operator.attrgetter("_spec")


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """What the kernels step for t: a DTensor's local tensor, a plain tensor itself."""
    return LOCAL(t) if is_dtensor(t) else t


def _layout_of(t) -> str:
    return f"{tuple(t.placements)} over {t.device_mesh}"


def check_param(where: str, p: torch.Tensor) -> None:
    """A parameter the fused optimizers can step: a plain tensor, or a DTensor
    whose local piece is one (placements Shard or Replicate)."""
    if not is_dtensor(p):
        check_tensor(where, p, p.device, FLOATS)
        return
    if any(placement.is_partial() for placement in p.placements):
        raise ValueError(f"{where} is a DTensor with a Partial placement ({_layout_of(p)}): its local values are "
                         "pending a reduction, not the parameter's; redistribute it to Shard or Replicate")
    local = LOCAL(p)
    check_tensor(f"{where} (its local tensor)", local, local.device, FLOATS)


def check_grad(where: str, p, g) -> None:
    """A DTensor parameter's gradient: a DTensor of its mesh and placements."""
    if not is_dtensor(g):
        raise ValueError(f"{where} is a plain {type(g).__name__}, the parameter a DTensor ({_layout_of(p)}): "
                         "give a DTensor parameter a DTensor gradient of its placements")
    if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
        raise ValueError(f"{where} is laid out as {_layout_of(g)}, the parameter as {_layout_of(p)}: the local "
                         "pieces would not match; redistribute the gradient to the parameter's placements")


def refuse_sharded_params(owner: str, param_groups: list[dict]) -> None:
    """The ZeRO optimizers shard plain parameters themselves: DTensor
    parameters are sharded already."""
    for gi, g in enumerate(param_groups):
        for i, p in enumerate(g["params"]):
            if is_dtensor(p):
                raise ValueError(
                    f"{owner}: param_groups[{gi}]['params'][{i}] is a DTensor ({_layout_of(p)}): the parameters are "
                    "already sharded (FSDP2's fully_shard, or tensor parallelism), and this optimizer shards plain "
                    "parameters itself. Use shardadam.FusedAdam / shardadam.FusedLion, which step each rank's "
                    "local shards, or build this optimizer on the unsharded model")


class PlainTensors:
    """A bucket of plain tensors: the parameters are what the kernels step."""

    meshes: tuple = ()

    @staticmethod
    def tensors(params: list) -> list:
        return params

    @staticmethod
    def grads(params: list, grad_of=GRAD) -> list:
        if grad_of is GRAD:  # [Note: the tensor scan] in _addresses.py
            return _addresses.grads(params)
        return list(map(grad_of, params))

    @staticmethod
    def grads_and_records(params: list, grad_of=GRAD) -> tuple[list, object]:
        """``grads``, and their ``_addresses.memory_records`` (None when a
        gradient is missing or has no storage)."""
        if grad_of is GRAD:
            return _addresses.grads_and_records(params)
        return _with_records(list(map(grad_of, params)))

    @staticmethod
    def wrap(local: torch.Tensor, param) -> torch.Tensor:
        return local


def _with_records(grads: list) -> tuple[list, object]:
    try:
        return grads, _addresses.memory_records(grads)
    except (TypeError, RuntimeError):  # None (no gradient), or a sparse gradient
        return grads, None


PLAIN = PlainTensors()


class LocalShards:
    """A bucket of DTensor parameters: the kernels step their local tensors
    (see [Note: DTensor parameters])."""

    def __init__(self, params: list, names: list[str]):
        self.names = names
        # The meshes of the parameters, in parameter order (the same on every rank).
        meshes = {}
        for p in params:
            meshes.setdefault(id(p.device_mesh), p.device_mesh)
        self.meshes = tuple(meshes.values())
        self._checked_specs: list | None = None  # the gradients' specs last found to match

    @staticmethod
    def tensors(params: list) -> list:
        """The parameters' local tensors (one C-level pass)."""
        return list(map(LOCAL, params))

    def grads(self, params: list, grad_of=GRAD) -> list:
        """The local tensors of the parameters' gradients (None where a
        parameter has none). A gradient must be a DTensor of its parameter's
        mesh and placements; its spec objects, once checked, are recognised by
        identity (FSDP2 builds every gradient with its parameter's spec)."""
        # DTensor's __torch_function__ is torch's disabled one: reading .grad
        # with it off is the same read, at a third of the host cost.
        with torch._C.DisableTorchFunctionSubclass():
            grads = list(map(grad_of, params))
        try:
            specs = list(map(SPEC, grads))
        except AttributeError:  # a missing gradient, or a plain tensor: told apart below
            return [None if g is None else self._local_grad(i, params[i], g) for i, g in enumerate(grads)]
        if self._checked_specs is None or not all(map(operator.is_, specs, self._checked_specs)):
            for i, (p, g) in enumerate(zip(params, grads)):
                self._local_grad(i, p, g)
            self._checked_specs = specs
        return list(map(LOCAL, grads))

    def grads_and_records(self, params: list, grad_of=GRAD) -> tuple[list, object]:
        """As ``PlainTensors.grads_and_records``, for the local tensors."""
        return _with_records(self.grads(params, grad_of))

    def _local_grad(self, i: int, p, g) -> torch.Tensor:
        check_grad(f"the gradient of {self.names[i]}", p, g)
        return LOCAL(g)

    @staticmethod
    def wrap(local: torch.Tensor, param) -> torch.Tensor:
        """A DTensor of param's mesh, placements and global shape around a
        local tensor (a state view: the DTensor shares its memory)."""
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())


def shards_for(params: list, names: list[str]):
    """How a bucket of these parameters (all DTensors, or all plain) reaches its local tensors."""
    return LocalShards(params, names) if is_dtensor(params[0]) else PLAIN


def local_value(where: str, value: torch.Tensor, param, param_name: str) -> torch.Tensor:
    """The tensor a load copies into the optimizer's (local) state of param
    (the caller checked that its global shape is param's): the value itself
    for a plain parameter; for a DTensor parameter, the local tensor of a
    DTensor value of the same mesh and placements, or this rank's piece of a
    full (plain) value, cut here without communication (every rank of a full
    state dict holds the whole value)."""
    if not is_dtensor(param):
        if is_dtensor(value):
            raise ValueError(f"{where} is a DTensor ({_layout_of(value)}) but {param_name} is a plain tensor: "
                             "gather it first (value.full_tensor()), or load it into the sharded model's optimizer")
        return value
    if not is_dtensor(value):
        return LOCAL(distribute_tensor(value.detach(), param.device_mesh, param.placements, src_data_rank=None))
    if value.device_mesh != param.device_mesh or tuple(value.placements) != tuple(param.placements):
        raise ValueError(f"{where} is laid out as {_layout_of(value)}, its parameter {param_name} as "
                         f"{_layout_of(param)}: load through torch.distributed.checkpoint (dcp.load into "
                         "get_optimizer_state_dict's dict reshards), or redistribute it to the parameter's placements")
    return LOCAL(value)


def agree_on_flag(flag: torch.Tensor | None, buckets: list) -> torch.Tensor | None:
    """The largest of every rank's flag (a 0-d float32 tensor, None: no
    gradient here) over the meshes of the buckets' DTensor parameters: one
    all-reduce per mesh dimension, in parameter order on every rank. Plain
    parameters only: the flag as it is."""
    meshes = {}
    for b in buckets:
        for mesh in b.shards.meshes:
            meshes.setdefault(id(mesh), mesh)
    if not meshes:
        return flag
    if flag is None:
        flag = torch.zeros((), dtype=torch.float32, device=buckets[0].device)
    for mesh in meshes.values():
        for dim in range(mesh.ndim):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return flag
