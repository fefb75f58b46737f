#!/usr/bin/env python
"""Memory per phase, measured on the allocator, side by side with torch.optim.AdamW.

Goal: FusedAdam's steady and peak memory equal torch fused AdamW's at equal
precision; each low-bit kind's peak is below torch's by its state saving;
steady memory equals the accounting. Judged by steady / accounted (1.00) and
steady and peak over torch's case of the same parameter dtype. Each case trains
the same GPT for 3 iterations (DistributedFusedAdam on a one-rank group); on
the CPU: the accounting only.

    python benchmarks/bench_memory.py --out $OUT/bench_memory.json        # one GPU; d_model 2048, 24 layers
    python benchmarks/bench_memory.py --device cpu --tiny                  # the accounting alone, on the CPU
"""
from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist

import shardadam
from harness import choose, held_tensors, init_one_rank, md_table, run_meta, write_json
from models import FULL, SIZE_KEYS, add_size_args, build_model, fill_defaults, lm_loss

GIB = 2 ** 30
B8 = shardadam.BLOCKWISE8
FP32, BF16 = "torch AdamW fp32", "torch AdamW bf16"
BUFFERS = dict(contiguous_param_buffer=True, contiguous_grad_buffer=True)


def fused(**options):
    return lambda ps, lr, _: shardadam.FusedAdam(ps, lr=lr, **options)


def distributed(**options):
    return lambda ps, lr, _: shardadam.DistributedFusedAdam(ps, lr=lr, **options)


def torch_adamw(ps, lr, fused_flag):
    return torch.optim.AdamW(ps, lr=lr, **fused_flag)


# name -> (parameter dtype, builder(params, lr, fused flag) -> optimizer, torch case it is compared with)
CASES = {
    FP32: (torch.float32, torch_adamw, None),
    "FusedAdam fp32": (torch.float32, fused(), FP32),
    "FusedLion fp32": (torch.float32, lambda ps, lr, _: shardadam.FusedLion(ps, lr=lr), FP32),
    "FusedAdam fp32, fp16 scaled states": (torch.float32, fused(exp_avg_dtype=torch.float16,
                                                                exp_avg_sq_dtype=torch.float16), FP32),
    "FusedAdam fp32, FP8 exp_avg": (torch.float32, fused(exp_avg_dtype=torch.uint8), FP32),
    "FusedAdam fp32, FP8 states": (torch.float32, fused(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8), FP32),
    "FusedAdam fp32, 8-bit states": (torch.float32, fused(exp_avg_dtype=B8, exp_avg_sq_dtype=B8), FP32),
    "FusedAdam fp32, host state": (torch.float32, fused(state_device="cpu"), FP32),
    BF16: (torch.bfloat16, torch_adamw, None),
    "FusedAdam bf16, fp32 masters": (torch.bfloat16, fused(master_weights=True), BF16),
    "FusedAdam bf16, remainders": (torch.bfloat16, fused(store_param_remainders=True), BF16),
    "FusedAdam bf16, stochastic rounding": (torch.bfloat16, fused(bf16_stochastic_round=True), BF16),
    "FusedAdam bf16, stochastic rounding + 8-bit": (torch.bfloat16, fused(
        bf16_stochastic_round=True, exp_avg_dtype=B8, exp_avg_sq_dtype=B8), BF16),
    "DistributedFusedAdam fp32": (torch.float32, distributed(**BUFFERS), FP32),
    "DistributedFusedAdam fp32, 8-bit states": (torch.float32, distributed(
        exp_avg_dtype=B8, exp_avg_sq_dtype=B8, **BUFFERS), FP32),
    "DistributedFusedAdam bf16, stochastic rounding + 8-bit": (torch.bfloat16, distributed(
        bf16_stochastic_round=True, exp_avg_dtype=B8, exp_avg_sq_dtype=B8, **BUFFERS), BF16),
    "DistributedFusedAdam fp32, separate buffers": (torch.float32, distributed(), FP32),
    "DistributedFusedAdam bf16, stochastic rounding + 8-bit, separate buffers": (torch.bfloat16, distributed(
        bf16_stochastic_round=True, exp_avg_dtype=B8, exp_avg_sq_dtype=B8), BF16),
}


def accounted_bytes(model, opt, device: torch.device) -> int:
    """Bytes of the distinct storages on `device` that the model's parameters
    and the optimizer hold between steps."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(model.parameters()) + held_tensors(opt) if t.device == device and t.numel()}
    return sum(storages.values())


def run_case(name: str, args, device: torch.device) -> dict:
    dtype, build, _ = CASES[name]
    cuda = device.type == "cuda"
    model = build_model(args, device).to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    opt = build(model.parameters(), 1e-4, dict(fused=True) if cuda else {})
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def allocated() -> int:
        return torch.cuda.memory_allocated(device) if cuda else 0

    def measure(fn) -> dict:
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        fn()
        if not cuda:
            return dict(after=0, peak=0)
        torch.cuda.synchronize(device)
        return dict(after=allocated(), peak=torch.cuda.max_memory_allocated(device))

    record = dict(name=name, params=n_params, param_dtype=str(dtype).replace("torch.", ""), iterations=[],
                  built=allocated())
    out = {}
    for _ in range(args.iters):
        phases = dict(forward=measure(lambda: out.update(loss=lm_loss(model, x, y, cuda))),
                      backward=measure(lambda: out.pop("loss").backward()), step=measure(opt.step),
                      zero_grad=measure(lambda: opt.zero_grad(set_to_none=True)))
        record["iterations"].append(phases)
    with torch.no_grad():
        final = lm_loss(model, x, y, cuda).item()
    if not torch.isfinite(torch.tensor(final)):
        raise RuntimeError(f"{name}: the loss is not finite after {args.iters} iterations")
    its = record["iterations"]
    record.update(final_loss=final, accounted=accounted_bytes(model, opt, device),
                  steady=its[-1]["zero_grad"]["after"], peak=max(ph["peak"] for it in its for ph in it.values()),
                  peak_after_first_step=max(ph["peak"] for it in its[1:] for ph in it.values()) if len(its) > 1
                  else max(ph["peak"] for ph in its[0].values()))
    del model, opt, tokens, x, y, out
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        record["left_behind"] = allocated()
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
                     f"{r['peak_after_first_step'] / GIB:.2f}",
                     f"{r['steady'] / ref['steady']:.3f}" if ref else "1",
                     f"{r['peak_after_first_step'] / ref['peak_after_first_step']:.3f}" if ref else "1"])
    return md_table(["case", "B/param accounted", "steady GiB", "accounted GiB", "steady / accounted", "peak GiB",
                     "peak after step 1 GiB", "steady / torch", "peak / torch"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    add_size_args(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--cases", default=";".join(CASES), help="case names separated by semicolons")
    ap.add_argument("--out", default=None, help="write every record as JSON here")
    args = ap.parse_args()
    fill_defaults(args, FULL, SIZE_KEYS)
    names = choose(ap, args.cases, CASES, "--cases", ";")
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    init_one_rank(device, bind_device=True)
    records = []
    for name in names:
        if "host state" in name and not cuda:
            continue  # the CPU's state is host state already
        records.append(run_case(name, args, device))
        r = records[-1]
        print(f"{name}: steady {r['steady'] / GIB:.3f} GiB, accounted {r['accounted'] / GIB:.3f} GiB, "
              f"peak {r['peak'] / GIB:.3f} GiB, loss {r['final_loss']:.4f}", flush=True)
    meta = run_meta(device, model=dict(d_model=args.d_model, layers=args.layers, heads=args.heads, vocab=args.vocab,
                                       seq=args.seq, batch=args.batch), iters=args.iters)
    dist.destroy_process_group()
    print(table(records, cuda))
    write_json(args.out, meta=meta, records=records)


if __name__ == "__main__":
    main()
