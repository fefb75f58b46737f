#!/usr/bin/env python
"""Soak run: DistributedFusedAdam trains for many steps while each rank's memory is sampled.

Goal: no leak. Judged per rank by the growth of host RSS (and GPU allocated and reserved memory) after a 10% warm-up,
end to end and along a least-squares line, against its limit: the run exits 1 if any exceeds it. Training as in practice
(small buckets, both overlaps, contiguous_param_buffer, a scheduler, clipping, fresh batches, a state_dict() round trip
every 1000 steps, or a fifth of the run); CPU: gloo and a small MLP, CUDA: NCCL and a small GPT. svg.py draws the JSON.

    torchrun --standalone --nproc_per_node 2 benchmarks/soak.py --steps 5000 --out benchmarks/results/soak_gloo.json
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 benchmarks/soak.py --device cuda --copy-engines \\
        --steps 1000 --out benchmarks/results/soak_2xh200.json
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from harness import init_distributed, malloc_in_use, md_table, rss_bytes, run_meta, write_json
from models import build_model, lm_loss
from svg import soak_svg

MIB = 2**20
WARMUP_FRACTION = 0.1
LR = 1e-3

# The CPU model: 9,668 parameters; 0.01 MiB buckets (2,621 fp32 elements) make 4 of them, with parameters split across
# buckets, so several reduce-scatters and all-gathers overlap backward and forward every step.
MLP = dict(d_in=16, width=64, d_out=4, batch=32, bucket_cap_mb=0.01)
# The GPU model: 21.1M parameters (d_model 512, 4 layers; 80.6 MiB in fp32), 8 MiB buckets: about 11.
SMALL_GPT = dict(d_model=512, layers=4, heads=8, vocab=8192, seq=256, batch=8, bucket_cap_mb=8)


def batches(dev: torch.device, cuda: bool):
    """Fresh data every step (allocated as a real loader's would): random tokens on the GPU (the loss stays near
    ln(vocab): the soak is about memory), on the CPU inputs with targets from a fixed random teacher."""
    g = torch.Generator(device=dev).manual_seed(1 + dist.get_rank())
    teacher = torch.randn(MLP["d_in"], MLP["d_out"], generator=torch.Generator().manual_seed(123))
    while True:
        if cuda:
            tokens = torch.randint(SMALL_GPT["vocab"], (SMALL_GPT["batch"], SMALL_GPT["seq"] + 1), generator=g,
                                   device=dev)
            yield tokens[:, :-1], tokens[:, 1:]
        else:
            x = torch.randn(MLP["batch"], MLP["d_in"], generator=g)
            yield x, torch.tanh(x @ teacher)


def sample(step: int, t0: float, loss: float | None, cuda: bool) -> dict:
    """One rank's memory at the end of an iteration (after zero_grad)."""
    if cuda:
        torch.cuda.synchronize()  # the same point of every iteration: nothing queued
    return dict(step=step, seconds=time.perf_counter() - t0, rss=rss_bytes(), malloc_in_use=malloc_in_use(),
                py_objects=len(gc.get_objects()), gpu_allocated=torch.cuda.memory_allocated() if cuda else None,
                gpu_reserved=torch.cuda.memory_reserved() if cuda else None, loss=loss)


def soak(args, dev: torch.device) -> tuple[list[dict], dict]:
    """Train for args.steps steps; this rank's samples and what ran. The model
    and optimizer are local, so they are gone (hooks removed) on return."""
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    w = MLP["width"]
    model = build_model(SimpleNamespace(**SMALL_GPT), dev) if cuda else nn.Sequential(
        nn.Linear(MLP["d_in"], w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(),
        nn.Linear(w, MLP["d_out"]))
    copy_engines = True if args.copy_engines else None  # None: wherever every rank can
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=LR, weight_decay=0.1, bucket_cap_mb=args.bucket_cap_mb,
        overlap_grad_sync=True, overlap_param_sync=True, contiguous_param_buffer=True,
        grad_sync_copy_engine=copy_engines, param_sync_copy_engine=copy_engines)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps, eta_min=LR / 10)
    data = batches(dev, cuda)
    t0 = time.perf_counter()
    samples = [sample(0, t0, None, cuda)]
    for step in range(1, args.steps + 1):
        x, y = next(data)
        loss = lm_loss(model, x, y, cuda) if cuda else F.mse_loss(model(x), y)
        loss.backward()  # buckets reduce-scattered during backward
        opt.clip_grad_norm(1.0)
        opt.step()  # all-gathers left running into the next forward
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % args.checkpoint_every == 0:
            # the portable path (every rank gathers the whole state, then takes its own pieces back):
            # everything it allocates must be released again
            opt.load_state_dict(opt.state_dict())
        if step % args.sample_every == 0 or step == args.steps:
            samples.append(sample(step, t0, loss.item(), cuda))
        del x, y, loss  # nothing of this iteration lives on into the next sample
    opt.param_sync()
    info = dict(params=sum(p.numel() for p in model.parameters()), buckets=len(opt.layout.buckets), **opt.transports)
    return samples, info


def flatness(samples: list[dict], key: str, limit_of) -> dict | None:
    """Growth of samples[key] after the warm-up: end to end (last minus first kept sample) and along the fitted line
    (slope times the steps spanned); failed if either exceeds limit_of(base level)."""
    if samples[0][key] is None:
        return None
    kept = samples[int(len(samples) * WARMUP_FRACTION):]
    steps, values = [s["step"] for s in kept], [s[key] for s in kept]
    ms, mv = sum(steps) / len(steps), sum(values) / len(values)
    var = sum((s - ms) ** 2 for s in steps)  # least squares: bytes per step
    slope = sum((s - ms) * (v - mv) for s, v in zip(steps, values)) / var if var else 0.0
    growth, fitted = values[-1] - values[0], slope * (steps[-1] - steps[0])
    limit = limit_of(values[0])  # None: reported only
    return dict(base_step=steps[0], base=values[0], last=values[-1], min=min(values), max=max(values),
                growth=growth, slope=slope, fitted_growth=fitted, limit=limit,
                ok=limit is None or (growth <= limit and fitted <= limit))


def judge(samples: list[dict]) -> dict:
    """Every metric's flatness for one rank. malloc'd bytes and Python object counts are reported, not judged: if RSS
    rises, they tell whether the memory is in use (C/C++ or Python objects) or allocator layout."""
    # RSS: glibc's heap grows in steps of 0.25-1 MiB now and then, up to ~2 MiB in all after the warm-up of a 200-step
    # run (RESULTS.md); the limit is about four times that. GPU allocated memory is exact bytes of live tensors, sampled
    # at the same point of every step: it has no reason to move at all. Reserved memory takes the RSS rule, since the
    # caching allocator may add a segment (2-20 MiB) for a new size without anything leaking.
    rss_limit = lambda base: max(base * 0.02, 8 * MIB)  # noqa: E731
    result = dict(rss=flatness(samples, "rss", rss_limit), gpu_reserved=flatness(samples, "gpu_reserved", rss_limit),
                  gpu_allocated=flatness(samples, "gpu_allocated", lambda _: MIB),
                  malloc_in_use=flatness(samples, "malloc_in_use", lambda base: None),
                  py_objects=flatness(samples, "py_objects", lambda base: None))
    result["ok"] = all(r["ok"] for r in result.values() if r is not None)
    return result


def report(verdicts: list[dict], everyone: list[list[dict]]) -> str:
    """The judged metrics as a table each, then one line per rank of what explains them."""
    tables = [f"{title}:\n" + md_table(
        ["rank", "base step", "base MiB", "last MiB", "min..max MiB", "growth MiB", "slope B/step", "fitted growth MiB",
         "limit MiB", "flat"],
        [[rank, r["base_step"], f"{r['base'] / MIB:.2f}", f"{r['last'] / MIB:.2f}",
          f"{r['min'] / MIB:.2f}..{r['max'] / MIB:.2f}", f"{r['growth'] / MIB:+.3f}", f"{r['slope']:+.1f}",
          f"{r['fitted_growth'] / MIB:+.3f}", f"{r['limit'] / MIB:.2f}", "yes" if r["ok"] else "NO"]
         for rank, r in enumerate(v[key] for v in verdicts)], "r" * 9 + "l")
        for key, title in (("rss", "Host RSS"), ("gpu_allocated", "GPU allocated"), ("gpu_reserved", "GPU reserved"))
        if verdicts[0][key] is not None]
    lines = []
    for rank, (v, samples) in enumerate(zip(verdicts, everyone)):
        objs, malloced, last = v["py_objects"], v["malloc_in_use"], samples[-1]
        in_use = (f"malloc in use {malloced['base'] / MIB:.3f} -> {malloced['last'] / MIB:.3f} MiB "
                  f"({malloced['growth'] / MIB:+.3f}, {malloced['slope']:+.1f} B/step); " if malloced else "")
        lines.append(f"rank {rank}: {in_use}Python objects {objs['base']} -> {objs['last']} ({objs['growth']:+d}); "
                     f"{1e3 * last['seconds'] / last['step']:.2f} ms/step; loss {samples[1]['loss']:.4f} -> "
                     f"{last['loss']:.4f}")
    return "\n\n".join(tables + ["\n".join(lines)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo, cuda: NCCL (one GPU per rank)")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--sample-every", type=int,
                    help="steps between memory samples (default: steps/100, at most 50: about 100 samples)")
    ap.add_argument("--copy-engines", action="store_true",
                    help="CUDA: require the copy-engine reduce-scatter and all-gather (default: used where possible)")
    ap.add_argument("--out", help="write every sample and the verdicts here as JSON (and an SVG plot beside it)")
    args = ap.parse_args()
    args.sample_every = args.sample_every or max(1, min(50, args.steps // 100))
    if args.sample_every < 1 or args.steps // args.sample_every < 10:
        ap.error("need at least 10 samples (--steps / --sample-every >= 10): the first 10% are warm-up")
    if args.copy_engines and args.device != "cuda":
        ap.error("--copy-engines needs --device cuda")
    if args.device == "cuda" and not (torch.cuda.is_available() and shardadam.build_info()["cuda"]):
        ap.error(f"--device cuda needs a GPU (torch sees {torch.cuda.device_count()}) and a shardadam build "
                 f"with CUDA kernels (build_info cuda={shardadam.build_info()['cuda']})")
    # several state_dict + load_state_dict round trips in a short run
    args.checkpoint_every = max(1, min(1000, args.steps // 5))
    args.bucket_cap_mb = (SMALL_GPT if args.device == "cuda" else MLP)["bucket_cap_mb"]
    if args.device == "cpu":
        torch.set_num_threads(1)  # the ranks share the machine's cores
    dev, _ = init_distributed(args.device)
    rank = dist.get_rank()
    samples, info = soak(args, dev)
    gc.collect()  # the optimizer's reference cycles, if any, go before the process group does
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, samples)
    verdicts = [judge(s) for s in everyone]  # the same on every rank: all exit alike
    ok = all(v["ok"] for v in verdicts)
    if rank == 0:
        meta = run_meta(dev, model="small GPT " + json.dumps(SMALL_GPT) if args.device == "cuda" else "MLP "
                        + json.dumps(MLP), **info, warmup_fraction=WARMUP_FRACTION,
                        config={k: v for k, v in vars(args).items() if k != "out"})
        print(f"{meta['device']} x {meta['world_size']} ({meta['backend']}), torch {meta['torch']}: {meta['model']}, "
              f"{info['params']:,} parameters, {info['buckets']} buckets, grad_sync on {info['grad_sync']}, "
              f"param_sync on {info['param_sync']}; {args.steps} steps, a sample every {args.sample_every}, "
              f"a checkpoint round trip every {args.checkpoint_every}\n")
        print(report(verdicts, everyone))
        print(f"\n{'PASS' if ok else 'FAIL'}: memory {'flat' if ok else 'grows'} after the first "
              f"{WARMUP_FRACTION:.0%} of samples")
        if args.out:
            data = dict(meta=meta, passed=ok, verdicts=verdicts, samples=everyone)
            write_json(args.out, **data)
            svg = pathlib.Path(args.out).with_suffix(".svg")
            soak_svg(data, svg)
            print(f"wrote {args.out} and {svg}")
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
