"""The engine's host-step path (distributed/_host_step.py) alone, on a
stand-in engine with a recording host (no GPU, no process group): its
refusals, when it arms, and what step() launches. The GPU runs of
test_distributed_host_state.py cover the real host shards."""
from __future__ import annotations

import re

import pytest
import torch

from shardadam._rules import AdamRule
from shardadam.distributed._host_shards import SECOND_REDUCTION
from shardadam.distributed._host_step import HostStep
from shardadam.distributed._iteration import BackwardOrderProbe, Iteration


class _RecordingHost:
    def __init__(self):
        self.calls = []

    def arm(self, plan, launch):
        self.calls.append(("arm", plan, launch))

    def step(self, plan, launch):
        self.calls.append(("step", plan, launch))

    def finish_armed(self):
        self.calls.append(("finish_armed",))


class _RecordingRule(AdamRule):
    def __init__(self):
        super().__init__(True, False)
        self.launches = []

    def launch(self, plan, hyper, **kw):
        self.launches.append((plan, hyper, kw))


class _Engine(HostStep):
    def __init__(self, host=None, host_step_in_backward=True, world_size=2):
        self._host = host
        self.host_step_in_backward = host_step_in_backward
        self.iteration = Iteration()
        self._probe = BackwardOrderProbe(active=False)
        self.rule = _RecordingRule()
        self.plan = ["plan of bucket 0"]
        self.rounding_seed = None
        self.world_size, self.average_grad_sync = world_size, True
        self._initialized = [True]
        self.param_groups = [dict(params=[], lr=torch.tensor(1e-3), betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.0, bias_correction=True, step=4)]
        self.landed = 0

    def _land_param_sync(self):
        self.landed += 1

    def _averaging_factor(self):
        return 1.0 / self.world_size


def test_refusals_only_with_host_step_in_backward():
    _Engine(host_step_in_backward=False)._refuse_with_host_step_in_backward("clipping")
    with pytest.raises(RuntimeError, match=r"^_Engine\(host_step_in_backward=True\) steps each bucket during "
                                           r"backward, before clipping could know every gradient"):
        _Engine()._refuse_with_host_step_in_backward("clipping")


def test_mid_host_step_refused_while_armed_only():
    engine = _Engine()
    for not_armed in (None, False):
        engine.iteration.host_step = not_armed
        engine._refuse_mid_host_step("state_dict()")
    engine.iteration.host_step = {"lr": 1e-3}
    with pytest.raises(RuntimeError, match=r"^_Engine.state_dict\(\) between backward and step\(\) with "
                                           r"host_step_in_backward=True"):
        engine._refuse_mid_host_step("state_dict()")


def test_step_refuses_a_scaler_and_a_second_reduction():
    engine = _Engine()
    engine._check_host_step(None)
    with pytest.raises(RuntimeError, match="before a GradScaler could know every gradient"):
        engine._check_host_step(object())
    engine._probe = BackwardOrderProbe(active=True)
    engine._probe.record(0)
    engine._probe.record(0)
    with pytest.raises(RuntimeError, match=f"^{re.escape(SECOND_REDUCTION)}$"):
        engine._check_host_step(None)
    _Engine(host_step_in_backward=False)._check_host_step(None)  # the same backward without the option


def test_no_host_state_arms_nothing_and_launches_nothing():
    engine = _Engine(host=None)
    engine._arm_host_step()
    assert engine.iteration.host_step is False and engine.landed == 0
    assert engine._step_on_host({}, torch.tensor(0.5)) is None


def test_masters_not_taken_yet_arm_nothing():
    host = _RecordingHost()
    engine = _Engine(host=host)
    engine._initialized = [False]
    engine._arm_host_step()
    assert engine.iteration.host_step is False and host.calls == []


def test_arming_reads_the_next_steps_hyperparameters_as_values():
    host = _RecordingHost()
    engine = _Engine(host=host, world_size=4)
    engine._arm_host_step()
    hyper = engine.iteration.host_step
    assert engine.landed == 1 and [c[0] for c in host.calls] == ["arm"]
    assert hyper == engine.rule.hyper([dict(engine.param_groups[0], step=5)])
    engine.param_groups[0]["lr"].mul_(10)  # changed in place after backward read it
    assert hyper == engine.rule.hyper([dict(engine.param_groups[0], lr=torch.tensor(1e-3), step=5)])
    _, plan, launch = host.calls[0]
    launch(plan)
    (_, launched_hyper, kw), = engine.rule.launches
    assert launched_hyper is hyper and kw["found_inf"] is None
    assert kw["grad_scale"].device.type == "cpu" and kw["grad_scale"].item() == 0.25


def test_an_armed_step_finishes_and_reports_moved_hyperparameters():
    host = _RecordingHost()
    engine = _Engine(host=host)
    engine._arm_host_step()
    read = engine.iteration.host_step
    assert engine._step_on_host(read, torch.tensor(0.5)) == ""
    now = engine.rule.hyper([dict(engine.param_groups[0], lr=torch.tensor(2e-3), step=5)])
    moved = engine._step_on_host(now, torch.tensor(0.5))
    assert moved == "lr [0.001] -> [0.002]" and [c[0] for c in host.calls] == ["arm", "finish_armed", "finish_armed"]
    engine._refuse_moved_hyperparameters("")
    with pytest.raises(RuntimeError, match=re.escape(f"hyperparameters it read when backward began ({moved}): they "
                                                     "changed after that")):
        engine._refuse_moved_hyperparameters(moved)


def test_a_step_not_armed_steps_every_bucket_with_the_scale_as_a_host_number():
    host = _RecordingHost()
    engine = _Engine(host=host, host_step_in_backward=False)
    hyper = engine.rule.hyper(engine.param_groups)
    assert engine._step_on_host(hyper, torch.tensor(0.125)) == ""
    (what, plan, launch), = host.calls
    assert what == "step" and plan is engine.plan
    launch("bucket plan")
    (launched_plan, launched_hyper, kw), = engine.rule.launches
    assert launched_plan == "bucket plan" and launched_hyper is hyper
    assert kw["grad_scale"].device.type == "cpu" and kw["grad_scale"].item() == 0.125
