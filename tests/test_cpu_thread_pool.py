"""The CPU engine's thread pool ([Note: CPU thread pool] in cpp/parallel.cpp).

Every CPU launch large enough to split runs on the pool: the result must not
depend on how many threads took part, on several Python threads launching at
once (the core releases the GIL), or on a fork() after the pool started (the
child has none of the parent's threads and must build its own).
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing

import pytest
import torch

from shardadam import kernels
from shardadam._plan import cpu_threads

from conftest import assert_bits_equal

# Large enough to be split (cpu_engine.h: kCpuParallelMin), in many chunks.
NUMEL = 40 * 65536 + 1234


def _adam_steps(threads: int, steps: int = 3, seed: int = 0, blockwise: bool = False) -> list[torch.Tensor]:
    """Parameters and states after `steps` AdamW steps on `threads` CPU threads."""
    g = torch.Generator().manual_seed(seed)
    sizes = [NUMEL, 70_001, 3 * 65536]
    params = [torch.randn(n, generator=g) for n in sizes]
    state_dtype = torch.uint8 if blockwise else torch.float32
    states = [[torch.zeros(n, dtype=state_dtype) for n in sizes] for _ in range(2)]
    absmax = [[torch.zeros(-(-n // 256)) for n in sizes] for _ in range(2)] if blockwise else [None, None]
    plan = kernels.AdamPlan(params, [torch.empty(n) for n in sizes], *states, exp_avg_absmax=absmax[0],
                            exp_avg_sq_absmax=absmax[1])
    with cpu_threads(threads):
        for step in range(1, steps + 1):
            for grad in plan.lists["grads"]:
                grad.copy_(torch.randn(grad.numel(), generator=g))
            kernels.adam(plan, lr=1e-2, step=step, weight_decay=0.1)
    return params + states[0] + states[1]


@pytest.mark.parametrize("blockwise", [False, True], ids=["fp32", "8-bit"])
def test_thread_counts_give_the_same_bits(blockwise):
    one = _adam_steps(1, blockwise=blockwise)
    for threads in (2, 5, 16):
        for a, b in zip(one, _adam_steps(threads, blockwise=blockwise)):
            assert_bits_equal(a, b)


def test_launches_from_several_python_threads_at_once():
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda s: _adam_steps(3, steps=6, seed=s), range(4)))
    again = [_adam_steps(1, steps=6, seed=s) for s in range(4)]
    for want, have in zip(again, got):
        for a, b in zip(want, have):
            assert_bits_equal(a, b)


def _child(queue) -> None:
    # torch's own OpenMP threads do not survive a fork either: its ops stay
    # on this thread, so that only shardadam's pool is under test.
    torch.set_num_threads(1)
    queue.put([t.numpy() for t in _adam_steps(4)])  # by value, not as shared memory


def test_a_forked_child_launches_on_a_pool_of_its_own():
    """The parent's pool threads are gone in the child: a launch there must
    neither wait for them nor give other bits."""
    parent = _adam_steps(4)  # the parent's pool is started before the fork
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    got = queue.get(timeout=600)  # only a hung child takes long: the work is seconds
    child.join(timeout=600)
    assert child.exitcode == 0
    for a, b in zip(parent, got):
        assert_bits_equal(a, torch.from_numpy(b))
