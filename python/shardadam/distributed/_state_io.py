"""The engine's state and checkpoint I/O: this rank's shard of the master and
the rule's states read as true fp32 values and written from them ([Note:
storage codecs] in ../_storage.py), the portable state dict (any world size,
apex's format 2) and the sharded one (sharded_checkpoint.py).
ShardedOptimizer (optimizer.py) inherits these methods; a layout rebuild
carries the state through _portable_state_dict() and _load()."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .. import _storage
from .._groups import pack_groups, plain_value, set_group_values
from .._state_dict_check import check_state_dict
from .._state_dict_hooks import run_load_post_hooks, state_dict_through_hooks, through_load_pre_hooks
from . import _apex_format, sharded_checkpoint
from ._agreement import validate_then_agree
from ._flat import flat_like, memory_flat

__all__ = ["StateIO"]

# torch 2.13 renamed the flat-tensor collectives; older releases have only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _unflatten(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of flat_like, allocated before it is filled: an uninitialised
    fp32 CPU tensor shaped (and laid out) like param, and its 1-D view in
    memory order, into which state_dict() copies each fragment once."""
    t = torch.empty_like(param, dtype=torch.float32, device="cpu")
    return t, memory_flat(t)


class StateIO:
    """Mixed into ShardedOptimizer: its layout, shards and stored state are theirs."""

    def state_buffer(self, name: str) -> torch.Tensor | None:
        """This rank's [buckets, shard] buffer of a state ("master": the
        separate master, None without one), as stored."""
        return self.master if name == "master" else self.states[name]

    def _state_row(self, name: str, b: int) -> torch.Tensor:
        """Bucket b of this rank's shard of a state, as true fp32 values (a new
        tensor: [Note: storage codecs] in _storage.py)."""
        if name == "master" and self.remainders is not None:
            return _storage.joined_master(self.param_shards[b], self.remainders[b])
        if name == "master" and self.master is None:  # store_params=False
            return _storage.true_values(self.param_shards[b])
        stored = self.state_buffer(name)[b]
        if name not in self.state_scales and name not in self.state_blocks:
            return _storage.true_values(stored)
        row = torch.zeros(stored.shape, dtype=torch.float32, device=stored.device)  # padding holds zeros
        for f in self._shard_fragments_by_bucket[b]:
            codec = self._fragment_codec(name, self._fragment_index[(b, f.shard_start)])
            row[f.shard_start:f.shard_end] = _storage.true_values(stored[f.shard_start:f.shard_end], **codec)
        return row

    def _fragment_codec(self, name: str, j: int) -> dict:
        """How fragment j of a state is stored: its scale or block maxima (_storage.codec)."""
        views = {}
        if name in self.state_scales:
            views[f"{name}_scale"] = self.state_scales[name][j:j + 1]
        if name in self.state_blocks:
            views[f"{name}_absmax"] = self.state_blocks[name][j]
        return _storage.codec(views, name)

    def _write_state(self, name: str, f, values: torch.Tensor) -> None:
        """Store fp32 values into shard fragment f of a state."""
        where = (f.bucket, slice(f.shard_start, f.shard_end))
        if name == "master" and self.remainders is not None:
            _storage.split_master(values, self.param_shards[where], self.remainders[where])
        elif name == "master" and self.master is None:  # store_params=False
            _storage.store(self.param_shards[where], values)
        elif name in self.state_scales or name in self.state_blocks:  # each fragment its own scale or maxima
            j = self._fragment_index[(f.bucket, f.shard_start)]
            _storage.store(self.state_buffer(name)[where], values, **self._fragment_codec(name, j))
        else:
            _storage.store(self.state_buffer(name)[where], values)
        if name == "master":
            self._master_written(f)

    def _master_written(self, f) -> None:
        """A master written outside a step (init_params, a checkpoint): the
        parameter shard follows it, so that the next all-gather sends it
        (with host state, once it is up: [Note: host shards])."""
        if self.separate_param_shards:
            where = (f.bucket, slice(f.shard_start, f.shard_end))
            j = self._fragment_index[(f.bucket, f.shard_start)]
            self.param_shards[where].copy_(_storage.true_values(self.master[where],
                                                                **self._fragment_codec("master", j)))
        if self._host is not None:
            self._host.stale = True

    def sharded_state_dict(self) -> dict:
        """Only this rank's pieces, for torch.distributed.checkpoint: see
        distributed/sharded_checkpoint.py (a checkpoint of N ranks loads on M)."""
        self._refuse_mid_host_step("sharded_state_dict()")
        return sharded_checkpoint.sharded_state_dict(self)

    def check_sharded_checkpoint(self, checkpoint_id, key: str = "optim") -> None:
        """Before dcp.load: refuse a DCP checkpoint whose sharded_state_dict()
        (under `key`) was written for other parameters, naming the first that
        differs, on every rank, with nothing read into the optimizer. A
        collective: every rank of the optimizer's group calls it."""
        sharded_checkpoint.check_checkpoint(self, checkpoint_id, key)

    def load_sharded_state_dict(self, sharded: dict) -> None:
        """Take a sharded_state_dict() structure that dcp.load has filled."""
        self._refuse_mid_host_step("load_sharded_state_dict()")
        self._land_param_sync()
        sharded_checkpoint.load_sharded_state_dict(self, sharded)

    def state_dict(self, *, state_dict_format: int | None = None, gather_on_root: bool | None = None) -> dict | None:
        """Portable state: per parameter (index in param_groups order) the fp32
        ``param`` master and the rule's states (Adam: ``exp_avg`` and
        ``exp_avg_sq``) as full tensors, plus the
        groups' hyperparameters and steps. Independent of world size and bucket
        size: it loads on any number of ranks. The shards are gathered one
        bucket at a time (one bucket of extra device memory, one copy to the
        host per bucket and state, each fragment then copied once into its
        parameter's tensor); every rank gets the whole dict, or with
        gather_on_root=True only rank 0 of process_group receives the shards
        (a gather, not an all-gather) and builds it in host memory, and the
        others get None. Every rank must call it.

        state_dict_format=2: apex's format 2 (_apex_format.py: the same
        tensors, plus ``"format": 2`` and apex's ``state["step"]``), which
        apex's DistributedFusedAdam loads. Format 1 (apex's pickled buckets)
        is not written."""
        if state_dict_format not in (None, _apex_format.FORMAT):
            raise ValueError(f"state_dict_format must be None (shardadam's portable dict) or 2 (apex's format 2, "
                             f"the same tensors), got {state_dict_format!r}: apex's format 1 pickles its internal "
                             f"buckets and is not written")
        self._refuse_mid_host_step("state_dict()")

        def built():
            portable = self._portable_state_dict(bool(gather_on_root))
            return _apex_format.to_apex(portable) if portable is not None and state_dict_format else portable
        return state_dict_through_hooks(self, built)  # [Note: state-dict hooks] in .._state_dict_hooks

    def _portable_state_dict(self, gather_on_root: bool) -> dict | None:
        if not all(self._initialized):  # the state a first step would start from
            self.init_params([p for p, done in zip(self.params, self._initialized) if not done])
        root = self._src  # rank 0 of process_group, as a global rank
        keep = not gather_on_root or dist.get_rank() == root
        members = dist.get_process_group_ranks(self.dist_group if self.dist_group is not None else dist.group.WORLD)
        if gather_on_root and root not in members:
            return None  # redundant replicas: another distributed group holds rank 0, and gathers for it
        size = self.bucket_size
        # Only a rank that keeps the state receives it: a full bucket in device
        # memory for the collective and, on a GPU, a pinned host bucket that
        # one copy per bucket and state fills.
        gathered = torch.empty(size, dtype=torch.float32, device=self.device) if keep else None
        host = gathered
        if keep and self.device.type == "cuda":
            host = torch.empty(size, dtype=torch.float32, pin_memory=True)
        parts = list(gathered.view(self.dist_size, -1).unbind(0)) if keep and gather_on_root else None
        groups, index = pack_groups(self.param_groups, plain_value)
        full = {name: [_unflatten(p) for p in self.params] if keep else None for name in self._state_names}
        for b in range(len(self.layout.buckets)):
            for name in self._state_names:
                row = self._state_row(name, b).to(self.device).contiguous()  # host state: the collective's device
                if gather_on_root:
                    dist.gather(row, gather_list=parts, dst=root, group=self.dist_group)
                else:
                    _all_gather(gathered, row, group=self.dist_group)
                if not keep:
                    continue
                if host is not gathered:
                    host.copy_(gathered)  # one device-to-host copy of the whole bucket
                flats = full[name]
                for f in self.layout.fragments_by_bucket[b]:
                    flats[f.param][1][f.param_start:f.param_end].copy_(host[f.bucket_start:f.bucket_end])
        if not keep:
            return None
        state = {}
        for k, p in enumerate(self.params):
            state[index[id(p)]] = {("param" if name == "master" else name): full[name][k][0]
                                   for name in self._state_names}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state_dict() saved on any world size and bucket size (each
        rank takes its own pieces, no communication), apex's format 2, or a
        fused optimizer's or the rule's torch optimizer's state dict (fp32 master ``param`` /
        ``master_param`` optional: without it the master is the parameter's
        current value). Checks everything before writing; the caller's dict is
        not modified. Every rank checks the whole dict (structure, counts,
        shapes, tensor types, hyperparameters, steps: _state_dict_check.py),
        then the ranks agree (one small collective): if any rank refuses,
        every rank raises the same ValueError and nothing is written. Runs
        torch.optim's load hooks ([Note: state-dict hooks] in
        .._state_dict_hooks: the pre hooks inside the ranks' agreement)."""
        self._load(lambda: through_load_pre_hooks(self, state_dict))
        run_load_post_hooks(self)

    @torch.no_grad()
    def _load(self, read_state_dict: Callable[[], dict]) -> None:
        """load_state_dict() of the dict read_state_dict() returns, without the
        post hooks; read_state_dict runs inside the ranks' agreement."""
        self._refuse_mid_host_step("load_state_dict()")
        self._land_param_sync()
        checked = validate_then_agree(
            f"{type(self).__name__}.load_state_dict",
            lambda: check_state_dict(_apex_format.from_any(read_state_dict()), self.param_groups, self.rule),
            self.group, self.device)
        for values, group in zip(checked.group_values, self.param_groups):
            set_group_values(group, values)
        # without a master in the checkpoint, the master is the parameter's current value
        by_param = {id(p): dict(entry, master=entry["master"] if entry["master"] is not None else p.detach())
                    for p, entry in checked.entries}
        flat, flat_of = {}, None  # a parameter's loaded tensors, flattened once for its consecutive fragments
        for f in self.layout.shard_fragments(self.rank):
            entry = by_param.get(id(self.params[f.param]))
            if entry is None:
                continue
            if flat_of != f.param:
                flat, flat_of = {}, f.param
            for name in self._state_names:
                if name not in flat:  # a copy only where the saved layout differs from the parameter's
                    flat[name] = flat_like(entry[name].float(), self.params[f.param])
                self._write_state(name, f, flat[name][f.param_start:f.param_end])
        for k, p in enumerate(self.params):  # the model's values: the loaded masters, as the all-gather sends them
            entry = by_param.get(id(p))
            if entry is not None:
                p.copy_(entry["master"].to(self._sync_class[id(p)][1]))
                self._initialized[k] = True
