"""The benchmarks import, and their CPU / tiny modes run and report what they
measure: each script in a child process as its documented command runs it, the
shared harness pieces against plain references."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import xml.dom.minidom

import pytest
import torch

import shardadam

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py"))


@pytest.fixture(autouse=True)
def benchmarks_on_path(monkeypatch):
    """The benchmarks import each other by name, as their scripts do."""
    monkeypatch.syspath_prepend(str(BENCH))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script: str, *args: str, ranks: int = 0, cwd=None) -> str:
    """The script's stdout; ranks=1 runs it as a one-rank torchrun process would
    (the environment, without the launcher), ranks > 1 under torchrun."""
    # The shardadam this test imported (installed, or the source tree with its built core), not ROOT/python:
    # a clean checkout's source tree has no compiled core.
    package_dir = str(pathlib.Path(shardadam.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_dir, str(BENCH)]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCH / f"{script}.py"), *args]
    if ranks == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    elif ranks > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script} {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def table_rows(out: str) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    return {r[0]: r[1:] for r in rows}


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_imports_and_states_its_goal(name):
    module = __import__(name)
    assert module.__doc__ and len(module.__doc__.split()) > 10


# ------------------------------------------------------------------ the shared harness

def test_time_wall_and_host_leaves_out_the_setup():
    from timing import time_wall_and_host
    calls = []
    time_wall_and_host(lambda: calls.append("fn"), "cpu", reps=4, warmup=1, setup=lambda: calls.append("setup"))
    # warm-up, the wall loop, the setup-only loop (subtracted), the host loop: setup before every call
    assert calls == ["setup", "fn"] * 5 + ["setup"] * 4 + ["setup", "fn"] * 4


def test_interleaved_calls_the_cases_in_turn_every_other_round_backwards():
    from timing import interleaved
    order = []
    out = interleaved({"a": lambda: order.append("a") or len(order), "b": lambda: order.append("b") or len(order)}, 3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert out == {"a": [1, 4, 5], "b": [2, 3, 6]}


def test_stopwatch_laps_on_the_host_clock():
    from timing import Stopwatch
    watch = Stopwatch("cpu")
    for _ in range(3):
        watch.mark()
    assert len(watch.laps_ms()) == 2 and all(lap >= 0 for lap in watch.laps_ms())


def test_md_table_and_fmt():
    from harness import fmt, md_table
    assert md_table(["a", "b"], [[1, fmt(None, ".2f")], ["x", fmt(2.0, ".2f")]]) == \
        "| a | b |\n|---|---:|\n| 1 | - |\n| x | 2.00 |"


def test_gpt_matches_its_parameter_count():
    from types import SimpleNamespace

    from models import TINY, build_model
    args = SimpleNamespace(**TINY, seed=0)
    d, v, s, n = args.d_model, args.vocab, args.seq, args.layers
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    assert sum(p.numel() for p in build_model(args, "meta").parameters()) == v * d + s * d + n * block + 2 * d + d * v \
        == 134_912
    a, b = build_model(args, "cpu"), build_model(args, "cpu")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_svg_ticks_cover_the_range():
    from svg import nice_ticks
    assert nice_ticks(305.1, 318.6) == [305.0, 310.0, 315.0, 320.0]
    assert nice_ticks(3, 3) == [3.0, 4.0]


# ------------------------------------------------------------------ the scripts' CPU modes

def test_bench_memory_layouts_count_the_bytes_exactly():
    rows = table_rows(run("bench_memory", "--layouts", ranks=1))
    # One rank holds every byte: fp32 master, exp_avg, exp_avg_sq and an fp32
    # gradient shard (16 B), plus bucket padding; the contiguous buffers hold
    # the model's fp32 parameters and gradients (8 B) and the shards are views.
    assert rows["fp32 params, fp32 state"] == ["16.48", "0.00"]
    assert rows["fp32 params, contiguous param + grad buffers"] == ["8.24", "8.24"]


def test_bench_memory_accounts_torch_adamw_as_torch_holds_it():
    rows = table_rows(run("bench_memory", "--device", "cpu", "--tiny", "--cases",
                          "torch AdamW fp32;FusedAdam fp32;FusedAdam fp32, 8-bit states;DistributedFusedAdam fp32"))
    # torch.optim.AdamW keeps exp_avg and exp_avg_sq beside the fp32 parameters: 12 B each.
    assert rows["torch AdamW fp32"][0] == rows["FusedAdam fp32"][0] == "12.00"
    assert float(rows["FusedAdam fp32, 8-bit states"][0]) < 6.1


def test_bench_distributed_tiny_trains_every_implementation():
    out = run("bench_distributed", "--tiny", "--iters", "2", ranks=1)
    rows = table_rows(out)
    assert set(rows) >= {"compute_only", "ddp_fused", "fsdp2", "zero1", "shardadam"}
    assert rows["ddp_fused"][2] == "1.000" and "failed" not in out
    assert "loss not finite" not in out


def test_bench_distributed_capture_tiny(tmp_path):
    out = run("bench_distributed", "--capture", "--tiny", "--iters", "2", "--configs", "ddp_fused,fp32,bf16_remainders",
              "--out", str(tmp_path / "c.json"), ranks=1)
    assert "every loss finite and falling" in out
    assert {r["config"] for r in json.loads((tmp_path / "c.json").read_text())["results"]} == \
        {"ddp_fused", "fp32", "bf16_remainders"}


def test_bench_checkpoint_tiny_restores_both_formats(tmp_path):
    out = run("bench_checkpoint", "--tiny", "--dir", str(tmp_path / "ckpt"), ranks=2)
    assert "restored bit for bit after a further training iteration: portable, sharded (DCP)" in out


def test_first_use_and_fsdp2_step_tiny():
    out = run("bench_host_cost", "first-use", "--tiny", "--iters", "2", ranks=1)
    assert set(table_rows(out)) >= {"no_overlap", "hooks_only", "hooks_and_guard", "guard_only"}
    out = run("bench_distributed", "--fsdp2-step", "--tiny", ranks=1)
    assert table_rows(out)["torch_fused"][5] == "1.000" and "losses finite and falling: True" in out


def test_soak_short_run_and_its_plot(tmp_path):
    out = run("soak", "--steps", "20", "--sample-every", "2", "--out", str(tmp_path / "s.json"), ranks=1)
    assert "PASS" in out
    xml.dom.minidom.parse(str(tmp_path / "s.svg"))


def test_quality_scripts_tiny(tmp_path):
    out = run("quality_gpt", "--tiny", "--steps", "10", "--chars", "20000", "--kinds",
              "fp32,8-bit blockwise states,Muon + AdamW", "--out", str(tmp_path / "q"), ranks=1)
    assert table_rows(out)["fp32"][1] == "+0.00%" and "Muon + AdamW" in table_rows(out)
    out = run("quality_storage", "--steps", "12", "--chars", "20000", "--batch", "2", "--ctx", "16",
              "--kinds", "fp32,FP8 exp_avg,Muon + AdamW", "--lr-scales", "1,2", "--out", str(tmp_path / "s"))
    rows = table_rows(out)
    assert rows["fp32"][1] == "+0.00%" and {"fp32, lr x2", "Muon + AdamW", "Muon + AdamW, lr x2"} <= set(rows)
    for path in (tmp_path / "q.svg", tmp_path / "s.svg"):
        xml.dom.minidom.parse(str(path))


def test_bench_capacity_one_size_per_candidate():
    out = run("bench_capacity", "--nproc", "1", "--candidates", "ddp,host:8-bit blockwise states", "--d-model", "64",
              "--heads", "4", "--vocab", "256", "--seq", "32", "--batch", "2", "--layers", "1", "--start", "1")
    rows = table_rows(out)
    assert rows["ddp"][0] == rows["host:8-bit blockwise states"][0] == "1"


def test_kernel_and_step_benchmarks_on_the_cpu():
    out = run("bench_kernels", "--interleaved", "--quick", "--reps", "3")
    assert len(table_rows(out)) == 3
    out = run("bench_host_cost", "plan-checks", "--device", "cpu", "--tensors", "200", "--reps", "5")
    assert "800 tensors checked, 600 version counters bumped per launch" in out
    out = run("bench_host_cost", "grad-handover", "--device", "cpu", "--params", "20", "--buckets", "4", "--iters", "3")
    assert "per extra bucket" in out
    out = run("bench_storage_kinds", "--device", "cpu", "--numel", "12", "--tensors", "1,2", "--reps", "1",
              "--warmup", "1", "--kinds", "shardadam fp32,8-bit,torch fused fp32")
    assert {"| 1 | shardadam fp32 | 28", "| 2 | shardadam 8-bit blockwise states | 16.06"} <= \
        {"|".join(line.split("|")[:4]).strip() for line in out.splitlines()}


def test_bench_kernels_and_fused_adam_cases_on_small_cpu_tensors(tmp_path):
    import bench_kernels
    cfg = (2, 1)  # reps, warmup
    case = bench_kernels.case("cpu", "many", 20, 64, cfg, copy=1.0)
    assert [r["impl"] for r in case["rows"]] == ["torch fused", "shardadam"]
    fused = bench_kernels.case_fused_adam("cpu", [(64,)] * 10, "small", cfg, copy=1.0)
    assert [r["impl"] for r in fused["rows"]] == list(bench_kernels.FUSED_ADAM)
    assert "| cpu small | FusedAdam flat_grads |" in bench_kernels.markdown([fused])
    (tmp_path / "k.json").write_text(json.dumps(dict(meta=dict(shardadam="x", torch="y"), cases=[case, fused])))
    run("svg", str(tmp_path / "k.json"))
    assert xml.dom.minidom.parse(str(tmp_path / "k.svg")).documentElement.tagName == "svg"


def test_bench_hf_llama_tiny(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "llama.json"
    run("bench_hf_llama", "--tiny", "--device", "cpu", "--steps", "3", "--warmup", "1", "--runs", "shardadam,ddp",
        "--out", str(out), ranks=1)
    runs = json.loads(out.read_text())["runs"]
    # the same model, seed and batches: the first step's loss is the same before either optimizer acts
    assert runs["shardadam"]["losses"][0] == pytest.approx(runs["ddp"]["losses"][0], rel=1e-6)
    run("svg", str(out))
    xml.dom.minidom.parse(str(out.with_suffix(".svg")))


@pytest.mark.cuda
def test_gpu_modes_of_the_benchmarks(tmp_path):
    """What the CPU runs cannot reach: the kernel and FusedAdam cases on the GPU, captured runs, optimizer state in
    host memory with its timelines (both optimizers), and a host-state capacity attempt."""
    out = run("bench_kernels", "--device", "cuda", "--quick")
    assert {"cuda fp32, 2^22 el in 200 t", "cuda fp32 master + bf16, 2^22 el in 200 t", "cuda fp32, 2000 x 12800 el"} \
        <= set(table_rows(out))
    run("bench_kernels", "--fused-adam", "--device", "cuda", "--overhead", "--out", str(tmp_path / "f.json"))
    rows = json.loads((tmp_path / "f.json").read_text())["cases"][0]["rows"]
    assert [r["impl"] for r in rows] == ["torch fused AdamW", "FusedAdam", "FusedAdam, new grads each step",
                                         "FusedAdam flat_grads", "torch fused AdamW on fp32 masters + copy to bf16",
                                         "FusedAdam master_weights (bf16 params)"]
    assert all(r["host_speedup_vs_torch"] > 0 for r in rows)
    out = run("bench_distributed", "--capture", "--tiny", "--iters", "2", "--configs", "ddp_fused,fp32,bf16_remainders",
              ranks=1)
    assert "every loss finite and falling; 2 captured runs within 0.02 of their eager runs' losses" in out
    for optimizer, kind in (("fused", "fp32"), ("distributed", "8-bit")):
        result, timeline = tmp_path / f"{optimizer}.json", tmp_path / f"{optimizer}_timeline.json"
        run("bench_host_state", "--tiny", "--optimizer", optimizer, "--kinds", kind, "--reps", "1", "--rounds", "2",
            "--out", str(result), "--timeline", str(timeline))
        row = json.loads(result.read_text())["kinds"][kind]
        assert len(row["goal"]["over_largest_floor_by_round"]) == 2 and row["host_state_ms"] > 0
        assert all(json.loads(timeline.read_text())["spans"][lane] for lane in ("compute", "down", "cpu", "up"))
        run("svg", str(timeline))
    out = run("bench_capacity", "--candidates", "ddp,host:bf16 stochastic rounding + 8-bit states", "--d-model", "64",
              "--heads", "4", "--vocab", "256", "--seq", "32", "--batch", "2", "--layers", "1", "--start", "1")
    rows = table_rows(out)
    assert rows["ddp"][0] == rows["host:bf16 stochastic rounding + 8-bit states"][0] == "1"


@pytest.mark.parametrize("result", [
    "bench_distributed_s7_final_2xh200.json", "soak_2xh200.json", "host_timeline_distributed_8bit_h200.json"])
def test_plots_redraw_the_recorded_results(tmp_path, result):
    run("svg", str(BENCH / "results" / result), "--out", str(tmp_path / "plot.svg"))
    assert xml.dom.minidom.parse(str(tmp_path / "plot.svg")).documentElement.tagName == "svg"


def test_bench_muon_counts_newton_schulz_flops():
    """Per iteration of an m x n matrix (m <= n, either orientation): X X^T 2 m^2 n, A A 2 m^3, B X 2 m^2 n."""
    import bench_muon
    from collections import Counter
    assert bench_muon.ns_flops(Counter({(2, 4): 1})) == bench_muon.NS_STEPS * (2 * 4 * 4 + 2 * 8 + 2 * 4 * 4)
    assert bench_muon.ns_flops(Counter({(4, 2): 3})) == 3 * bench_muon.ns_flops(Counter({(2, 4): 1}))
