"""bf16 params + int16 remainders as exact fp32 masters.

The split and join here are written from the format's definition with torch
integer ops: remainder = the low 16 bits of the fp32; bf16 = the high 16 bits,
plus one when the remainder's bit 15 is set (round to nearest, ties away).
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_bits_equal, rand_pos, randn
from shardadam import kernels

MASK16 = 0xFFFF


def _to_int16(x64: torch.Tensor) -> torch.Tensor:
    """Values 0..65535 (int64) as the int16 with the same bits."""
    return torch.where(x64 >= 2 ** 15, x64 - 2 ** 16, x64).to(torch.int16)


def _to_int32(x64: torch.Tensor) -> torch.Tensor:
    return torch.where(x64 >= 2 ** 31, x64 - 2 ** 32, x64).to(torch.int32)


def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lo = u & MASK16
    hi = ((u >> 16) + (lo >> 15)) & MASK16
    return _to_int16(hi).view(torch.bfloat16), _to_int16(lo)


def join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    h = hi.contiguous().view(torch.int16).to(torch.int64) & MASK16
    lo = lo.to(torch.int64) & MASK16
    h = (h - (lo >> 15)) & MASK16
    return _to_int32((h << 16) | lo).view(torch.float32)


def round_bf16_ties_away(x: torch.Tensor) -> torch.Tensor:
    """Nearest bf16 value, ties away from zero, by float64 arithmetic (normal numbers)."""
    a = x.double()
    _, e = torch.frexp(a)          # |a| = f * 2^e with f in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(a), e - 8)  # bf16 keeps 8 significant bits
    return torch.sign(a) * torch.floor(a.abs() / ulp + 0.5) * ulp


SPECIAL_FINITE = [0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00008000,
                  0x0000FFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x3F808000, 0x3F807FFF,
                  0x3F7FFFFF, 0xBF7FFFFF, 0x3F800000, 0x00807FFF, 0x00808000]
SPECIAL_INF = [0x7F800000, 0xFF800000]
SPECIAL_NAN = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000,
               0x7F808000, 0xFFFF7FFF]


def random_patterns(n: int) -> torch.Tensor:
    return torch.randint(-2 ** 31, 2 ** 31, (n,), dtype=torch.int64).to(torch.int32)


def patterns(kind: str) -> torch.Tensor:
    r = random_patterns(20000).view(torch.float32)
    if kind == "finite":
        r = r[torch.isfinite(r)]
        special = SPECIAL_FINITE
    elif kind == "inf":
        r = r[torch.isfinite(r)][:100]
        special = SPECIAL_INF * 8
    else:
        r = r[torch.isnan(r)]
        special = SPECIAL_NAN
    s = _to_int32(torch.tensor(special, dtype=torch.int64)).view(torch.float32)
    out = torch.cat([s, r])
    assert (torch.isnan(out).any() if kind == "nan" else torch.isinf(out).any() if kind == "inf" else True)
    return out


def test_independent_split_join_round_trip():
    """The helpers themselves: join(split(x)) is x for every bit pattern."""
    x = torch.cat([patterns("finite"), patterns("inf"), patterns("nan")])
    hi, lo = split(x)
    assert_bits_equal(join(hi, lo), x, "join(split(x))")


@pytest.mark.parametrize("kind", ["finite", "inf", "nan"])
def test_kernel_round_trips_masters_with_lr_zero(device, kind):
    """lr=0, weight_decay=0, zero grads and states: the master keeps its value,
    so the kernel writes back the same bf16 and remainder bits it read."""
    x = patterns(kind)
    n = x.numel()
    hi, lo = split(x)
    hi, lo = hi.to(device), lo.to(device)
    hi0, lo0 = hi.clone(), lo.clone()
    zeros = [torch.zeros(n, device=device) for _ in range(3)]
    kernels.adam(hi, zeros[0], zeros[1], zeros[2], param_remainders=lo, lr=0.0, step=1, weight_decay=0.0)
    if kind == "nan":
        # Arithmetic may quiet or canonicalise a NaN's payload; it must stay NaN.
        got = join(hi.cpu(), lo.cpu())
        assert bool(torch.isnan(got).all()), f"{int((~torch.isnan(got)).sum())} NaN masters lost NaN-ness"
    else:
        assert_bits_equal(hi, hi0, "bf16 high halves")
        assert_bits_equal(lo, lo0, "remainders")
        assert_bits_equal(join(hi.cpu(), lo.cpu()), x, "masters")


def _bf16_remainder_pair(master):
    hi, lo = split(master.cpu())
    return hi.to(master.device), lo.to(master.device)


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_remainder_adam_equals_fp32_master_adam(device, adam_w_mode):
    sizes = [1, 0, 7, 70001]
    masters = [randn(n, device=device) for n in sizes]
    m0 = [randn(n, device=device, scale=0.1) for n in sizes]
    v0 = [rand_pos(n, device=device) for n in sizes]
    pairs = [_bf16_remainder_pair(x) for x in masters]
    hi = [p[0] for p in pairs]
    lo = [p[1] for p in pairs]
    p32 = [x.clone() for x in masters]
    m_a, v_a = [t.clone() for t in m0], [t.clone() for t in v0]
    m_b, v_b = [t.clone() for t in m0], [t.clone() for t in v0]
    out = [torch.zeros(n, device=device) for n in sizes]
    for step in range(1, 11):
        g = [randn(n, torch.bfloat16, device) for n in sizes]
        kw = dict(lr=1e-3, step=step, weight_decay=0.01, adam_w_mode=adam_w_mode)
        kernels.adam(hi, g, m_a, v_a, param_remainders=lo, params_out=out, **kw)
        kernels.adam(p32, g, m_b, v_b, **kw)
        for i in range(len(sizes)):
            assert_bits_equal(join(hi[i].cpu(), lo[i].cpu()), p32[i].cpu(), f"step {step} master[{i}]")
            assert_bits_equal(out[i], p32[i], f"step {step} params_out[{i}] (fp32 = the master)")
    for i in range(len(sizes)):
        exp_hi, exp_lo = split(p32[i].cpu())
        assert_bits_equal(hi[i], exp_hi.to(device), f"bf16 param[{i}]")
        assert_bits_equal(lo[i], exp_lo.to(device), f"remainder[{i}]")
        # The bf16 param is the master rounded to nearest, ties away from zero.
        torch.testing.assert_close(hi[i].double().cpu(), round_bf16_ties_away(p32[i].cpu()), rtol=0, atol=0)
        assert_bits_equal(m_a[i], m_b[i], f"exp_avg[{i}]")
        assert_bits_equal(v_a[i], v_b[i], f"exp_avg_sq[{i}]")
        if sizes[i]:
            assert not torch.equal(p32[i], masters[i])
    # The bf16 halves alone lose what the remainders keep.
    big = join(hi[3].cpu(), lo[3].cpu())
    assert not torch.equal(hi[3].float().cpu(), big)


def test_ties_round_away_from_zero():
    """Exact bf16 midpoints: the split rounds the high half away from zero."""
    x = _to_int32(torch.tensor([0x3F808000, 0xBF808000, 0x3F828000, 0x00818000], dtype=torch.int64))
    x = x.view(torch.float32)
    hi, lo = split(x)
    torch.testing.assert_close(hi.double(), round_bf16_ties_away(x), rtol=0, atol=0)
    # Round to nearest even would give 0x3F80, 0xBF80, 0x3F82 and 0x0082.
    assert hi.view(torch.int16).tolist() == [0x3F81, _to_int16(torch.tensor(0xBF81)).item(), 0x3F83, 0x0082]
    assert hi.view(torch.int16).tolist() != x.to(torch.bfloat16).view(torch.int16).tolist()
