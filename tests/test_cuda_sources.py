"""The CUDA sources compile for the oldest architecture nvcc supports.

The default build targets sm_80 and sm_90 (README), but CMAKE_CUDA_ARCHITECTURES
may name any other: instructions of later architectures (FP8 conversions, warp
reductions) stay behind __CUDA_ARCH__ guards with a fallback. nvcc 13 compiles
for sm_75 (Turing) and up; the PTX of each source is built for it here.
Needs nvcc (CI has it; the build itself needs it for SHARDADAM_CUDA=ON)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OLDEST = "sm_75"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: no CUDA sources can be compiled")
def test_every_cuda_source_compiles_for_the_oldest_architecture(tmp_path):
    sources = sorted((ROOT / "cuda").glob("*.cu"))
    assert sources, "no CUDA sources found"
    jobs = [(src, subprocess.Popen(
        ["nvcc", "-std=c++17", "-O1", f"-arch={OLDEST}", "-ptx", f"-I{ROOT / 'cpp'}", f"-I{ROOT / 'cuda'}",
         f'-DSHARDADAM_CUDA_ARCHS="{OLDEST[3:]}"', "-o", str(tmp_path / (src.stem + ".ptx")), str(src)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)) for src in sources]
    failed = {}
    for src, job in jobs:
        out, _ = job.communicate(timeout=600)
        if job.returncode != 0:
            failed[src.name] = out[-2000:]
    assert not failed, f"CUDA sources that do not compile for {OLDEST}: {failed}"
