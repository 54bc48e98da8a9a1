"""Scaling on paper (pretrain/planning/scaling.py and `pretrain flops --scale`)."""

import json

import pytest

from pretrain.config import REPO_CONFIG_DIR
from pretrain.planning.scaling import Interconnect, project
from tests.helpers import assert_one_line_error


def test_one_gpu_keeps_its_mfu():
    p = project(10**9, 6e9, 1, 2**20, 0.5, 1e15)
    assert p.mfu == 0.5 and p.exposed_seconds == 0
    assert p.tokens_per_sec == pytest.approx(0.5 * 1e15 / 6e9)


def test_zero_1_2_by_hand():
    """16 GPUs (two nodes): 1000 tokens each at 6 GFLOP/token and 50% of 1 PFLOP/s = 12 ms of compute;
    each of the two passes moves 2 GB·15/16 over 40 GB/s = 46.875 ms; the reduce-scatter hides
    behind 8 ms of backward, the all-gather not at all."""
    p = project(10**9, 6e9, 16, 16_000, 0.5, 1e15, zero_stage=1)
    assert p.compute_seconds == pytest.approx(0.012)
    assert p.communication_seconds == pytest.approx(2 * 0.046875)
    assert p.exposed_seconds == pytest.approx(0.046875 - 0.008 + 0.046875)
    assert p.mfu == pytest.approx(0.5 * 0.012 / (0.012 + p.exposed_seconds))


def test_zero_3_moves_half_as_much_again_and_overlaps_it():
    one = project(10**9, 6e9, 64, 2**20, 0.5, 1e15, zero_stage=2)
    three = project(10**9, 6e9, 64, 2**20, 0.5, 1e15, zero_stage=3)
    assert three.communication_seconds == pytest.approx(1.5 * one.communication_seconds)
    assert three.exposed_seconds == max(0.0, three.communication_seconds - three.compute_seconds)


def test_nvlink_within_a_node_the_network_across():
    net = Interconnect()
    assert net.bus_bandwidth(8) == net.intra_node_bytes_per_sec
    assert net.bus_bandwidth(16) == net.inter_node_bytes_per_sec
    # Fewer tokens per GPU per step at the same communication: MFU falls as GPUs are added.
    mfus = [project(1.3e9, 9e9, n, 2**20, 0.5, 989e12).mfu for n in (8, 64, 512)]
    assert mfus == sorted(mfus, reverse=True) and mfus[-1] < 0.2


def test_flops_scale_cli(cli):
    preset = str(REPO_CONFIG_DIR / "model" / "gpt3-1.3b.yaml")
    result = cli(
        "flops", preset, "--device", "H100", "--single-gpu-mfu", "0.5", "--scale", "8,64,512", "--json"
    )
    assert result.returncode == 0, result.stderr
    scaling = json.loads(result.stdout)["scaling"]
    assert [p["gpus"] for p in scaling["projections"]] == [8, 64, 512]
    text = cli("flops", preset, "--device", "H100", "--single-gpu-mfu", "0.5", "--scale", "8,64").stdout
    assert "ZeRO-1 data parallelism" in text and "tokens/GPU/step" in text


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--scale", "8", "--single-gpu-mfu", "0.5"], "needs --device"),
        (["--scale", "8", "--device", "H100"], "one-GPU MFU"),
        (["--scale", "eight", "--device", "H100", "--single-gpu-mfu", "0.5"], "give GPU counts"),
        (["--scale", "0", "--device", "H100", "--single-gpu-mfu", "0.5"], "at least 1"),
    ],
)
def test_flops_scale_refuses_bad_input(args, fragment, cli):
    assert_one_line_error(cli("flops", str(REPO_CONFIG_DIR / "model" / "gpt3-125m.yaml"), *args), fragment)
