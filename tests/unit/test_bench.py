"""The benchmarks' pieces, and their refusals of bad input (in this process): `pretrain bench train`
(ours vs transformers' Llama in the same DeepSpeed engine) and `pretrain bench ablation`."""

import pytest
import torch

from pretrain.bench.ablation import report, tokens_to_reach
from pretrain.bench.train import saved_activation_bytes
from tests.helpers import assert_one_line_error

SMALL_MODEL = {
    "vocab_size": 512,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "max_seq_len": 512,
}


@pytest.fixture
def small_preset(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text("\n".join(f"{k}: {v}" for k, v in SMALL_MODEL.items()) + "\n")
    return path


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--seq-len", "4096"], "must be in [1, model.max_seq_len=512]"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
        (["--zero-stage", "4"], "invalid choice"),
    ],
)
def test_bench_train_refuses_bad_input(small_preset, args, fragment, cli):
    assert_one_line_error(cli("bench", "train", str(small_preset), *args), fragment)


def test_bench_train_refuses_a_missing_config(tmp_path, cli):
    assert_one_line_error(cli("bench", "train", str(tmp_path / "nope.yaml")), "does not exist")


def test_saved_activation_bytes_counts_what_backward_keeps():
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(32, 16, requires_grad=True)
    # x @ W.T + b saves x (for W's gradient) and W (a parameter: not counted); relu saves its output.
    counted = saved_activation_bytes(lambda: torch.relu(linear(x)), list(linear.parameters()))
    assert counted == 32 * 16 * 4 + 32 * 8 * 4


def test_tokens_to_reach_interpolates_between_evaluations():
    curve = [(0, 8.0), (100, 6.0), (200, 5.0), (300, 4.5)]
    assert tokens_to_reach(curve, 6.0) == 100
    assert tokens_to_reach(curve, 5.5) == pytest.approx(150)
    assert tokens_to_reach(curve, 4.5) == 300
    assert tokens_to_reach(curve, 4.0) is None
    # A curve that dips below the target and comes back up reaches it at the dip.
    assert tokens_to_reach([(0, 8.0), (100, 5.0), (200, 5.5)], 5.2) == pytest.approx(100 * 2.8 / 3.0)


def test_ablation_report_names_the_compute_ratio():
    result = {
        "source": "builtin:pydoc",
        "lrs": [1e-3, 3e-3],
        "target_loss": 5.0,
        "compute_ratio": 2.5,
        "arms": {
            "transformer_pp": {
                "label": "Transformer++", "best_lr": 3e-3, "best_final_loss": 4.6,
                "tokens_to_target": 4e5, "flops_to_target": 8e12,
            },
            "original": {
                "label": "original", "best_lr": 1e-3, "best_final_loss": 5.0,
                "tokens_to_target": 1e6, "flops_to_target": 2e13,
            },
        },
    }  # fmt: skip
    text = report(result)
    assert "2.50x the compute" in text and "0.40M" in text and "1.00M" in text


def test_the_deepspeed_launchers_local_rank_argument_is_accepted(small_preset, cli):
    """`deepspeed --module pretrain bench train ...` appends --local_rank=N to every rank's argv."""
    for given in (["--local_rank=1"], ["--local_rank", "1"], ["--local-rank=0"]):  # launchers use each form
        result = cli("bench", "train", str(small_preset), *given, "--seq-len", "4096")
        assert_one_line_error(result, "must be in [1, model.max_seq_len=512]")
