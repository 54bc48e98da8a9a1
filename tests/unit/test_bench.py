"""The benchmarks' pieces, and their refusals of bad input (in this process): `pretrain bench train`
(ours vs transformers' Llama in the same DeepSpeed engine) and `pretrain bench ablation`."""

import json
from pathlib import Path

import pytest
import torch

from monitoring.protocol import RollbackDecided, StepJudged, WarningRaised, append_event
from pretrain.bench.ablation import report, tokens_to_reach
from pretrain.bench.train import saved_activation_bytes
from tests.helpers import TINY, assert_one_line_error


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
                "label": "Transformer++",
                "best_lr": 3e-3,
                "best_final_loss": 4.6,
                "tokens_to_target": 4e5,
                "flops_to_target": 8e12,
            },
            "original": {
                "label": "original",
                "best_lr": 1e-3,
                "best_final_loss": 5.0,
                "tokens_to_target": 1e6,
                "flops_to_target": 2e13,
            },
        },
    }
    text = report(result)
    assert "2.50x the compute" in text and "0.40M" in text and "1.00M" in text


def test_the_deepspeed_launchers_local_rank_argument_is_accepted(small_preset, cli):
    """`deepspeed --module pretrain bench train ...` appends --local_rank=N to every rank's argv."""
    for given in (["--local_rank=1"], ["--local_rank", "1"], ["--local-rank=0"]):  # launchers use each form
        result = cli("bench", "train", str(small_preset), *given, "--seq-len", "4096")
        assert_one_line_error(result, "must be in [1, model.max_seq_len=512]")


def test_bench_detection_counts_what_the_monitor_did_and_replays_faults(tmp_path, capsys):
    """`pretrain bench detection` on two run directories laid out as `pretrain launch` leaves them:
    a clean one (a recorded real series) and one with injected faults."""
    from pretrain.bench.detection import run

    runs = json.loads((Path(__file__).parent / "data" / "clean_runs.json").read_text())["runs"]
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    for run_dir, faults in (
        (clean, {}),
        (
            faulty,
            {
                "faults.spike_steps": [60],
                "faults.spike_factor": 3.0,
                "faults.grad_spike_steps": [90],
                "faults.grad_spike_factor": 3.0,
            },
        ),
    ):
        run_dir.mkdir()
        (run_dir / "run.json").write_text(json.dumps({"config": {"monitor.warmup": 32, **faults}}))
        series = runs["tiny-code"]
        (run_dir / "metrics.jsonl").write_text(
            "".join(
                json.dumps({"step": i + 1, "train/loss": loss, "train/grad_norm": grad}) + "\n"
                for i, (loss, grad) in enumerate(zip(series["loss"], series["grad_norm"], strict=True))
            )
        )
        events = [
            StepJudged(step=i, loss=3.0, grad_norm=1.0, action="continue", level="ok") for i in range(1, 301)
        ]
        if faults:
            events += [
                RollbackDecided(
                    step=60,
                    decision=1,
                    reason="loss spike",
                    finding="loss_spike",
                    value=9.0,
                    threshold=4.0,
                    target="step_00000050",
                    seed=1,
                    lr_scale=1.0,
                ),
                WarningRaised(step=90, reason="grad norm surge", findings=["grad_norm_surge"]),
            ]
            (run_dir / "faults_fired.json").write_text(json.dumps(["spike:60", "grad_spike:90", "kill:5"]))
        for event in events:
            append_event(run_dir, event, sync=False)
    result = run([str(clean), str(faulty)], every=10, as_json=True)
    summary = result["summary"]
    assert summary["clean_runs"] == 1 and summary["clean_steps"] == 300
    assert summary["rollbacks_per_1000_clean_steps"] == 0
    assert summary["real_faults"] == {
        "loss x3": {"injected": 1, "rollback": 1, "warn": 0, "not_flagged": 0},
        "grad x3": {"injected": 1, "rollback": 0, "warn": 1, "not_flagged": 0},
    }
    assert (
        summary["replay"]["nan"]["rollback"] == summary["replay"]["nan"]["trials"] == 26
    )  # steps 41, 51, .. 291
    assert json.loads(capsys.readouterr().out)["summary"] == summary


def test_bench_masking_times_both_arms_on_the_same_model(capsys):
    from pretrain.bench.masking import run

    result = run(TINY, seq_len=128, micro_batch_size=1, document_tokens=32, steps=2, warmup=0, dtype="fp32")
    assert result["seq_len"] == 128 and result["device"] == "cpu"
    assert result["step_seconds_masked"] > 0 and result["step_seconds_unmasked"] > 0
    assert result["masked_over_unmasked"] == result["step_seconds_masked"] / result["step_seconds_unmasked"]
    assert 2 <= result["documents_per_window"] <= 12  # ~128 / 32 documents, packed
    assert "masked / unmasked" in capsys.readouterr().out


def test_the_calibrations_step_times_are_whole_steps_monitor_work_included(tmp_path):
    """scripts/monitor_calibration.py overhead: a step's time runs from its record to the next
    step's, so the monitor's work between them counts; `train/step_time` (which ends before it)
    is not what is read. Steps before `skip` and gaps (a step missing) are left out."""
    import importlib.util

    from torch.utils.tensorboard import SummaryWriter

    from pretrain.config import REPO_CONFIG_DIR
    from pretrain.reporting.metrics import tensorboard_dir

    script = REPO_CONFIG_DIR.parent / "scripts" / "monitor_calibration.py"
    spec = importlib.util.spec_from_file_location("monitor_calibration", script)
    calibration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibration)
    run_dir = tmp_path / "run"
    writer = SummaryWriter(str(tensorboard_dir(run_dir)))
    walls = {1: 100.0, 2: 100.5, 3: 101.25, 4: 102.0, 6: 103.0, 7: 103.25}  # (step 5 not logged)
    for step, wall in walls.items():
        writer.add_scalar("train/loss", 1.0, step, walltime=wall)
        writer.add_scalar("train/step_time", 0.01, step, walltime=wall)
    writer.close()
    assert calibration._step_times(run_dir, skip=2) == [0.75, 0.75, 0.25]
