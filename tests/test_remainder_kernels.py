"""kernels.split_remainders / kernels.join_remainders / kernels.pow2_scale_for.

The references here are written from the format's definition with torch
integer ops. An fp32 master u (32 bits) is stored as
  remainder = the low 16 bits of u,
  bf16      = the high 16 bits of u, plus one when the remainder's bit 15 is set
              (modulo 2^16),
which is round to nearest with ties away from zero: a low half of exactly
0x8000 is a tie and rounds the magnitude up, the sign bit lies in the high
half. join is the exact inverse (subtract that one again), so the pair is a
bijection on all 2^32 patterns: NaN payloads and signalling NaNs included.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_bits_equal
from shardadam import _core, kernels

SIZES = [1, 7, 0, 65537, 4]  # 65537: two chunks, and threads on the CPU

SPECIAL = [
    0x00000000, 0x80000000,                          # +0, -0
    0x00000001, 0x80000001, 0x00007FFF, 0x00008000,  # subnormals, around a tie
    0x0000FFFF, 0x007FFFFF, 0x807FFFFF, 0x00808000,  # largest subnormal, smallest normals
    0x3F800000, 0x3F808000, 0x3F807FFF, 0xBF808000,  # 1.0, a tie, just under a tie, a negative tie
    0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,  # tie from an odd high half; largest finite
    0x7F7F7FFF,
    0x7F800000, 0xFF800000,                          # +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,  # quiet and signalling NaNs
    0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0xFFFF8000,  # NaNs whose rounding carries into the sign
    0x7F808000, 0xFFFF7FFF,
]


def _signed(x64: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Values in [0, 2^bits) (int64) as the signed integer of the same bits."""
    return torch.where(x64 >= 2 ** (bits - 1), x64 - 2 ** bits, x64).to(dtype)


def _unsigned(t: torch.Tensor, bits: int) -> torch.Tensor:
    return t.cpu().to(torch.int64) & (2 ** bits - 1)


def ref_split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u = _unsigned(master.cpu().view(torch.int32), 32)
    lo = u & 0xFFFF
    carry = (lo >= 0x8000).to(torch.int64)
    hi = ((u >> 16) + carry) % 2 ** 16
    return _signed(hi, 16, torch.int16).view(torch.bfloat16), _signed(lo, 16, torch.int16)


def ref_join(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    hi = _unsigned(param.cpu().view(torch.int16), 16)
    lo = _unsigned(remainder, 16)
    hi = (hi - (lo >= 0x8000).to(torch.int64)) % 2 ** 16
    return _signed(hi * 2 ** 16 + lo, 32, torch.int32).view(torch.float32)


def patterns(n: int, with_special: bool) -> torch.Tensor:
    """n fp32 values: random bit patterns (every class: NaN, inf, subnormal, ...),
    the special ones first when asked and room allows."""
    u = torch.randint(-2 ** 31, 2 ** 31, (n,), dtype=torch.int64)
    if with_special:
        s = torch.tensor(SPECIAL[:n], dtype=torch.int64)
        u[:s.numel()] = s
    return _signed(u & 0xFFFFFFFF, 32, torch.int32).view(torch.float32)


def masters_for(device, sizes=SIZES) -> list[torch.Tensor]:
    return [patterns(n, with_special=True).to(device) for n in sizes]


def filled(sizes, dtype, device, value=0x5A5A) -> list[torch.Tensor]:
    """Output tensors holding a recognisable pattern (nothing written shows)."""
    return [torch.full((n,), value, dtype=torch.int16, device=device).view(dtype) if dtype != torch.float32
            else torch.full((n,), 1234.5, device=device) for n in sizes]


def test_reference_round_trips_and_covers_the_specials():
    """The references themselves: join(split(x)) is x; the specials are present."""
    x = patterns(70000, with_special=True)
    hi, lo = ref_split(x)
    assert_bits_equal(ref_join(hi, lo), x, "ref_join(ref_split(x))")
    assert bool(torch.isnan(x).any() and torch.isinf(x).any() and (x == 0).any())


def test_split_matches_bit_reference(device):
    masters = masters_for(device)
    before = [m.clone() for m in masters]
    params = filled(SIZES, torch.bfloat16, device)
    rems = filled(SIZES, torch.int16, device)
    kernels.split_remainders(masters, params, rems)
    for i, m in enumerate(masters):
        hi, lo = ref_split(m)
        assert_bits_equal(params[i].cpu(), hi, f"params[{i}]")
        assert_bits_equal(rems[i].cpu(), lo, f"remainders[{i}]")
        assert_bits_equal(m, before[i], f"masters[{i}] (read only)")


def test_join_matches_bit_reference(device):
    params = [torch.randint(-2 ** 15, 2 ** 15, (n,), dtype=torch.int16).view(torch.bfloat16).to(device)
              for n in SIZES]
    rems = [torch.randint(-2 ** 15, 2 ** 15, (n,), dtype=torch.int16).to(device) for n in SIZES]
    masters = filled(SIZES, torch.float32, device)
    kernels.join_remainders(params, rems, masters)
    for i in range(len(SIZES)):
        assert_bits_equal(masters[i].cpu(), ref_join(params[i], rems[i]), f"masters[{i}]")


def test_round_trips_bit_for_bit(device):
    """join(split(x)) == x for every pattern, and split(join(p, r)) == (p, r)."""
    x = masters_for(device)
    params = filled(SIZES, torch.bfloat16, device)
    rems = filled(SIZES, torch.int16, device)
    kernels.split_remainders(x, params, rems)
    back = filled(SIZES, torch.float32, device)
    kernels.join_remainders(params, rems, back)
    for i in range(len(SIZES)):
        assert_bits_equal(back[i], x[i], f"join(split(x))[{i}]")
    params2 = filled(SIZES, torch.bfloat16, device)
    rems2 = filled(SIZES, torch.int16, device)
    kernels.split_remainders(back, params2, rems2)
    for i in range(len(SIZES)):
        assert_bits_equal(params2[i], params[i], f"split(join(p, r)) params[{i}]")
        assert_bits_equal(rems2[i], rems[i], f"split(join(p, r)) remainders[{i}]")


def test_split_rounds_to_nearest_ties_away_from_zero(device):
    """The bf16 param is the finite master rounded to nearest, ties away from
    zero, by float64 arithmetic (bf16 keeps 8 significant bits; subnormals
    sit on a fixed grid of 2^-133; past the largest bf16 it rounds to inf)."""
    x = patterns(20000, with_special=True)
    x = x[torch.isfinite(x)].to(device)
    p = torch.empty(x.numel(), dtype=torch.bfloat16, device=device)
    r = torch.empty(x.numel(), dtype=torch.int16, device=device)
    kernels.split_remainders(x, p, r)
    a = x.cpu().double()
    _, e = torch.frexp(a)
    ulp = torch.ldexp(torch.ones_like(a), torch.clamp(e - 8, min=-133))
    want = torch.sign(a) * torch.floor(a.abs() / ulp + 0.5) * ulp
    assert torch.equal(p.cpu().float(), want.float())


def test_single_tensors_and_version_counters(device):
    """A tensor is a list of one; what is written has its version bumped, of
    any shape (elements in memory order)."""
    x = patterns(12, with_special=True).reshape(3, 4).to(device)
    p = torch.empty(3, 4, dtype=torch.bfloat16, device=device)
    r = torch.empty(12, dtype=torch.int16, device=device)
    versions = (x._version, p._version, r._version)
    kernels.split_remainders(x, p, r)
    assert (x._version, p._version, r._version) == (versions[0], versions[1] + 1, versions[2] + 1)
    hi, lo = ref_split(x)
    assert_bits_equal(p.cpu(), hi, "params")
    assert_bits_equal(r.cpu(), lo.reshape(12), "remainders")
    y = torch.empty(12, device=device)
    kernels.join_remainders(p, r, y)
    assert y._version == 1 and p._version == versions[1] + 1
    assert_bits_equal(y, x.reshape(12), "join")


def test_empty_lists(device):
    kernels.split_remainders([], [], [])
    kernels.join_remainders([], [], [])


def _three(device, n=8):
    return (patterns(n, with_special=True).to(device), torch.zeros(n, dtype=torch.bfloat16, device=device),
            torch.zeros(n, dtype=torch.int16, device=device))


# What is wrong -> the error it gives.
REFUSALS = {
    "masters_dtype": r"masters\[1\] has dtype float64; supported: float32",
    "params_dtype": r"params\[1\] has dtype float16; supported: bfloat16",
    "remainders_dtype": r"remainders\[1\] has dtype bfloat16; supported: int16",
    "size": r"\[1\] has 9 elements but .*\[1\] has 8",
    "length": r"has 1 tensors but .* has 2",
    "missing": r"remainders must be given",
}


@pytest.mark.parametrize("op", ["split", "join"])
@pytest.mark.parametrize("bad", list(REFUSALS))
def test_refusals_write_nothing(device, op, bad):
    """Bad input raises ValueError naming the argument (and index) before
    anything is written: tensor 0 of each list is valid and stays untouched."""
    good, other = _three(device), _three(device)
    masters, params, rems = [good[0], other[0]], [good[1], other[1]], [good[2], other[2]]
    if bad == "masters_dtype":
        masters[1] = masters[1].double()
    elif bad == "params_dtype":
        params[1] = params[1].half()
    elif bad == "remainders_dtype":
        rems[1] = rems[1].view(torch.bfloat16)
    elif bad == "size":
        (masters if op == "join" else params)[1] = _three(device, 9)[0 if op == "join" else 1]
    elif bad == "length":
        rems = rems[:1]
    else:
        rems = None
    if op == "join":
        masters = [torch.full_like(m, 1234.5) if m.dtype == torch.float32 else m for m in masters]
    snap = [t.clone() for t in masters + params + (rems or [])]
    with pytest.raises(ValueError, match=REFUSALS[bad]):
        if op == "split":
            kernels.split_remainders(masters, params, rems)
        else:
            kernels.join_remainders(params, rems, masters)
    for i, (t, s) in enumerate(zip(masters + params + (rems or []), snap)):
        assert_bits_equal(t, s, f"tensor {i} after a refusal")


def test_core_checks_its_table():
    """The core refuses tables of other dtypes or write flags by itself, naming
    the list and index: its kernels move 16-bit lists as raw bits."""
    m, p, r = _three("cpu")
    f32, bf16, i16 = (_core.DType.float32.value, _core.DType.bfloat16.value, _core.DType.int16.value)

    def table(codes, written=(False, True, True)):
        lists = [(name, [t.data_ptr()], [t.numel()], [code], w, -1)
                 for name, t, code, w in zip(("masters", "params", "remainders"), (m, p, r), codes, written)]
        return _core.TensorTable(lists, [], 1, 65536)

    before = p.clone()
    with pytest.raises(ValueError, match=r"split_remainders: remainders\[0\] has dtype bfloat16; "
                                         r"split_remainders needs int16"):
        _core.split_remainders(table((f32, bf16, bf16)), -1, 0, 0, 1)
    with pytest.raises(ValueError, match=r"split_remainders: params must be marked written"):
        _core.split_remainders(table((f32, bf16, i16), (False, False, True)), -1, 0, 0, 1)
    with pytest.raises(ValueError, match=r"join_remainders: masters\[0\] has dtype float32; "
                                         r"join_remainders needs bfloat16"):
        _core.join_remainders(table((f32, bf16, i16), (False, False, True)), -1, 0, 0, 1)
    assert_bits_equal(p, before, "params after refusals")


@pytest.mark.cuda
def test_refuses_mixed_devices():
    m, p, r = _three("cpu")
    with pytest.raises(ValueError, match=r"params\[0\] is on cuda"):
        kernels.split_remainders(m, p.cuda(), r)


def ref_pow2_scale(amax: float, old_scale: float) -> float:
    """The largest power of two s with amax * s < 2^15, s in [2^-126, 2^126],
    for amax > 0 finite in float32; old_scale otherwise."""
    a = torch.tensor(amax, dtype=torch.float32).item()  # the kernels' float32 amax
    if not (a > 0 and math.isfinite(a)):
        return old_scale
    k = 0
    while a * 2.0 ** k >= 2 ** 15:
        k -= 1
    while a * 2.0 ** (k + 1) < 2 ** 15:
        k += 1
    return 2.0 ** max(-126, min(126, k))


@pytest.mark.parametrize("amax, expected", [
    (0.0, 0.25), (math.inf, 0.25), (math.nan, 0.25), (-1.0, 0.25),
    (1.0, 2.0 ** 14), (2.0 ** 15, 0.5), (7.0, 2.0 ** 12), (3e-38, 2.0 ** 126), (1e-45, 2.0 ** 126),
    (32767.0, 1.0), (65504.0, 0.5), (1e38, 2.0 ** -112),
])
def test_pow2_scale_for(amax, expected):
    assert kernels.pow2_scale_for(amax, 0.25) == expected == ref_pow2_scale(amax, 0.25)
    if amax > 0 and math.isfinite(amax):
        assert 2 ** 14 <= amax * expected < 2 ** 15 or expected == 2.0 ** 126


def test_pow2_scale_for_default_old_scale():
    assert kernels.pow2_scale_for(0.0) == 1.0
    assert kernels.pow2_scale_for(float("nan")) == 1.0
    assert kernels.pow2_scale_for(torch.tensor(7.0)) == 4096.0
