"""What the benchmarks share around a run: process groups, command-line options, run metadata, JSON and markdown output,
failures every rank agrees on, a case's figures over ranks, optimizer memory."""
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
from models import FULL, TINY, build_model, fill_defaults
from shardadam.distributed import BucketRows
from timing import free, is_cuda, sync


def init_distributed(device: str | None = None) -> tuple[torch.device, bool]:
    """This process's group: a torchrun process's, or outside torchrun one of one rank; NCCL on cuda:LOCAL_RANK where
    CUDA is available (or asked for), else gloo."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=dev if cuda else None, **alone)
    return dev, cuda


def agree_on_error(error: str | None, dev) -> str | None:
    """Every rank skips a case that failed on any rank, so that all go on to the same next collective: failures that hit
    the ranks at the same point (an unsupported option, out of memory); a rank that fails while the others wait in a
    collective leaves them waiting until the group's timeout."""
    failed = torch.tensor([error is not None], dtype=torch.int32, device=dev)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return error or ("failed on another rank" if failed.item() else None)


def max_over_ranks(values: list[float], dev) -> list[float]:
    """The slowest rank sets the pace of a data-parallel job, the fullest one its memory."""
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def memory_figures(opt, cuda: bool) -> dict:
    """Between iterations (gradients freed): the optimizer's bytes, and this
    rank's peak and resident (allocated) GPU memory, for run_case."""
    sync(cuda)
    return dict(opt_bytes=optimizer_bytes(opt), peak=torch.cuda.max_memory_allocated() if cuda else 0,
                resident=torch.cuda.memory_allocated() if cuda else 0)


def run_case(result: dict, fn, dev, n_params: int, keep_losses: bool = False) -> dict:
    """`result` with what fn() measured on a freed device: fn returns (figures, losses). A failure (its traceback
    printed, its first line kept) on any rank is every rank's ("error"). Figures: maxima over ranks, memory_figures' as
    opt_bytes_per_param, peak_gib and resident_bytes_per_param (None without CUDA); rank 0's losses give loss_first,
    loss_last, loss_ok (all finite, the last below the first) and, with keep_losses, "losses"."""
    free(dev)
    error = None
    try:
        figures, losses = fn()
    except Exception as e:
        traceback.print_exc()
        error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    result["error"] = agree_on_error(error, dev)
    if result["error"]:
        return result
    figures = dict(zip(figures, max_over_ranks(list(figures.values()), dev)))
    cuda = is_cuda(dev)
    for key, name, scale in (("opt_bytes", "opt_bytes_per_param", 1 / n_params), ("peak", "peak_gib", 2**-30),
                             ("resident", "resident_bytes_per_param", 1 / n_params)):
        if key in figures:
            value = figures.pop(key)
            result[name] = value * scale if cuda or key == "opt_bytes" else None
    result.update(figures)
    if keep_losses:
        result["losses"] = losses
    result.update(loss_first=losses[0], loss_last=losses[-1],
                  loss_ok=all(math.isfinite(x) for x in losses) and losses[-1] < losses[0])
    return result


def choose(ap, value: str, known, option: str, sep: str = ",") -> list[str]:
    """The subset of `known` that `value` names, separated by `sep`; an unknown name stops the parser."""
    chosen = value.split(sep)
    if set(chosen) - set(known):
        ap.error(f"unknown {option} {sorted(set(chosen) - set(known))}; choose from {','.join(known)}")
    return chosen


def add_device_arg(ap) -> None:
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                    help="default: cuda where torch sees a GPU, else cpu")


def add_run_args(ap, lr: float | None = 1e-4, buckets: str | None = "DistributedFusedAdam's bucket size in MiB "
                 "(default 100)", out: str | None = "write the results here as JSON") -> None:
    """--lr, --bucket-cap-mb (its help: buckets), --seed and --out (its help: out), each unless None."""
    if lr is not None:
        ap.add_argument("--lr", type=float, default=lr)
    if buckets is not None:
        ap.add_argument("--bucket-cap-mb", type=float, help=buckets)
    ap.add_argument("--seed", type=int, default=0)
    if out is not None:
        ap.add_argument("--out", help=out)


def parse_gpt_args(ap, full: dict = FULL, keys=None, tiny: dict = TINY):
    """ap's arguments, the GPT's sizes filled in (fill_defaults), --batches a list of ints, --iters / --rounds >= 1."""
    args = ap.parse_args()
    fill_defaults(args, full, keys, tiny)
    if isinstance(getattr(args, "batches", None), str):
        args.batches = [int(b) for b in args.batches.split(",")]
    for name in ("iters", "rounds"):
        if getattr(args, name, 1) < 1:
            ap.error(f"--{name} must be at least 1")
    return args


def start_gpt(args, device: str | None = None, note: str = "") -> tuple[torch.device, bool, int, dict]:
    """init_distributed, the GPT's size and run_meta with the options; rank 0 prints the machine, model, `note`."""
    dev, cuda = init_distributed(device)
    n_params = sum(p.numel() for p in build_model(args, "meta").parameters())
    meta = run_meta(dev, params=n_params, config={k: v for k, v in vars(args).items() if k != "out"})
    say(f"{meta['device']} x {meta['world_size']} ({meta['backend']}), torch {meta['torch']}, shardadam "
        f"{meta['shardadam']}: GPT d_model {args.d_model}, {args.layers} layers, {args.heads} heads, vocab "
        f"{args.vocab}, seq {args.seq}: {n_params:,} parameters{note}")
    return dev, cuda, n_params, meta


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


def say(*lines) -> None:
    """Print on rank 0 (in every process without a process group), at once."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*lines, sep="\n", flush=True)


def write_json(path, indent: int = 1, **data) -> None:
    if path:
        pathlib.Path(path).write_text(json.dumps(data, indent=indent))


def finish(out, **data) -> None:
    """Rank 0 writes `data` to `out` as JSON; then the process group goes."""
    if dist.get_rank() == 0:
        write_json(out, **data)
    dist.destroy_process_group()


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def md_table(header: list[str], rows: list[list], align: str | None = None) -> str:
    """A markdown table; `align` "l" or "r" per column, default the first left and the rest right."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    return "\n".join(["| " + " | ".join(header) + " |", rule] + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def results_table(results: list[dict], names: list[str], columns, align: str | None = None) -> str:
    """A row per result: its `names` keys, then per (header, key, format) column
    fmt(result[key], format) or key(result); an "error" fills the first cell."""
    def cells(r):
        if r.get("error"):
            return [f"failed: {r['error']}"] + [""] * (len(columns) - 1)
        return [key(r) if callable(key) else fmt(r.get(key), spec) for _, key, spec in columns]
    return md_table(names + [c[0] for c in columns], [[r[n] for n in names] + cells(r) for r in results], align)


PAGE = os.sysconf("SC_PAGE_SIZE")
_LIBC = ctypes.CDLL(None)


def rss_bytes() -> int:
    """Current resident set size (ru_maxrss is the peak, which can never fall)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def release_host_memory() -> None:
    """Hand freed heap memory back to the kernel: what one phase freed neither
    raises the next phase's starting RSS nor hides its growth."""
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
    """Bytes malloc has handed out and not had back (torch's CPU tensors included): unlike RSS, it does not move when
    the allocator first touches heap it holds, so it tells a leak from layout. None without glibc's malloc."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def held_tensors(opt) -> list[torch.Tensor]:
    """The tensors an optimizer keeps between steps: torch optimizers' `state` (ZeroRedundancyOptimizer's in
    `opt.optim`, FSDP2's as DTensors), FusedAdam's and FusedLion's buckets (with host state, their segments'), and
    DistributedFusedAdam's attributes (it has no public per-rank view)."""
    inner = getattr(opt, "optim", opt)
    tensors = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    for b in getattr(opt, "_buckets", None) or []:
        for bucket in [b] + [seg.bucket for seg in getattr(b, "segments", [])]:
            tensors += [t for t in vars(bucket).values() if torch.is_tensor(t)]
            for held in ("states", "scales", "blocks"):
                for v in getattr(bucket, held, {}).values():
                    tensors += v if isinstance(v, list) else [v]
    for v in vars(opt).values():  # masters, shards, BucketRows, states / state_scales / state_blocks by name
        tensors += [v] if torch.is_tensor(v) else v.tensors if isinstance(v, BucketRows) else []
    for held in ("states", "state_scales", "state_blocks"):
        for v in (getattr(opt, held, None) or {}).values():
            tensors += v if isinstance(v, list) else [v]
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def model_buffer_storages(opt) -> dict[int, int]:
    """{storage address: bytes} of DistributedFusedAdam's param_buffer and grad_buffer: the model's own
    parameters and gradients, of which shards may be views ([Note: reduced shards in the gradient buffer])."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for name in ("param_buffer", "grad_buffer")
            if isinstance(getattr(opt, name, None), BucketRows) for t in getattr(opt, name).tensors}


def optimizer_bytes(opt) -> int:
    """Bytes of held_tensors on this rank, each storage once, the model's buffers left out."""
    model = model_buffer_storages(opt)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held_tensors(opt) if t.numel()}
    return sum(size for ptr, size in storages.items() if ptr not in model)
