"""bf16_stochastic_round: bf16 parameters that are their own master (no fp32
copy) rounded stochastically by the update kernels, so that updates smaller
than half a bf16 step still count in expectation ([Note: stochastic rounding]
in cpp/dtype.h). The random bits hash (seed, step, tensor, element): a run
with the same seed repeats bit for bit, on the CPU and the GPU alike, and
resuming from a checkpoint with the same seed continues the same stream."""
from __future__ import annotations

import torch


def rounding_seed(enabled: bool, seed) -> int | None:
    """The kernels' seed (None: round to nearest). Without a seed one is
    drawn from torch's default generator, so torch.manual_seed fixes it."""
    if not enabled:
        if seed is not None:
            raise ValueError("stochastic_round_seed is given but bf16_stochastic_round is False: pass "
                             "bf16_stochastic_round=True to use it")
        return None
    if seed is None:
        return int(torch.randint(0, 2 ** 62, ()))
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"stochastic_round_seed must be a non-negative int, got {seed!r}")
    return seed % 2 ** 64


def refuse_masters(enabled: bool, **masters) -> None:
    """bf16_stochastic_round replaces the master: refuse the options that keep one."""
    kept = [name for name, on in masters.items() if on]
    if enabled and kept:
        raise ValueError(f"bf16_stochastic_round=True rounds bf16 parameters that are their own master; {kept[0]}="
                         f"{masters[kept[0]]!r} keeps a master (whose bf16 copy is rounded to nearest): choose one")
