"""What the ranks of a DistributedFusedAdam must agree on, checked with small
collectives (the DESIGN's trust rules: one fingerprint, an error that names
the first difference and the ranks, raised on every rank alike).

- check_same_setup: at construction, before rank 0's parameters are broadcast,
  every rank must hold the same parameters (count, shapes, dtypes, memory
  order, requires_grad, device type), in the same groups with the same
  hyperparameters, and the same layout-shaping options. One all-reduce of a
  hash; only when the hashes differ, an all_gather_object of the descriptions
  finds the first difference. Without it a mismatch aborts gloo inside the
  broadcast, or trains on silently (shards of other shapes). check_same is
  that check for any description: a call every rank must make alike.
- agree: a load validates locally, then every rank learns every rank's verdict
  (one all_gather_object of None or an error message); if any rank refused,
  every rank raises the same ValueError, and none writes anything.
"""
from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist

from .._torch import memory_order

__all__ = ["agree", "check_same", "check_same_setup", "describe_setup", "first_difference"]

# The options that shape the layout or the collectives each rank issues (in
# __init__'s order); the sync dtypes are _build's arguments, resolved below.
_OPTIONS = ("average_grad_sync", "overlap_grad_sync", "overlap_param_sync",
            "bucket_cap_mb", "pipeline_size", "contiguous_param_buffer", "contiguous_grad_buffer", "store_params",
            "store_param_remainders", "with_scaled_states", "dtype", "nccl_ub", "capturable", "grad_sync_copy_engine",
            "param_sync_copy_engine", "dist_size", "state_dtypes", "host_step_in_backward")


def _device_context(device):
    """NCCL's object collectives run on the current CUDA device: make it the optimizer's."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.device(torch.device(device))
    return contextlib.nullcontext()


def _gather_objects(obj, group, device) -> list:
    gathered = [None] * dist.get_world_size(group)
    with _device_context(device):
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


# ---------------------------------------------------------------- loads

def agree(what: str, error: BaseException | None, group, device,
          outcome: str = "nothing was loaded on any rank") -> None:
    """Every rank's verdict on `what` (a load that validated locally and
    writes nothing yet): one all_gather_object over `group`. If any rank
    refused, every rank raises the same message, naming the refusing ranks
    and the first reason (of the lowest refusing rank): a ValueError, or on
    a refusing rank the type of its own TypeError or NotImplementedError."""
    mine = None
    if error is not None:
        mine = str(error) if isinstance(error, (ValueError, TypeError)) else f"{type(error).__name__}: {error}"
        mine = mine or type(error).__name__
    verdicts = _gather_objects(mine, group, device)
    refused = [r for r, v in enumerate(verdicts) if v is not None]
    if not refused:
        return
    others = len({verdicts[r] for r in refused}) - 1
    message = (f"{what} refused on {_ranks(refused)} of {len(verdicts)} ({outcome}); "
               f"rank {refused[0]}: {verdicts[refused[0]]}"
               + (f" (and {others} other reason{'s' if others > 1 else ''} on the other ranks)" if others else ""))
    kind = type(error) if isinstance(error, (TypeError, NotImplementedError)) else ValueError
    raise kind(message) from error


def validate_then_agree(what: str, check, group, device, outcome: str = "nothing was loaded on any rank"):
    """check() on this rank (it must not write), then agree(): check's result
    on every rank, or the same message raised on every rank."""
    try:
        result, error = check(), None
    except Exception as e:  # noqa: BLE001 - any refusal, even an unexpected one, must reach the other ranks
        result, error = None, e
    agree(what, error, group, device, outcome)
    return result


# ---------------------------------------------------------------- construction

def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 and v.device.type != "meta" else f"tensor{tuple(v.shape)}"
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v


def describe_setup(opt, grad_sync_dtype, param_sync_dtype) -> list[tuple[str, object]]:
    """(what, value) pairs that every rank must have equal, in the order a
    difference is reported: options, groups, each parameter, sync dtypes."""
    items = [("the update rule", opt.rule.name)]
    items += [(f"option {name}", repr(value)) for name, value in opt.rule.options().items()]
    items += [(f"option {name}", repr(getattr(opt, name, None))) for name in _OPTIONS]
    items.append(("the number of parameter groups", len(opt.param_groups)))
    for gi, g in enumerate(opt.param_groups):
        items.append((f"the number of parameters in param_groups[{gi}]", len(g["params"])))
        items += [(f"param_groups[{gi}]['{k}']", repr(_plain(g.get(k)))) for k in opt.rule.group_keys]
    for gi, g in enumerate(opt.param_groups):
        for pi, p in enumerate(g["params"]):
            where = f"param_groups[{gi}]['params'][{pi}]"
            items += [(f"{where}: shape", tuple(p.shape)), (f"{where}: dtype", str(p.dtype)),
                      (f"{where}: requires_grad", bool(p.requires_grad)),
                      (f"{where}: memory order (dims outermost first)", memory_order(p)),
                      (f"{where}: device type", p.device.type)]
    # Last: with each parameter's dtype they give its sync class ([Note: sync classes] in _rows.py).
    items += [("option param_sync_dtype", repr(param_sync_dtype)), ("option grad_sync_dtype", repr(grad_sync_dtype))]
    return items


def fingerprint(items: list) -> int:
    """63 bits of the SHA-256 of the description (equal on equal descriptions on every host)."""
    return int.from_bytes(hashlib.sha256(repr(items).encode()).digest()[:8], "little") >> 1


_ABSENT = "absent"


def first_difference(descriptions: list[list]) -> tuple[str, int] | None:
    """The first item (in rank 0's order) on which the ranks' descriptions
    differ, as 'what: value on rank(s) ..., value on rank(s) ...', and how
    many items differ; None if none does."""
    as_dict = [dict(d) for d in descriptions]
    order = list(dict.fromkeys(k for d in descriptions for k, _ in d))
    found, count = None, 0
    for key in order:
        values = [d.get(key, _ABSENT) for d in as_dict]
        if all(v == values[0] for v in values):
            continue
        count += 1
        if found is None:
            by_value: dict = {}
            for r, v in enumerate(values):
                by_value.setdefault(v if isinstance(v, str) else repr(v), []).append(r)
            found = f"{key}: " + ", ".join(f"{text} on {_ranks(ranks)}" for text, ranks in by_value.items())
    return None if found is None else (found, count)


def check_same_setup(opt, grad_sync_dtype=None, param_sync_dtype=None, device=None) -> None:
    """Every rank of opt.group has the same parameters, groups and options
    (check_same): call before the first collective of the constructor (rank
    0's parameter broadcast)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    dev = torch.device(device) if device is not None else (params[0].device if params else torch.device("cpu"))
    check_same(f"{type(opt).__name__}: the {{ranks}} ranks of process_group were not given the same parameters "
               "and options: {difference}. Every rank must build the same model and optimizer (same parameters in "
               "the same groups, same options); rank 0's parameter values are then broadcast to the others",
               describe_setup(opt, grad_sync_dtype, param_sync_dtype), opt.group, dev)


def check_same(message: str, items: list, group, device) -> None:
    """Every rank of group holds the same description `items`: one
    all-reduce of a fingerprint; if they differ, an all_gather_object of the
    descriptions and the same ValueError on every rank: `message` with
    {ranks} and {difference} (the first one, naming the ranks) filled in."""
    h = fingerprint(items)
    both = torch.tensor([h, -h], dtype=torch.int64, device=device)  # max(h) == -max(-h) == min(h): all equal
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both.tolist()
    if high == -low:
        return
    descriptions = _gather_objects(items, group, device)
    diff = first_difference(descriptions)
    what, count = diff if diff is not None else ("the ranks' descriptions differ in a way not itemised", 1)
    more = f" (and {count - 1} more difference{'s' if count > 2 else ''})" if count > 1 else ""
    raise ValueError(message.format(ranks=len(descriptions), difference=what + more))
