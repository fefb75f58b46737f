"""A wait on a peer that never comes ([Note: a peer that never comes] in
distributed/_peer_timeout.py): the backend's timeout is raised again naming
the collective, the bucket, the engine call it waited in, the likely cause
and the fix. The naming in this process; then two gloo ranks, one of which
skips an iteration, with a short process-group timeout."""
from __future__ import annotations

import faulthandler
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import shardadam
from shardadam.distributed._peer_timeout import PeerTimeout, naming_collective, naming_phase, timed_out
from shardadam.distributed._transport import InFlight

GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv " \
               "operation to complete"


class _Work:
    def __init__(self, error: BaseException | None):
        self.error = error

    def wait(self):
        if self.error is not None:
            raise self.error


class _Engine:
    @naming_phase("step()")
    def step(self, work):
        self.grad_sync(work)

    @naming_phase("grad_sync()")
    def grad_sync(self, work):
        InFlight(work, what="gloo reduce-scatter of bucket 2").complete()

    @naming_phase("grad_norm()")
    def grad_norm(self, error):
        raise error


def test_a_timed_out_wait_names_its_collective_and_the_outermost_call():
    with pytest.raises(PeerTimeout) as caught:
        _Engine().step(_Work(RuntimeError(GLOO_TIMEOUT)))
    message = str(caught.value)
    assert message.startswith("_Engine.step(): this rank waited in the gloo reduce-scatter of bucket 2 until the "
                              "process group's timeout: a peer rank never joined it. Likely a rank skipped step() "
                              "or backward()")
    assert "raise the timeout (init_process_group(timeout=...))" in message
    assert message.endswith("The backend said: " + GLOO_TIMEOUT)
    assert isinstance(caught.value.__cause__, RuntimeError) and str(caught.value.__cause__) == GLOO_TIMEOUT


def test_a_completed_wait_runs_what_follows():
    ran = []
    InFlight(_Work(None), then=lambda: ran.append(True), what="gloo all-gather of bucket 0").complete()
    assert ran == [True]


@pytest.mark.parametrize("error", [RuntimeError("Connection closed by peer"), ValueError("timed out, but not a "
                                                                                        "backend's RuntimeError")])
def test_other_errors_pass_unchanged(error):
    with pytest.raises(type(error)) as caught:
        _Engine().step(_Work(error))
    assert caught.value is error


def test_an_unnamed_collective_timeout_is_named_by_the_call():
    with pytest.raises(PeerTimeout, match=r"^_Engine.grad_norm\(\): this rank waited in the collective it ran over "
                                          r"the process group until the process group's timeout"):
        _Engine().grad_norm(RuntimeError(GLOO_TIMEOUT))


def test_timeouts_are_recognised():
    assert timed_out(RuntimeError(GLOO_TIMEOUT))
    assert timed_out(RuntimeError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
                                  "OpType=REDUCE_SCATTER) ran for 600000 milliseconds before timing out."))
    assert not timed_out(RuntimeError("Connection reset by peer"))
    with pytest.raises(PeerTimeout):
        with naming_collective("gloo all-gather of bucket 1"):
            raise RuntimeError(GLOO_TIMEOUT)


# ---------------------------------------------------------------- two ranks, one skips an iteration

PEER_TIMEOUT_S = 10  # the optimizer's group; generous for lockstep collectives on a busy 2-core machine


def _skipping_rank(rank: int, world: int, port: int, rank0_done, out) -> None:
    """Both ranks train one iteration; rank 0 then trains a second while rank
    1 skips it (no backward, no step) and stays alive until rank 0 has
    raised, so rank 0's wait ends in the timeout, not a closed connection."""
    from test_distributed import RANK_TIMEOUT_S, _exit
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    # The default group keeps the default timeout (ranks may start slowly); the optimizer's is short.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    short = dist.new_group(backend="gloo", timeout=timedelta(seconds=PEER_TIMEOUT_S))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, process_group=short)

    def iteration() -> None:
        opt.zero_grad()
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()

    iteration()
    result = None
    if rank == 0:
        try:
            iteration()
        except Exception as error:  # what rank 0 raised is the result
            result = dict(type=type(error).__name__, message=str(error), cause=str(error.__cause__))
        rank0_done.set()
    else:
        rank0_done.wait(RANK_TIMEOUT_S)
    out.put((rank, result))
    out.close()
    out.join_thread()
    _exit()


def test_a_rank_that_skips_an_iteration_leaves_its_peer_a_named_error():
    from test_distributed import _rank_context, _spawn_all
    results = _spawn_all(_skipping_rank, 2, _rank_context().Event())
    assert results[1] is None
    result = results[0]
    assert result is not None, "rank 0 stepped without its peer"
    assert result["type"] == "PeerTimeout", result
    assert result["message"].startswith(
        "DistributedFusedAdam.step(): rank 0 of 2 waited in the gloo reduce-scatter of bucket 0 until the process "
        "group's timeout: a peer rank never joined it. Likely a rank skipped step() or backward()"), result
    assert "Timed out" in result["cause"] and result["message"].endswith(result["cause"].strip().splitlines()[0])
