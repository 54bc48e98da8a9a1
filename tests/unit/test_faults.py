"""Fault injection: each fault fires once, for the rank it names, and is remembered on disk."""

import json
import math
import os
import signal

import pytest
import torch

from pretrain.config import FaultsConfig
from pretrain.stability.faults import FaultInjector


class Killed(Exception):
    pass


def test_a_kill_fires_on_its_rank_once_and_is_written_first(tmp_path, monkeypatch):
    kills = []

    def kill(pid, signum):
        kills.append((pid, signum))
        raise Killed  # instead of dying

    monkeypatch.setattr(os, "kill", kill)
    faults = FaultsConfig(kill_step=3, kill_rank=1)
    other = FaultInjector(faults, tmp_path, rank=0)
    other.before_step(3)
    assert kills == [] and "kill:3" in other.fired  # rank 0 only notes it
    victim = FaultInjector(faults, tmp_path, rank=1)
    victim.before_step(2)
    with pytest.raises(Killed):
        victim.before_step(3)
    assert kills == [(os.getpid(), signal.SIGKILL)]
    assert json.loads((tmp_path / "faults_fired.json").read_text()) == ["kill:3"]
    FaultInjector(faults, tmp_path, rank=1).before_step(3)  # after the restart: it does not fire again
    assert len(kills) == 1


def test_a_hang_sleeps_forever_on_its_rank(tmp_path, monkeypatch):
    def sleep(seconds):
        raise Killed  # the supervisor's SIGKILL, in effect

    monkeypatch.setattr("pretrain.stability.faults.time.sleep", sleep)
    with pytest.raises(Killed):
        FaultInjector(FaultsConfig(hang_step=2, hang_rank=0), tmp_path, rank=0).before_step(2)
    assert json.loads((tmp_path / "faults_fired.json").read_text()) == ["hang:2"]


def test_loss_faults_scale_or_poison_the_loss_of_their_step_until_marked(tmp_path):
    faults = FaultInjector(FaultsConfig(spike_steps=[2], nan_steps=[3], spike_factor=10.0), tmp_path, rank=0)
    loss = torch.tensor(2.0)
    assert faults.apply(1, loss).item() == 2.0
    assert faults.apply(2, loss).item() == 20.0  # every micro-batch of the step
    assert faults.apply(2, loss).item() == 20.0
    faults.mark_fired(2)
    assert faults.apply(2, loss).item() == 2.0  # the step, run again after a rollback, is clean
    assert math.isnan(faults.apply(3, loss).item())
    faults.mark_fired(3)
    assert json.loads((tmp_path / "faults_fired.json").read_text()) == ["nan:3", "spike:2"]


def test_only_rank_0_writes_the_loss_faults(tmp_path):
    faults = FaultInjector(FaultsConfig(spike_steps=[1]), tmp_path, rank=1)
    faults.mark_fired(1)
    assert faults.fired == {"spike:1"} and not (tmp_path / "faults_fired.json").exists()


def test_a_gradient_spike_scales_the_gradients_but_not_the_loss(tmp_path):
    weight = torch.tensor([1.5, -2.0], requires_grad=True)
    injector = FaultInjector(FaultsConfig(grad_spike_steps=[4], grad_spike_factor=10.0), tmp_path, rank=0)

    def step(n):
        weight.grad = None
        loss = injector.apply(n, (weight**2).sum())
        loss.backward()
        injector.mark_fired(n)
        return loss.item(), weight.grad.clone()

    clean_loss, clean_grad = step(3)
    spiked_loss, spiked_grad = step(4)
    assert spiked_loss == clean_loss  # bit for bit: the monitor sees the true loss
    assert torch.equal(spiked_grad, 10.0 * clean_grad)
    assert step(4)[1].equal(clean_grad)  # fired once: the same step runs clean after a rollback
    assert json.loads((tmp_path / "faults_fired.json").read_text()) == ["grad_spike:4"]
