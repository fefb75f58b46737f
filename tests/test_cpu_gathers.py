"""The CPU engine's table reads for 8-bit states ([Note: CPU gathers] in
cpp/cpu_gather.h) give the same bytes with every instruction set the CPU
has: lane by lane (plain), AVX2 and AVX-512 gathers (with AVX-512 also the
one-pass block encode), chosen when the core loads and capped by
SHARDADAM_CPU_GATHERS."""
import os
import subprocess
import sys

import pytest

import shardadam

LEVELS = ["plain", "avx2", "avx512"]

# Quantizes values over many magnitudes (zeros, subnormals, blocks with a NaN
# or an infinity, negative values for the unsigned map, a partial last block),
# decodes them, and takes three FusedAdam steps with 8-bit states on tensors
# whose sizes leave tails; prints the gathers used and a digest of every byte.
_SCRIPT = r"""
import hashlib, torch, shardadam
from shardadam import kernels
g = torch.Generator().manual_seed(0)
n = 40 * 256 + 13
x = torch.randn(n, generator=g) * torch.logspace(-8, 2, n).pow(torch.rand(n, generator=g))
x[256:512] = 0
x[600] = float("nan")
x[1100] = float("-inf")
x[1300:1340] = 1e-40 * torch.randn(40, generator=g)
h = hashlib.sha256()


def midpoints(signed):
    # Values at, just below and just above the midpoints between the map's
    # magnitudes, in blocks that each start with 1.0 (so y = x exactly).
    table = torch.empty(256)
    kernels.blockwise_dequantize(torch.arange(256, dtype=torch.uint8), torch.ones(1), table, signed=signed)
    mags = table.abs().unique().double()
    mid = ((mags[:-1] + mags[1:]) / 2).float()
    near = torch.cat([mid, torch.nextafter(mid, torch.zeros(1)), torch.nextafter(mid, torch.ones(1))])
    if signed:
        near = torch.where(torch.arange(near.numel()) % 2 == 0, near, -near)
    blocks = -(-near.numel() // 255)
    body = torch.zeros(blocks * 255)
    body[:near.numel()] = near
    return torch.cat([torch.ones(blocks, 1), body.view(blocks, 255)], dim=1).view(-1)


for signed in (True, False):
    v = x if signed else torch.where(torch.arange(n) % 3 == 0, -x.abs(), x.abs())
    v = torch.cat([midpoints(signed), v])
    codes = torch.empty(v.numel(), dtype=torch.uint8)
    absmax = torch.empty(-(-v.numel() // 256))
    kernels.blockwise_quantize(v, codes, absmax, signed=signed)
    back = torch.empty(v.numel())
    kernels.blockwise_dequantize(codes, absmax, back, signed=signed)
    for t in (codes, absmax, back):
        h.update(t.numpy().tobytes())
params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in (5000 + 7, 256, 3)]
opt = shardadam.FusedAdam(params, lr=1e-2, weight_decay=0.1, exp_avg_dtype=shardadam.BLOCKWISE8,
                           exp_avg_sq_dtype=shardadam.BLOCKWISE8)
for _ in range(3):
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
for p in params:
    h.update(p.detach().numpy().tobytes())
    for value in opt.state[p].values():
        if torch.is_tensor(value):
            h.update(value.contiguous().view(torch.uint8).numpy().tobytes())
print(shardadam.build_info()["cpu_gathers"], h.hexdigest())
"""


def _run(cap):
    env = dict(os.environ)
    env.pop("SHARDADAM_CPU_GATHERS", None)
    if cap is not None:
        env["SHARDADAM_CPU_GATHERS"] = cap
    return subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)


def test_every_gather_level_gives_the_same_bytes():
    widest = shardadam.build_info()["cpu_gathers"]
    assert widest in LEVELS
    results = {}
    for cap in LEVELS:
        out = _run(cap)
        assert out.returncode == 0, out.stderr
        used, digest = out.stdout.split()
        # The cap lowers the level, never raises it past what the CPU has.
        assert used == LEVELS[min(LEVELS.index(cap), LEVELS.index(widest))]
        results[used] = digest
    assert len(results) == LEVELS.index(widest) + 1
    assert len(set(results.values())) == 1, results


def test_an_unknown_level_is_refused_at_import():
    out = _run("sse")
    assert out.returncode != 0
    assert "SHARDADAM_CPU_GATHERS='sse': use plain, avx2 or avx512" in out.stderr
