#!/usr/bin/env python
"""shardadam's fused AdamW kernel against torch's AdamW, side by side in one run.

Goal (issue 2): on the GPU at least 90% of a device copy's bandwidth (fp32 and
mixed precision) and within 1.3x of the bandwidth floor at 20,000 tensors; on
the CPU at least as fast as torch fused. Judged by "% of copy" and "speedup vs
torch" (torch fused's time over this one's). Bandwidth counts 28 B per element
for every implementation (fp32 p, g, m, v in and p, m, v out; mixed precision:
a bf16 grad in and bf16 params_out out instead), so its ratios are time ratios.

--interleaved: the CPU steps taken in turn with torch fused's, as in a training
loop, where torch's OpenMP workers keep spinning for a while after each of its
ops (libgomp's wait policy) on the same cores. Judged by the speedup: torch
fused's median ms over shardadam's.

    python benchmarks/bench_kernels.py --device cuda --out bench.json --plot bench.png
    python benchmarks/bench_kernels.py --device all --quick      # smoke run
    python benchmarks/bench_kernels.py --interleaved --reps 30
"""
from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
from types import SimpleNamespace

import torch

import shardadam
from harness import md_table, run_meta, write_json
from shardadam import kernels
from timing import clock_ms, free, interleaved, time_steps, time_wall_and_host

LR, WD, BYTES_PER_ELEM = 1e-3, 1e-2, 28
TORCH_FUSED, TORCH_FOREACH, SHARD, COPY = "torch fused", "torch foreach", "shardadam", "copy"
TORCH_FUSED_COPY = "torch fused + copy"  # the mixed precision case: fp32 step, then a copy to bf16
Cfg = SimpleNamespace  # a case's timing: reps and warmup


def split(total: int, n: int) -> list[int]:
    """n tensor sizes adding up to total exactly."""
    return [total // n + (i < total % n) for i in range(n)]


def pow2(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n)


def rand(sizes, dev, dtype=torch.float32, positive=False) -> list[torch.Tensor]:
    """Random tensors (never zeros): normal, or uniform in [0.01, 1) when positive."""
    out = [torch.empty(n, device=dev, dtype=dtype) for n in sizes]
    for t in out:
        t.uniform_(0.01, 1.0) if positive else t.normal_()
    return out


def torch_step(params, grads, **flags):
    """optimizer.step of a torch AdamW with the grads preassigned. torch makes its
    own m and v (zeros) on the first step; warm-up steps make them random-like."""
    for p, g in zip(params, grads):
        p.grad = g
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, **flags).step


def torch_step_then_copy(params, grads, params_out):
    """torch's mixed precision path: fused fp32 AdamW, then a copy to the bf16 params."""
    step = torch_step(params, grads, fused=True)

    @torch.no_grad()
    def fn():
        step()
        torch._foreach_copy_(params_out, params)
    return fn


def shard_step(params, grads, params_out=None):
    """kernels.adam on a plan built once, with its own random m and v."""
    sizes = [p.numel() for p in params]
    dev = params[0].device
    plan = kernels.AdamPlan(params, grads, rand(sizes, dev), rand(sizes, dev, positive=True),
                            params_out=params_out)
    steps = itertools.count(1)
    return lambda: kernels.adam(plan, lr=LR, step=next(steps), weight_decay=WD)


def check(dev: str) -> float:
    """Relative error of shardadam against torch fused AdamW after 3 steps with
    fresh random grads, and every bf16 params_out element written (poisoned first)."""
    sizes = [1000, 4097, 70001]
    params = rand(sizes, dev)
    ref = [p.clone() for p in params]
    out = [torch.full_like(p, float("nan"), dtype=torch.bfloat16) for p in params]
    grads = rand(sizes, dev)
    zeros = [torch.zeros_like(p) for p in params]  # torch's initial state, for an equal start
    plan = kernels.AdamPlan(params, grads, zeros, [z.clone() for z in zeros], params_out=out)
    ref_step = torch_step(ref, [g.clone() for g in grads], fused=True)
    for step in (1, 2, 3):
        kernels.adam(plan, lr=LR, step=step, weight_decay=WD)
        ref_step()
        for g, r in zip(grads, ref):
            g.normal_()
            r.grad.copy_(g)
    err = (torch.cat(params) - torch.cat(ref)).norm() / torch.cat(ref).norm()
    if not all(torch.equal(o, p.to(torch.bfloat16)) for o, p in zip(out, params)):
        raise SystemExit(f"{dev}: params_out is not params in bf16")
    if not err < 1e-5:
        raise SystemExit(f"{dev}: shardadam differs from torch fused AdamW: rel err {err:.2e}")
    return err.item()


def copy_gbs(dev: str, numel: int, reps: int, warmup: int) -> float:
    src = torch.randn(numel, device=dev)
    ms = statistics.median(time_steps(functools.partial(torch.empty_like(src).copy_, src), dev, reps, warmup))
    return 2 * numel * 4 / ms / 1e6


def compare(case: str, dev: str, impls: dict, elems: int, cfg, copy: float, host: bool = False) -> dict:
    """Time each implementation (freeing its state after), with bandwidth and ratios."""
    rows = []
    for name, make in impls.items():
        fn = make()
        if host:
            ms, host_ms = time_wall_and_host(fn, dev, cfg.reps, cfg.warmup)
            row = {"ms": ms, "host_ms": host_ms}
        else:
            times = time_steps(fn, dev, cfg.reps, cfg.warmup)
            row = {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}
        del fn
        free(dev)
        gbs = elems * BYTES_PER_ELEM / row["ms"] / 1e6
        rows.append({"impl": name, **row, "gbs": gbs, "pct_copy": 100 * gbs / copy})
        print(f"  {case}: {name}: {row['ms']:.3f} ms", file=sys.stderr)
    base = rows[0]["ms"]
    for row in rows:
        row["speedup_vs_torch"] = base / row["ms"]
    floor_ms = elems * BYTES_PER_ELEM / copy / 1e6
    shard = next(r for r in rows if r["impl"] == SHARD)
    return {"case": case, "device": dev, "elements": elems, "bytes_per_elem": BYTES_PER_ELEM,
            "copy_gbs": copy, "floor_ms": floor_ms, "shardadam_over_floor": shard["ms"] / floor_ms,
            "rows": rows}


def case_fp32(dev, n_tensors, elems, cfg, copy, foreach=True):
    sizes = split(elems, n_tensors)
    params, grads = rand(sizes, dev), rand(sizes, dev)
    impls = {TORCH_FUSED: lambda: torch_step(params, grads, fused=True)}
    if foreach:
        impls[TORCH_FOREACH] = lambda: torch_step(params, grads, foreach=True)
    impls[SHARD] = lambda: shard_step(params, grads)
    return compare(f"{dev} fp32, {pow2(elems)} el in {n_tensors} t", dev, impls, elems, cfg, copy)


def case_mixed(dev, n_tensors, elems, cfg, copy):
    sizes = split(elems, n_tensors)
    params, grads = rand(sizes, dev), rand(sizes, dev)
    grads_bf16 = [g.to(torch.bfloat16) for g in grads]
    params_out = [p.to(torch.bfloat16) for p in params]
    impls = {TORCH_FUSED_COPY: lambda: torch_step_then_copy(params, grads, params_out),
             SHARD: lambda: shard_step(params, grads_bf16, params_out)}
    return compare(f"{dev} fp32 master + bf16, {pow2(elems)} el in {n_tensors} t", dev, impls, elems, cfg, copy)


def case_many(dev, n_tensors, numel, cfg, copy):
    sizes = [numel] * n_tensors
    params, grads = rand(sizes, dev), rand(sizes, dev)
    impls = {TORCH_FUSED: lambda: torch_step(params, grads, fused=True),
             SHARD: lambda: shard_step(params, grads)}
    return compare(f"{dev} fp32, {n_tensors} x {numel} el", dev, impls, n_tensors * numel, cfg, copy,
                   host=dev == "cuda")


def run_cuda(quick: bool) -> list[dict]:
    big, many = (1 << 22, 2000) if quick else (1 << 30, 20000)
    cfg = Cfg(reps=10 if quick else 20, warmup=3)
    copy = copy_gbs("cuda", 1 << 28, reps=50, warmup=5)
    return [case_fp32("cuda", 200, big, cfg, copy),
            case_mixed("cuda", 200, big, cfg, copy),
            case_many("cuda", many, 12800, cfg, copy)]


def run_cpu(quick: bool) -> list[dict]:
    big, many = (1 << 22, 2000) if quick else (1 << 25, 20000)
    cfg = Cfg(reps=10, warmup=2)
    copy = copy_gbs("cpu", 1 << 25, reps=10, warmup=2)
    return [case_fp32("cpu", 64, big, cfg, copy, foreach=False),
            case_many("cpu", many, 1000, cfg, copy)]


def run_interleaved(quick: bool, reps: int) -> str:
    """run_cpu's two cases (smaller with quick), torch's step and then
    shardadam's, reps times after 3 warm-up rounds: the median ms of each."""
    rows = []
    for count, numel in [(16, 2 ** 12), (200, 100)] if quick else [(64, 2 ** 19), (20_000, 1000)]:
        sizes = [numel] * count
        steps = {"torch": torch_step(rand(sizes, "cpu"), rand(sizes, "cpu"), fused=True),
                 "shardadam": shard_step(rand(sizes, "cpu"), rand(sizes, "cpu"))}
        times = interleaved({name: functools.partial(clock_ms, fn) for name, fn in steps.items()}, reps + 3)
        theirs, ours = (statistics.median(times[name][3:]) for name in steps)
        rows.append([f"fp32, {count} x {numel}", f"{ours:.3f}", f"{theirs:.3f}", f"{theirs / ours:.2f}x"])
        del steps
    return md_table(["case", "shardadam ms", "torch fused ms", "speedup"], rows)


def markdown(cases: list[dict]) -> str:
    rows = [[c["case"], r["impl"], f"{r['ms']:.3f}", f"{r['host_ms']:.3f}" if "host_ms" in r else "",
             f"{r['gbs']:.1f}", f"{r['pct_copy']:.1f}", f"{r['speedup_vs_torch']:.2f}x"]
            for c in cases for r in c["rows"]]
    lines = [md_table(["case", "impl", "ms/step", "host ms", "GB/s (28 B/el)", "% of copy", "speedup vs torch"],
                      rows, "llrrrrr"), "",
             "GB/s: 28 B per element / ms (the same count for every impl). Rows with a host ms: ms is the wall time "
             "per step of back-to-back steps, host ms the median time for the call to return.", ""]
    lines += [f"- {c['case']}: copy {c['copy_gbs']:.1f} GB/s, bandwidth floor {c['floor_ms']:.3f} ms, "
              f"shardadam {c['shardadam_over_floor']:.2f}x the floor" for c in cases]
    return "\n".join(lines)


def plot(cases: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return
    colors = {TORCH_FUSED: "tab:blue", TORCH_FUSED_COPY: "tab:cyan", TORCH_FOREACH: "tab:orange",
              SHARD: "tab:green", COPY: "tab:gray"}
    gbs = [{r["impl"]: r["gbs"] for r in c["rows"]} | {COPY: c["copy_gbs"]} for c in cases]
    impls = [impl for impl in colors if any(impl in g for g in gbs)]
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(cases)), 4.5))
    for k, impl in enumerate(impls):
        xs = [i + (k - (len(impls) - 1) / 2) * width for i, g in enumerate(gbs) if impl in g]
        ax.bar(xs, [g[impl] for g in gbs if impl in g], width, label=impl, color=colors[impl])
    ax.set_xticks(range(len(cases)), [c["case"].replace(", ", "\n") for c in cases], fontsize=8)
    ax.set_ylabel("effective GB/s (28 B/element; copy: read + write)")
    ax.set_title(f"shardadam {shardadam.__version__} vs torch {torch.__version__} AdamW")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--out", help="write all figures as JSON here")
    ap.add_argument("--plot", help="write a bandwidth bar chart (PNG) here")
    ap.add_argument("--interleaved", action="store_true", help="only the CPU steps in turn with torch's")
    ap.add_argument("--reps", type=int, default=30, help="--interleaved: timed rounds")
    args = ap.parse_args()
    if args.interleaved:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        print(run_interleaved(args.quick, args.reps))
        return
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        if args.device == "cuda":
            raise SystemExit("--device cuda: torch sees no CUDA device")
        devices.remove("cuda")
        print("no CUDA device: running the CPU cases only", file=sys.stderr)

    torch.manual_seed(0)
    meta = dict(run_meta("cuda" if "cuda" in devices else None), quick=args.quick,
                gpu=torch.cuda.get_device_name() if "cuda" in devices else None, check_rel_err={})
    cases = []
    for dev in devices:
        meta["check_rel_err"][dev] = check(dev)
        cases += run_cuda(args.quick) if dev == "cuda" else run_cpu(args.quick)

    print(f"torch {meta['torch']}, shardadam {meta['shardadam']}, {meta['cpu_threads']} CPU threads"
          + (f", {meta['gpu']}" if meta["gpu"] else "") + f"; rel err vs torch: {meta['check_rel_err']}\n")
    print(markdown(cases))
    write_json(args.out, indent=2, meta=meta, cases=cases)
    if args.plot:
        plot(cases, args.plot)


if __name__ == "__main__":
    main()
