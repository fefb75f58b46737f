#!/usr/bin/env python
"""Memory per phase, measured on the allocator, side by side with torch.optim.AdamW.

Goal: the memory the README promises is what the allocator holds. FusedAdam's
steady and peak memory equal torch fused AdamW's at equal precision (within
1%); each low-bit kind's peak is below torch's by its whole state saving;
DistributedFusedAdam's steady memory equals its accounting (within 2%) and
its first step adds no transient beyond one bucket.

Each case builds the same GPT from the same seed, then runs 3 iterations of
forward (bf16 autocast on the GPU), backward, step() and
zero_grad(set_to_none=True). After each phase: ``memory_allocated()``; within
each phase: ``max_memory_allocated()`` (reset before it). Beside them the
accounting: the bytes of every distinct storage the model and the optimizer
hold between steps (parameters, states, masters, remainders, scales, block
maxima, shards and buffers), which is what steady memory must be.

Judged by: steady / accounting (1.00 is the goal) and, per case, peak and
steady against torch's case of the same parameter dtype (the ratio column).

    python benchmarks/bench_memory.py --out $OUT/bench_memory.json        # one GPU; d_model 2048, 24 layers
    python benchmarks/bench_memory.py --device cpu --tiny                  # the accounting alone, on the CPU

DistributedFusedAdam runs on a one-rank process group of this process (NCCL on
the GPU, gloo on the CPU). On the CPU there is no allocator to ask: the run
prints the accounting and checks that every case trains.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_distributed import GPT, held_tensors  # noqa: E402  (the benchmarks' GPT and optimizer tensors)

import shardadam  # noqa: E402

GIB = 2 ** 30
B8 = shardadam.BLOCKWISE8

# name -> (parameter dtype, builder(params, lr) -> optimizer, torch case it is compared with)
CASES = {
    "torch AdamW fp32": (torch.float32, lambda ps, lr, fused: torch.optim.AdamW(ps, lr=lr, **fused), None),
    "FusedAdam fp32": (torch.float32, lambda ps, lr, _: shardadam.FusedAdam(ps, lr=lr), "torch AdamW fp32"),
    "FusedLion fp32": (torch.float32, lambda ps, lr, _: shardadam.FusedLion(ps, lr=lr), "torch AdamW fp32"),
    "FusedAdam fp32, fp16 scaled states": (torch.float32, lambda ps, lr, _: shardadam.FusedAdam(
        ps, lr=lr, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16), "torch AdamW fp32"),
    "FusedAdam fp32, FP8 exp_avg": (torch.float32, lambda ps, lr, _: shardadam.FusedAdam(
        ps, lr=lr, exp_avg_dtype=torch.uint8), "torch AdamW fp32"),
    "FusedAdam fp32, 8-bit states": (torch.float32, lambda ps, lr, _: shardadam.FusedAdam(
        ps, lr=lr, exp_avg_dtype=B8, exp_avg_sq_dtype=B8), "torch AdamW fp32"),
    "FusedAdam fp32, host state": (torch.float32, lambda ps, lr, _: shardadam.FusedAdam(
        ps, lr=lr, state_device="cpu"), "torch AdamW fp32"),
    "torch AdamW bf16": (torch.bfloat16, lambda ps, lr, fused: torch.optim.AdamW(ps, lr=lr, **fused), None),
    "FusedAdam bf16, fp32 masters": (torch.bfloat16, lambda ps, lr, _: shardadam.FusedAdam(
        ps, lr=lr, master_weights=True), "torch AdamW bf16"),
    "FusedAdam bf16, remainders": (torch.bfloat16, lambda ps, lr, _: shardadam.FusedAdam(
        ps, lr=lr, store_param_remainders=True), "torch AdamW bf16"),
    "FusedAdam bf16, stochastic rounding": (torch.bfloat16, lambda ps, lr, _: shardadam.FusedAdam(
        ps, lr=lr, bf16_stochastic_round=True), "torch AdamW bf16"),
    "FusedAdam bf16, stochastic rounding + 8-bit": (torch.bfloat16, lambda ps, lr, _: shardadam.FusedAdam(
        ps, lr=lr, bf16_stochastic_round=True, exp_avg_dtype=B8, exp_avg_sq_dtype=B8), "torch AdamW bf16"),
    "DistributedFusedAdam fp32": (torch.float32, lambda ps, lr, _: shardadam.DistributedFusedAdam(
        ps, lr=lr, contiguous_param_buffer=True, contiguous_grad_buffer=True), "torch AdamW fp32"),
    "DistributedFusedAdam fp32, 8-bit states": (torch.float32, lambda ps, lr, _: shardadam.DistributedFusedAdam(
        ps, lr=lr, contiguous_param_buffer=True, contiguous_grad_buffer=True, exp_avg_dtype=B8,
        exp_avg_sq_dtype=B8), "torch AdamW fp32"),
    "DistributedFusedAdam bf16, stochastic rounding + 8-bit": (
        torch.bfloat16, lambda ps, lr, _: shardadam.DistributedFusedAdam(
            ps, lr=lr, contiguous_param_buffer=True, contiguous_grad_buffer=True, bf16_stochastic_round=True,
            exp_avg_dtype=B8, exp_avg_sq_dtype=B8), "torch AdamW bf16"),
    "DistributedFusedAdam fp32, separate buffers": (torch.float32, lambda ps, lr, _: shardadam.DistributedFusedAdam(
        ps, lr=lr), "torch AdamW fp32"),
    "DistributedFusedAdam bf16, stochastic rounding + 8-bit, separate buffers": (
        torch.bfloat16, lambda ps, lr, _: shardadam.DistributedFusedAdam(
            ps, lr=lr, bf16_stochastic_round=True, exp_avg_dtype=B8, exp_avg_sq_dtype=B8), "torch AdamW bf16"),
}
PHASES = ("forward", "backward", "step", "zero_grad")


def accounted_bytes(model, opt, device: torch.device) -> int:
    """Bytes of the distinct storages on `device` that the model's parameters
    and the optimizer hold between steps."""
    storages = {}
    for t in list(model.parameters()) + held_tensors(opt):
        if t.device != device or not t.numel():
            continue
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def run_case(name: str, args, device: torch.device) -> dict:
    dtype, build, _ = CASES[name]
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    with device:
        model = GPT(args.d_model, args.layers, args.heads, args.vocab, args.seq).to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    opt = build(model.parameters(), 1e-4, dict(fused=True) if cuda else {})
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def allocated() -> int:
        return torch.cuda.memory_allocated(device) if cuda else 0

    def measure(fn) -> tuple[int, int]:
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        fn()
        if cuda:
            torch.cuda.synchronize(device)
            return allocated(), torch.cuda.max_memory_allocated(device)
        return 0, 0

    record = dict(name=name, params=n_params, param_dtype=str(dtype).replace("torch.", ""), iterations=[])
    record["built"] = allocated()
    losses = []
    out = {}
    for _ in range(args.iters):
        phases = {}

        def forward():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                logits = model(x)
            out["loss"] = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

        def backward():
            out.pop("loss").backward()

        phases["forward"] = measure(forward)
        losses.append(None)
        phases["backward"] = measure(backward)
        phases["step"] = measure(opt.step)
        phases["zero_grad"] = measure(lambda: opt.zero_grad(set_to_none=True))
        record["iterations"].append({k: dict(after=a, peak=p) for k, (a, p) in phases.items()})
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        final = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item()
    if not torch.isfinite(torch.tensor(final)):
        raise RuntimeError(f"{name}: the loss is not finite after {args.iters} iterations")
    record["final_loss"] = final
    record["accounted"] = accounted_bytes(model, opt, device)
    last = record["iterations"][-1]
    record["steady"] = last["zero_grad"]["after"]
    record["peak"] = max(ph["peak"] for it in record["iterations"] for ph in it.values())
    record["peak_after_first_step"] = max(ph["peak"] for it in record["iterations"][1:] for ph in it.values()) \
        if len(record["iterations"]) > 1 else record["peak"]
    del model, opt, tokens, x, y, out
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        record["left_behind"] = allocated()
        torch.cuda.empty_cache()
    return record


def table(records: list[dict], cuda: bool) -> str:
    by_name = {r["name"]: r for r in records}
    rows = ["| case | B/param accounted | steady GiB | accounted GiB | steady / accounted | peak GiB "
            "| peak after step 1 GiB | steady / torch | peak / torch |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        ref = by_name.get(CASES[r["name"]][2])
        n = r["params"]
        if not cuda:
            rows.append(f"| {r['name']} | {r['accounted'] / n:.2f} | - | {r['accounted'] / GIB:.3f} | - | - | - "
                        "| - | - |")
            continue
        vs_steady = f"{r['steady'] / ref['steady']:.3f}" if ref else "1"
        vs_peak = f"{r['peak_after_first_step'] / ref['peak_after_first_step']:.3f}" if ref else "1"
        rows.append(f"| {r['name']} | {r['accounted'] / n:.2f} | {r['steady'] / GIB:.2f} | "
                     f"{r['accounted'] / GIB:.2f} | {r['steady'] / r['accounted']:.3f} | {r['peak'] / GIB:.2f} | "
                     f"{r['peak_after_first_step'] / GIB:.2f} | {vs_steady} | {vs_peak} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model of d_model 64 (a smoke run)")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--cases", default=";".join(CASES), help="case names separated by semicolons")
    ap.add_argument("--out", default=None, help="write every record as JSON here")
    args = ap.parse_args()
    if args.tiny:
        args.d_model, args.layers, args.heads, args.vocab, args.seq = 64, 2, 4, 256, 32
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, device_id=device if cuda else None)
    names = [c.strip() for c in args.cases.split(";") if c.strip()]
    for name in names:
        if name not in CASES:
            raise SystemExit(f"unknown case {name!r}; known: {list(CASES)}")
    records = []
    for name in names:
        if "host state" in name and not cuda:
            continue  # the CPU's state is host state already
        records.append(run_case(name, args, device))
        r = records[-1]
        print(f"{name}: steady {r['steady'] / GIB:.3f} GiB, accounted {r['accounted'] / GIB:.3f} GiB, "
              f"peak {r['peak'] / GIB:.3f} GiB, loss {r['final_loss']:.4f}", flush=True)
    dist.destroy_process_group()
    print(table(records, cuda))
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__,
                    model=dict(d_model=args.d_model, layers=args.layers, heads=args.heads, vocab=args.vocab,
                               seq=args.seq, batch=args.batch), iters=args.iters)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, records=records), f, indent=1)


if __name__ == "__main__":
    main()
