#!/usr/bin/env python
"""shardadam's AdamW against torch's, side by side in one run: the fused kernel, and FusedAdam.step().

The kernel (issue 2): on the GPU at least 90% of a device copy's bandwidth (fp32 and mixed precision) and within 1.3x of
the bandwidth floor at 20,000 tensors; on the CPU at least as fast as torch fused. Judged by "% of copy" and "speedup vs
torch" (torch fused's time over this one's). Bandwidth counts 28 B per element for every implementation (fp32 p, g, m, v
in and p, m, v out; mixed precision: a bf16 grad in and bf16 params_out out), so its ratios are time ratios.

--fused-adam (issue 3): FusedAdam.step()'s host time at 20,000 parameters >= 30x below torch fused AdamW's (under 100 us
with flat_grads), its GPU time within 1.15x of the bandwidth floor. Judged by "speedup vs torch" on the wall time (steps
back to back) and the host time (median time for step() to return from an idle device); 20,000 parameters of 12,800
elements (--quick: 2,000 of 1,280; --overhead: 20,000 of 4, the host cost alone) and GPT-2 medium's shapes.

--interleaved: the CPU steps in turn with torch fused's, as in a training loop, where torch's OpenMP workers keep
spinning after each of its ops on the same cores. Judged by the speedup. svg.py draws the JSON's bandwidths.

    python benchmarks/bench_kernels.py --device cuda --out bench.json
    python benchmarks/bench_kernels.py --device all --quick      # smoke run
    python benchmarks/bench_kernels.py --fused-adam --device cuda --out fused.json [--overhead]
    python benchmarks/bench_kernels.py --interleaved --reps 30
"""
from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys

import torch

import shardadam
from harness import md_table, run_meta, write_json
from models import gpt2_medium_shapes
from shardadam import kernels
from timing import clock_ms, free, interleaved, time_steps, time_wall_and_host

LR, WD, BYTES_PER_ELEM = 1e-3, 1e-2, 28
SHARD = "shardadam"


def split(total: int, n: int) -> list[int]:
    """n tensor sizes adding up to total exactly."""
    return [total // n + (i < total % n) for i in range(n)]


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
    plan = kernels.AdamPlan(params, grads, rand(sizes, params[0].device),
                            rand(sizes, params[0].device, positive=True), params_out=params_out)
    steps = itertools.count(1)
    return lambda: kernels.adam(plan, lr=LR, step=next(steps), weight_decay=WD)


def with_grads(shapes, dev, dtype=torch.float32) -> list[torch.nn.Parameter]:
    """Parameters of these shapes, each with a gradient."""
    params = [torch.nn.Parameter(torch.randn(s, device=dev, dtype=dtype) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def shard_fp32(shapes, dev, new_grads_each_step=False, flat_grads=False):
    """FusedAdam.step, and with new_grads_each_step a setup (not timed) that hands every parameter another gradient
    tensor, as autograd does after zero_grad(set_to_none=True)."""
    params = with_grads(shapes, dev)
    grads = [[p.grad for p in params], [torch.randn_like(p) * 1e-3 for p in params]]
    opt = shardadam.FusedAdam(params, lr=LR, weight_decay=WD, flat_grads=flat_grads)
    turns = itertools.cycle((1, 0))
    step = functools.partial(opt.step)  # a partial takes the .setup attribute a bound method refuses
    step.setup = (lambda: [setattr(p, "grad", g) for p, g in zip(params, grads[next(turns)])]) \
        if new_grads_each_step else None
    return step


def torch_masters(shapes, dev):
    """Transformer Engine's way: torch fused AdamW on fp32 masters, then a copy to the bf16 parameters."""
    masters = with_grads(shapes, dev)
    return torch_step_then_copy(masters, [m.grad for m in masters], [m.detach().bfloat16() for m in masters])


FUSED_ADAM = {
    "torch fused AdamW": lambda s, d: torch.optim.AdamW(with_grads(s, d), lr=LR, weight_decay=WD, fused=True).step,
    "FusedAdam": shard_fp32, "FusedAdam, new grads each step": functools.partial(shard_fp32, new_grads_each_step=True),
    "FusedAdam flat_grads": functools.partial(shard_fp32, flat_grads=True),
    "torch fused AdamW on fp32 masters + copy to bf16": torch_masters,
    "FusedAdam master_weights (bf16 params)": lambda s, d: shardadam.FusedAdam(
        with_grads(s, d, torch.bfloat16), lr=LR, weight_decay=WD, master_weights=True).step,
}


def copy_gbs(dev: str, numel: int, reps: int, warmup: int) -> float:
    src = torch.randn(numel, device=dev)
    ms = statistics.median(time_steps(functools.partial(torch.empty_like(src).copy_, src), dev, reps, warmup))
    return 2 * numel * 4 / ms / 1e6


def compare(case: str, dev: str, impls: dict, elems: int, cfg: tuple, copy: float, host: bool = False) -> dict:
    """Time each implementation, cfg = (reps, warmup), freeing its state after (host: wall and host time, its setup
    untimed), with bandwidth and ratios to the first one."""
    (reps, warmup), rows = cfg, []
    for name, make in impls.items():
        fn = make()
        if host:
            ms, host_ms = time_wall_and_host(fn, dev, reps, warmup, setup=getattr(fn, "setup", None))
            row = {"ms": ms, "host_ms": host_ms}
        else:
            times = time_steps(fn, dev, reps, warmup)
            row = {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}
        del fn
        free(dev)
        gbs = elems * BYTES_PER_ELEM / row["ms"] / 1e6
        rows.append({"impl": name, **row, "gbs": gbs, "pct_copy": 100 * gbs / copy})
        print(f"  {case}: {name}: {row['ms']:.3f} ms", file=sys.stderr)
    for row in rows:
        row["speedup_vs_torch"] = rows[0]["ms"] / row["ms"]
        if host:
            row["host_speedup_vs_torch"] = rows[0]["host_ms"] / row["host_ms"]
    floor_ms = elems * BYTES_PER_ELEM / copy / 1e6
    shard = next(r for r in rows if r["impl"] in (SHARD, "FusedAdam"))
    return {"case": case, "device": dev, "elements": elems, "bytes_per_elem": BYTES_PER_ELEM,
            "copy_gbs": copy, "floor_ms": floor_ms, "shardadam_over_floor": shard["ms"] / floor_ms, "rows": rows}


def case(dev: str, kind: str, n_tensors: int, numel: int, cfg, copy: float) -> dict:
    """numel elements split over n_tensors ("fp32"; "mixed": fp32 masters, bf16 grads and params_out), or
    n_tensors of numel elements each ("many": wall and host time on the GPU, where it is host-bound)."""
    sizes = [numel] * n_tensors if kind == "many" else split(numel, n_tensors)
    params, grads = rand(sizes, dev), rand(sizes, dev)
    impls = {"torch fused": lambda: torch_step(params, grads, fused=True)}
    if kind == "fp32" and dev == "cuda":
        impls["torch foreach"] = lambda: torch_step(params, grads, foreach=True)
    impls[SHARD] = lambda: shard_step(params, grads)
    if kind == "mixed":
        grads_bf16, out = [g.to(torch.bfloat16) for g in grads], [p.to(torch.bfloat16) for p in params]
        impls = {"torch fused + copy": lambda: torch_step_then_copy(params, grads, out),
                 SHARD: lambda: shard_step(params, grads_bf16, out)}
    shape = f"{n_tensors} x {numel} el" if kind == "many" else f"2^{numel.bit_length() - 1} el in {n_tensors} t"
    return compare(f"{dev} {'fp32 master + bf16' if kind == 'mixed' else 'fp32'}, {shape}", dev, impls, sum(sizes),
                   cfg, copy, host=kind == "many" and dev == "cuda")


def case_fused_adam(dev, shapes, name, cfg, copy):
    impls = {impl: functools.partial(make, shapes, dev) for impl, make in FUSED_ADAM.items()}
    return compare(f"{dev} {name}", dev, impls, sum(torch.Size(s).numel() for s in shapes), cfg, copy, host=True)


def run_device(dev: str, args) -> list[dict]:
    cuda = dev == "cuda"
    copy = copy_gbs(dev, 1 << (28 if cuda else 25), reps=50 if cuda else 10, warmup=5 if cuda else 2)
    if args.fused_adam:
        many = [(1280,)] * 2000 if args.quick else [(4,)] * 20000 if args.overhead else [(12800,)] * 20000
        cfg = (20, 3) if cuda else (3, 1)
        return [case_fused_adam(dev, many, f"{len(many)} params x {many[0][0]}", cfg, copy)] + (
            [] if args.quick or args.overhead else [case_fused_adam(dev, gpt2_medium_shapes(), "GPT-2 medium shapes",
                                                                    cfg, copy)])
    if cuda:
        big, many = (1 << 22, 2000) if args.quick else (1 << 30, 20000)
        cfg = (10 if args.quick else 20, 3)
        return [case(dev, "fp32", 200, big, cfg, copy), case(dev, "mixed", 200, big, cfg, copy),
                case(dev, "many", many, 12800, cfg, copy)]
    big, many = (1 << 22, 2000) if args.quick else (1 << 25, 20000)
    return [case(dev, "fp32", 64, big, (10, 2), copy), case(dev, "many", many, 1000, (10, 2), copy)]


def run_interleaved(quick: bool, reps: int) -> str:
    """run_device's two CPU cases (smaller with quick), torch's step and then
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
             f"{r['gbs']:.1f}", f"{r['pct_copy']:.1f}", f"{r['speedup_vs_torch']:.2f}x",
             f"{r['host_speedup_vs_torch']:.2f}x" if "host_ms" in r else ""] for c in cases for r in c["rows"]]
    lines = [md_table(["case", "impl", "ms/step", "host ms", "GB/s (28 B/el)", "% of copy", "speedup vs torch",
                       "host speedup vs torch"], rows, "llrrrrrr"), "",
             "GB/s: 28 B per element / ms (the same count for every impl). Rows with a host ms: ms is the wall time "
             "per step of back-to-back steps, host ms the median time for the call to return.", ""]
    lines += [f"- {c['case']}: copy {c['copy_gbs']:.1f} GB/s, bandwidth floor {c['floor_ms']:.3f} ms, "
              f"shardadam {c['shardadam_over_floor']:.2f}x the floor" for c in cases]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--fused-adam", action="store_true", help="FusedAdam.step() instead of the kernel")
    ap.add_argument("--overhead", action="store_true",
                    help="--fused-adam: only 20,000 parameters of 4 elements: the per-step host cost, nearly no math")
    ap.add_argument("--out", help="write all figures as JSON here")
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
    meta = dict(run_meta("cuda" if "cuda" in devices else None), quick=args.quick, fused_adam=args.fused_adam)
    cases = [case for dev in devices for case in run_device(dev, args)]
    print(f"{meta['device']}, torch {meta['torch']}, shardadam {meta['shardadam']}, {meta['cpu_threads']} threads\n")
    print(markdown(cases))
    write_json(args.out, indent=2, meta=meta, cases=cases)


if __name__ == "__main__":
    main()
