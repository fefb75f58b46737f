"""Shared fixtures and helpers for the shardadam tests.

Every test that takes the ``device`` fixture runs on the CPU and, marked
``cuda``, on the GPU. Tests marked ``cuda`` are skipped (with the reason below)
where torch sees no GPU or the compiled core has no CUDA kernels.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardadam

CUDA_OK = bool(torch.cuda.is_available() and shardadam.build_info()["cuda"])
CUDA_SKIP_REASON = (
    "needs a CUDA GPU visible to torch and a shardadam build with CUDA kernels "
    f"(torch.cuda.is_available()={torch.cuda.is_available()}, "
    f"shardadam.build_info()['cuda']={shardadam.build_info()['cuda']})"
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")]


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason=CUDA_SKIP_REASON)
    skip_multi = pytest.mark.skip(reason=f"needs 2 CUDA GPUs for NCCL (torch sees {torch.cuda.device_count()}) "
                                         "and a build with CUDA kernels")
    for item in items:
        if "cuda" in item.keywords and not CUDA_OK:
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and not (CUDA_OK and torch.cuda.device_count() >= 2):
            item.add_marker(skip_multi)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def one_rank():
    """A one-process gloo group inside the test process (no spawn)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------- bit helpers

_INT_VIEW = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.int16: torch.int16,
    torch.float64: torch.int64,
    torch.int32: torch.int32,
    torch.uint8: torch.uint8,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of t, as an integer tensor on the CPU (logical order)."""
    return t.detach().contiguous().view(_INT_VIEW[t.dtype]).cpu()


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = bits(actual).reshape(-1), bits(expected).reshape(-1)
    if not torch.equal(a, e):
        bad = (a != e).nonzero().reshape(-1)
        i = int(bad[0])
        got = actual.detach().reshape(-1)[i].item()
        want = expected.detach().reshape(-1)[i].item()
        mask = (1 << (8 * a.element_size())) - 1
        raise AssertionError(
            f"{what}: {bad.numel()} of {a.numel()} elements differ bitwise; first at flat index {i}: "
            f"got {got!r} (bits {int(a[i]) & mask:#x}), expected {want!r} (bits {int(e[i]) & mask:#x})")


def assert_all_bits_equal(actual, expected, what: str = "") -> None:
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bits_equal(a, e, f"{what}[{i}]")


def snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def assert_unchanged(tensors, snap, what: str = "") -> None:
    assert_all_bits_equal(tensors, snap, what or "tensor changed")


def randn(shape, dtype=torch.float32, device="cpu", scale=1.0):
    """Fresh random normal data, never all zero (a zero-size tensor has no data)."""
    if isinstance(shape, int):
        shape = (shape,)
    t = (torch.randn(shape, dtype=torch.float64) * scale).to(dtype)
    return t.to(device)


def rand_pos(shape, dtype=torch.float32, device="cpu", low=1e-4, high=1e-2):
    """Fresh random positive data (for exp_avg_sq style states)."""
    if isinstance(shape, int):
        shape = (shape,)
    t = (torch.rand(shape, dtype=torch.float64) * (high - low) + low).to(dtype)
    return t.to(device)


def saved_steps(state_dict: dict) -> list[int]:
    """The step of each group of a FusedAdam state dict, which saves it per
    parameter as torch.optim.AdamW does ([Note: torch.optim's checkpoint
    schema] in _rules.py): float32 tensors, equal within a group, and no group
    step (None for a group without state: torch saves no step for it)."""
    steps = []
    for g in state_dict["param_groups"]:
        assert "step" not in g, "a group step: not torch.optim.AdamW's schema"
        saved = [state_dict["state"][k]["step"] for k in g["params"] if k in state_dict["state"]]
        assert all(t.dtype == torch.float32 for t in saved)
        values = {t.item() for t in saved}
        assert len(values) <= 1, f"one step per group, got {values}"
        steps.append(int(values.pop()) if values else None)
    return steps
