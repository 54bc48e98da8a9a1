"""The counter of the host's waits for the device (pretrain/bench/host_syncs.py) on a CPU: every
read of a value the device computed counts, from any caller; a value the host made itself from
Python numbers (AdamW's step counter, a norm handed back on the host) and what is computed from
such values alone do not."""

import torch

from pretrain.bench.host_syncs import HostSyncs


def counted(step) -> list[str]:
    with HostSyncs(torch.device("cpu")) as syncs:
        syncs.new_step()
        step()
        syncs.end_step()
        step()  # (after end_step: not the step's)
    (sites,) = syncs.steps
    return sites


def test_reads_of_device_values_count_wherever_they_are_made():
    x = torch.ones(3)  # (a factory: a device value on a GPU)
    assert len(counted(lambda: x.sum().item())) == 1
    assert len(counted(lambda: bool(x.any()))) == 1
    assert len(counted(lambda: x.tolist())) == 1
    assert len(counted(lambda: torch.nonzero(x))) == 1
    assert len(counted(lambda: float((torch.tensor(2.0) * x).sum()))) == 1  # (a device value in it)
    assert "test_host_syncs.py" in counted(lambda: x.sum().item())[0]


def test_reads_of_values_the_host_made_do_not():
    assert counted(lambda: torch.tensor(2.0).item()) == []
    assert counted(lambda: bool((torch.tensor(2.0) * 3 + 1).isfinite())) == []
    assert counted(lambda: torch.tensor([1.0, 2.0]).tolist()) == []


def test_adamws_step_counter_lives_on_the_host_and_a_loss_read_does_not():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters())

    def step():
        loss = model(torch.ones(2, 4)).square().mean()
        loss.backward()
        optimizer.step()  # (reads its step counter: .item() of a host tensor)
        optimizer.zero_grad()
        return loss

    with HostSyncs(torch.device("cpu")) as syncs:
        for _ in range(2):  # (from the first step, which makes the counter)
            syncs.new_step()
            step()
        syncs.new_step()
        step().item()
    assert syncs.per_step() == [0, 0, 1]
