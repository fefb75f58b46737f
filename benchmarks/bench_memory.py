#!/usr/bin/env python
"""Memory per phase, measured on the allocator, side by side with torch.optim.AdamW.

Goal: FusedAdam's steady and peak memory equal torch fused AdamW's at equal precision; each low-bit kind's peak is
below torch's by its state saving; steady memory equals the accounting. Judged by steady / accounted (1.00) and
steady and peak over torch's case of the same parameter dtype. Each case trains the same GPT for 3 iterations
(DistributedFusedAdam on a one-rank group); on the CPU: the accounting only.

--layouts (under torchrun): each DistributedFusedAdam storage mode keeps what its layout promises, 12/N bytes per
parameter for fp32 states and less for the low-bit ones (README, "Memory"). Judged by the bytes per parameter on one
rank of the storages the optimizer owns between steps, each once; the contiguous buffers, which hold the model's own
parameters and gradients, apart. Exact counts: runs on the CPU with gloo.

    python benchmarks/bench_memory.py --out $OUT/bench_memory.json        # one GPU; d_model 2048, 24 layers
    python benchmarks/bench_memory.py --device cpu --tiny                  # the accounting alone, on the CPU
    torchrun --nproc_per_node 2 benchmarks/bench_memory.py --layouts
"""
from __future__ import annotations

import argparse
import gc
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

import shardadam
from harness import (add_device_arg, choose, held_tensors, init_distributed, md_table, model_buffer_storages,
                     optimizer_bytes, run_meta, write_json)
from models import BLOCKWISE8 as B8, FP8, FULL, SIZE_KEYS, add_size_args, build_model, fill_defaults, lm_loss

GIB = 2 ** 30
FP32, BF16 = "torch AdamW fp32", "torch AdamW bf16"
BUFFERS = dict(contiguous_param_buffer=True, contiguous_grad_buffer=True)
SR = dict(bf16_stochastic_round=True)  # stochastic rounding
F32, B16 = torch.float32, torch.bfloat16


# name -> (parameter dtype, the optimizer with its options (None: torch's AdamW), torch case it is compared with)
FA, DFA = partial(shardadam.FusedAdam, lr=1e-4), partial(shardadam.DistributedFusedAdam, lr=1e-4)
CASES = {FP32: (F32, None, None), "FusedAdam fp32": (F32, FA, FP32),
    "FusedLion fp32": (F32, partial(shardadam.FusedLion, lr=1e-4), FP32),
    "FusedAdam fp32, fp16 scaled states": (F32, partial(FA, exp_avg_dtype=torch.float16,
                                                        exp_avg_sq_dtype=torch.float16), FP32),
    "FusedAdam fp32, FP8 exp_avg": (F32, partial(FA, exp_avg_dtype=torch.uint8), FP32),
    "FusedAdam fp32, FP8 states": (F32, partial(FA, **FP8), FP32),
    "FusedAdam fp32, 8-bit states": (F32, partial(FA, **B8), FP32),
    "FusedAdam fp32, host state": (F32, partial(FA, state_device="cpu"), FP32), BF16: (B16, None, None),
    "FusedAdam bf16, fp32 masters": (B16, partial(FA, master_weights=True), BF16),
    "FusedAdam bf16, remainders": (B16, partial(FA, store_param_remainders=True), BF16),
    "FusedAdam bf16, stochastic rounding": (B16, partial(FA, **SR), BF16),
    "FusedAdam bf16, stochastic rounding + 8-bit": (B16, partial(FA, **SR, **B8), BF16),
    "DistributedFusedAdam fp32": (F32, partial(DFA, **BUFFERS), FP32),
    "DistributedFusedAdam fp32, 8-bit states": (F32, partial(DFA, **B8, **BUFFERS), FP32),
    "DistributedFusedAdam bf16, stochastic rounding + 8-bit": (B16, partial(DFA, **SR, **B8, **BUFFERS), BF16),
    "DistributedFusedAdam fp32, separate buffers": (F32, DFA, FP32),
    "DistributedFusedAdam bf16, stochastic rounding + 8-bit, separate buffers": (B16, partial(DFA, **SR, **B8), BF16),
}
# --layouts: name -> (parameter dtype, DistributedFusedAdam options)
LAYOUTS = {"fp32 params, fp32 state": (F32, {}), "fp32 params, amsgrad": (F32, dict(amsgrad=True)),
    "bf16 params, fp32 master": (B16, {}),
    "bf16 params, remainders": (B16, dict(store_param_remainders=True, store_params=False)),
    "bf16 params, scaled fp16 states": (B16, dict(with_scaled_states=True, dtype=torch.float16)),
    "bf16 params, store_params=False": (B16, dict(store_params=False)),
    "fp32 params, contiguous param + grad buffers": (F32, BUFFERS),
    "fp32 params, contiguous buffers, store_params=True": (F32, dict(store_params=True, **BUFFERS)),
    "fp32 params, contiguous buffers, FP8 states": (F32, dict(**FP8, **BUFFERS)),
    "fp32 params, contiguous buffers, 8-bit blockwise states": (F32, dict(**B8, **BUFFERS)),
    "bf16 params, stochastic rounding, 8-bit blockwise states": (B16, dict(**SR, **B8, **BUFFERS)),
    "bf16 params, stochastic rounding, FP8 states": (B16, dict(**SR, **FP8, **BUFFERS)),
}


def layouts() -> None:
    """Each layout's bytes per parameter on this rank (an 8.4M-parameter MLP, 1 MiB buckets)."""
    dist.init_process_group("gloo")
    rows = []
    for name, (dtype, options) in LAYOUTS.items():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(dtype)
        n = sum(p.numel() for p in model.parameters())
        opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-3, bucket_cap_mb=1, **options)
        # shards that are views of the master or of a contiguous buffer add nothing: each storage counts once
        rows.append([name, f"{optimizer_bytes(opt) / n:.2f}", f"{sum(model_buffer_storages(opt).values()) / n:.2f}"])
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, {n:,} parameters, bucket_cap_mb=1; bytes per parameter on one rank")
        print(md_table(["storage", "optimizer", "buffers holding the model's params/grads"], rows))
    dist.destroy_process_group()


def run_case(name: str, args, device: torch.device) -> dict:
    """Memory after and within each phase of every iteration, the accounted bytes (the distinct storages on `device`
    that the parameters and the optimizer hold between steps) and what is left once both are gone."""
    dtype, build, _ = CASES[name]
    cuda = device.type == "cuda"
    model = build_model(args, device).to(dtype)
    opt = build(model.parameters()) if build else torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda or None)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), device=device)
    x, y, out = tokens[:, :-1], tokens[:, 1:], {}

    def measure(fn) -> dict:
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        return dict(after=torch.cuda.memory_allocated(device) if cuda else 0,
                    peak=torch.cuda.max_memory_allocated(device) if cuda else 0)

    its = [dict(forward=measure(lambda: out.update(loss=lm_loss(model, x, y, cuda))),
                backward=measure(lambda: out.pop("loss").backward()), step=measure(opt.step),
                zero_grad=measure(lambda: opt.zero_grad(set_to_none=True))) for _ in range(args.iters)]
    with torch.no_grad():
        final = lm_loss(model, x, y, cuda).item()
    if not torch.isfinite(torch.tensor(final)):
        raise RuntimeError(f"{name}: the loss is not finite after {args.iters} iterations")
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(model.parameters()) + held_tensors(opt) if t.device == device and t.numel()}
    record = dict(name=name, params=sum(p.numel() for p in model.parameters()),
                  param_dtype=str(dtype).replace("torch.", ""), iterations=its, final_loss=final,
                  accounted=sum(storages.values()), steady=its[-1]["zero_grad"]["after"],
                  peak=max(ph["peak"] for it in its for ph in it.values()),
                  peak_after_first_step=max(ph["peak"] for it in its[1:] or its for ph in it.values()))
    del model, opt, tokens, x, y, out
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        record["left_behind"] = torch.cuda.memory_allocated(device)
        torch.cuda.empty_cache()
    return record


def table(records: list[dict], cuda: bool) -> str:
    by_name, rows = {r["name"]: r for r in records}, []
    for r in records:
        ref, n = by_name.get(CASES[r["name"]][2]), r["params"]
        if not cuda:
            rows.append([r["name"], f"{r['accounted'] / n:.2f}", "-", f"{r['accounted'] / GIB:.3f}"] + ["-"] * 5)
            continue
        rows.append([r["name"], f"{r['accounted'] / n:.2f}", f"{r['steady'] / GIB:.2f}", f"{r['accounted'] / GIB:.2f}",
                     f"{r['steady'] / r['accounted']:.3f}", f"{r['peak'] / GIB:.2f}",
                     f"{r['peak_after_first_step'] / GIB:.2f}", f"{r['steady'] / ref['steady']:.3f}" if ref else "1",
                     f"{r['peak_after_first_step'] / ref['peak_after_first_step']:.3f}" if ref else "1"])
    return md_table(["case", "B/param accounted", "steady GiB", "accounted GiB", "steady / accounted", "peak GiB",
                     "peak after step 1 GiB", "steady / torch", "peak / torch"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_arg(ap)
    add_size_args(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--cases", default=";".join(CASES), help="case names separated by semicolons")
    ap.add_argument("--layouts", action="store_true", help="the bytes per parameter of each storage layout instead")
    ap.add_argument("--out", default=None, help="write every record as JSON here")
    args = ap.parse_args()
    if args.layouts:
        return layouts()
    fill_defaults(args, FULL, SIZE_KEYS)
    names = choose(ap, args.cases, CASES, "--cases", ";")
    device, cuda = init_distributed(args.device)
    records = []
    for name in names:
        if "host state" in name and not cuda:
            continue  # the CPU's state is host state already
        records.append(r := run_case(name, args, device))
        print(f"{name}: steady {r['steady'] / GIB:.3f} GiB, accounted {r['accounted'] / GIB:.3f} GiB, "
              f"peak {r['peak'] / GIB:.3f} GiB, loss {r['final_loss']:.4f}", flush=True)
    meta = run_meta(device, config={k: v for k, v in vars(args).items() if k != "out"})
    dist.destroy_process_group()
    print(table(records, cuda))
    write_json(args.out, meta=meta, records=records)


if __name__ == "__main__":
    main()
