"""What the benchmarks share around a run: process groups, run metadata, JSON
and markdown output, failures every rank agrees on, optimizer memory."""
from __future__ import annotations

import ctypes
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import shlex
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardadam
from shardadam.distributed import BucketRows


# ------------------------------------------------------------------ process groups

def init_distributed(device: str | None = None) -> tuple[torch.device, bool]:
    """The process group of a torchrun process: NCCL with one GPU per process
    (cuda:LOCAL_RANK) when CUDA is available (or `device` says cuda), gloo on
    the CPU otherwise."""
    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if cuda:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    return dev, cuda


def init_one_rank(dev, bind_device: bool = False) -> None:
    """A one-rank process group of this process (NCCL on a GPU, gloo on the
    CPU), for the optimizers that need one outside torchrun; bind_device gives
    NCCL the device at once (device_id)."""
    cuda = torch.device(dev).type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device(dev) if cuda and bind_device else None)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def attempt(fn):
    """(fn(), None), or (None, the error's first line) with its traceback printed:
    a failure is recorded and the other cases still run."""
    try:
        return fn(), None
    except Exception as e:
        traceback.print_exc()
        return None, error_text(e)


def agree_on_error(error: str | None, dev) -> str | None:
    """Every rank skips a case that failed on any rank, so that all ranks go on
    to the same next collective. This covers failures that hit the ranks at the
    same point (an unsupported option, out of memory); a rank that fails while
    the others wait inside a collective leaves them waiting until the process
    group's timeout."""
    failed = torch.tensor([error is not None], dtype=torch.int32, device=dev)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return error or ("failed on another rank" if failed.item() else None)


def max_over_ranks(values: list[float], dev) -> list[float]:
    """The slowest rank sets the pace of a data-parallel job, the fullest one its memory."""
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def losses_ok(losses: list[float]) -> bool:
    """Every loss finite and the last below the first: the run trained."""
    return all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


# ------------------------------------------------------------------ metadata and output

def run_meta(dev=None, **extra) -> dict:
    """Where, when and how a benchmark ran, for its JSON."""
    cuda = dev is not None and torch.device(dev).type == "cuda"
    grouped = dist.is_initialized()
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=shlex.join(sys.argv), torch=torch.__version__, cuda=torch.version.cuda,
                nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                shardadam=shardadam.__version__, python=platform.python_version(),
                device=torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
                cpu_threads=torch.get_num_threads(), backend=dist.get_backend() if grouped else None,
                world_size=dist.get_world_size() if grouped else 1, **extra)


def gpt_meta(args, dev, n_params: int, **extra) -> dict:
    """run_meta of a benchmark of the GPT, its options included."""
    return run_meta(dev, params=n_params, config={k: v for k, v in vars(args).items() if k != "out"}, **extra)


def describe(meta: dict, args) -> str:
    """The first line rank 0 prints: the machine and the model."""
    return (f"{meta['device']} x {meta['world_size']} ({meta['backend']}), torch {meta['torch']}, shardadam "
            f"{meta['shardadam']}: GPT d_model {args.d_model}, {args.layers} layers, {args.heads} heads, "
            f"vocab {args.vocab}, seq {args.seq}: {meta['params']:,} parameters")


def write_json(path, indent: int = 1, **data) -> None:
    if path:
        pathlib.Path(path).write_text(json.dumps(data, indent=indent))


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def md_table(header: list[str], rows: list[list], align: str | None = None) -> str:
    """A markdown table; `align` one character per column ("l" or "r"), default
    the first left and the rest right."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    return "\n".join(["| " + " | ".join(header) + " |", rule] + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


# ------------------------------------------------------------------ host memory

PAGE = os.sysconf("SC_PAGE_SIZE")
_LIBC = ctypes.CDLL(None)


def rss_bytes() -> int:
    """Current resident set size: field 2 of /proc/self/statm, in pages
    (resource.getrusage's ru_maxrss is the peak, which can never fall)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def release_host_memory() -> None:
    """Hand freed heap memory back to the kernel, so that what one phase freed
    neither raises the next phase's starting RSS nor hides its growth."""
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)  # glibc >= 2.33
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _MallInfo2


def malloc_in_use() -> int | None:
    """Bytes that malloc has handed out and not had back, over all arenas and
    mmapped chunks (torch's CPU tensors included). RSS also moves when the
    allocator first touches pages of heap it already holds; this does not, so it
    tells a leak from allocator layout. None where malloc is not glibc's."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


# ------------------------------------------------------------------ optimizer memory

def held_tensors(opt) -> list[torch.Tensor]:
    """The tensors an optimizer keeps between steps: torch optimizers' `state`
    (ZeroRedundancyOptimizer keeps this rank's partition in its inner
    optimizer, `opt.optim`; FSDP2's states are DTensors), FusedAdam's and
    FusedLion's flat buckets (with state on the host, their segments'
    buckets), and DistributedFusedAdam's attributes: sharded states (by name
    in `states`, fp16 scales in `state_scales`), masters, shards and buffers
    (BucketRows). Its `state` is empty and its state_dict() gathers the full
    states on every rank, so there is no public per-rank view to read."""
    inner = getattr(opt, "optim", opt)
    tensors = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    for b in getattr(opt, "_buckets", None) or []:
        for bucket in [b] + [seg.bucket for seg in getattr(b, "segments", [])]:
            tensors += [t for t in vars(bucket).values() if torch.is_tensor(t)]
            for held in ("states", "scales", "blocks"):
                for v in getattr(bucket, held, {}).values():
                    tensors += v if isinstance(v, list) else [v]
    tensors += [v for v in vars(opt).values() if torch.is_tensor(v)]
    tensors += [t for v in vars(opt).values() if isinstance(v, BucketRows) for t in v.tensors]
    for held in (getattr(opt, "states", None), getattr(opt, "state_scales", None)):
        tensors += list((held or {}).values()) if isinstance(held, dict) else []
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def model_buffer_storages(opt) -> dict[int, int]:
    """{storage address: bytes} of DistributedFusedAdam's param_buffer and
    grad_buffer: they hold the model's own parameters and gradients, and the
    shards may be views of them ([Note: reduced shards in the gradient buffer])."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for name in ("param_buffer", "grad_buffer")
            if isinstance(getattr(opt, name, None), BucketRows) for t in getattr(opt, name).tensors}


def optimizer_bytes(opt) -> int:
    """Bytes of the tensors the optimizer keeps on this rank between steps
    (held_tensors), each storage once, leaving out the model's buffers."""
    model = model_buffer_storages(opt)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held_tensors(opt) if t.numel()}
    return sum(size for ptr, size in storages.items() if ptr not in model)
