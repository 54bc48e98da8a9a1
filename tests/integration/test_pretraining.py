"""Real multi-process DeepSpeed runs on CPU (gloo): ZeRO stages, exact resume, world-size change,
SIGTERM, TensorBoard, export, the two-"node" launcher mode. Most read the one golden run
(2 processes, ZeRO-2, 20 steps; tests/integration/golden.py) instead of training their own."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from pretrain.config import REPO_CONFIG_DIR
from pretrain.parallel.distributed import free_port
from tests.integration.golden import OVERRIDES as GOLDEN
from tests.integration.runs import (
    FAST,
    TINY,
    copy_checkpoint,
    events,
    launcher,
    metrics,
    torchrun,
    train,
    train_state,
)


def assert_learns(run_dir, last_step: int):
    summary = json.loads((run_dir / "train_summary.json").read_text())
    evals = [e["loss"] for e in summary["eval"]]
    assert evals[0] > math.log(512) - 0.3, "the untrained model starts near a uniform guess"
    assert evals[-1] < evals[0] - 0.3, evals
    steps = metrics(run_dir)
    assert steps[last_step]["train/loss"] < steps[1]["train/loss"]
    return summary


def test_zero2_learns_and_checkpoints(golden_run):
    summary = assert_learns(golden_run, 20)
    assert summary["zero_stage"] == 2 and summary["world_size"] == 2 and summary["completed"]
    assert [e["step"] for e in summary["eval"]] == [0, 10, 20]
    assert (golden_run / "checkpoints" / "latest").read_text().strip() == "step_00000020"
    for step in (10, 20):
        directory = golden_run / "checkpoints" / f"step_{step:08d}"
        assert (directory / "complete.json").is_file()
        assert {
            "train_state.json",
            "run_config.json",
            "tokenizer.model",
            "rng_rank_00000.json",
            "rng_rank_00001.json",
        } <= {p.name for p in directory.iterdir()}
    state = train_state(golden_run, 20)
    assert state["step"] == 20 and state["world_size"] == 2 and state["tokens"] == 20 * 2 * 2 * 512
    assert state["data"]["consumed"] == 20 * 2 * 2  # global windows: steps × micro-batch × ranks


def test_zero3_learns_and_a_rollback_restores_the_checkpoints_weights(tmp_path, train_data):
    """Under `pretrain launch`, a spike at step 6 is rolled back to step 4: every rank's shards and
    fp32 master weights after the load equal those saved (`weights_sha256`). ZeRO-1 learns,
    checkpoints and rolls back in test_launch.py (through launch/single_node.sh)."""
    from tests.integration.test_launch import launch

    result = launch(
        tmp_path,
        train_data,
        "train.steps=8",
        "checkpoint.every=4",
        "eval.every=8",
        "faults.spike_steps=[6]",
        "engine.deepspeed_config=configs/deepspeed/zero3.json",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert assert_learns(tmp_path, 8)["zero_stage"] == 3
    (applied,) = [e for e in events(tmp_path) if e["type"] == "rollback_applied"]
    assert applied["tag"] == "step_00000004" and applied["matches_checkpoint"] is True


def test_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path, golden_run, train_data):
    """The golden run's step-10 checkpoint, resumed under torchrun (the golden run used the
    DeepSpeed launcher): steps 11-20 and the final data position are the golden run's."""
    copy_checkpoint(golden_run, tmp_path, 10)
    result = train(torchrun(2), tmp_path, train_data, *GOLDEN, "checkpoint.resume=auto")
    assert "resumed from step_00000010" in result.stdout
    ours, theirs = metrics(tmp_path), metrics(golden_run)
    assert sorted(ours) == list(range(11, 21))
    for step in range(11, 21):
        assert ours[step]["train/loss"] == theirs[step]["train/loss"], step
        assert ours[step]["train/grad_norm"] == theirs[step]["train/grad_norm"], step
    for key in ("data", "params_sha256", "tokens"):
        assert train_state(tmp_path, 20)[key] == train_state(golden_run, 20)[key], key


def test_resume_with_another_world_size(tmp_path, golden_run, train_data):
    """2 processes → 1 (grad_accum 2 keeps the global batch) through DeepSpeed's universal
    checkpoint; an incomplete newer checkpoint is skipped."""
    copy_checkpoint(golden_run, tmp_path, 10)
    partial = tmp_path / "checkpoints" / "step_00000015"
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"half-written")
    result = train(
        torchrun(1),
        tmp_path,
        train_data,
        *GOLDEN,
        "train.grad_accum=2",
        "train.stop_at_step=13",
        "checkpoint.resume=auto",
    )
    assert "skipping checkpoint" in result.stderr and "step_00000015" in result.stderr
    assert "resumed from step_00000010" in result.stdout
    assert (tmp_path / "checkpoints" / "universal" / "step_00000010" / "complete.json").is_file()
    state = train_state(tmp_path, 13)
    assert state["world_size"] == 1 and state["data"]["consumed"] == 13 * 4  # the same data position
    ours, theirs = metrics(tmp_path), metrics(golden_run)
    for step in (11, 12, 13):  # the same batches; only the reduction order differs
        assert ours[step]["train/loss"] == pytest.approx(theirs[step]["train/loss"], rel=2e-3), step


def test_sigterm_saves_and_exits(tmp_path, train_data):
    args = [
        *launcher(2),
        "--config",
        TINY,
        f"run.dir={tmp_path}",
        f"data.dir={train_data}",
        *FAST,
        "train.steps=500",
        "checkpoint.every=1000",
        "eval.every=0",
    ]
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    deadline = time.time() + 240
    while time.time() < deadline and not (
        (tmp_path / "metrics.jsonl").exists()
        and len((tmp_path / "metrics.jsonl").read_text().splitlines()) >= 3
    ):
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGTERM)  # what a scheduler does: every process of the job
    output, _ = process.communicate(timeout=180)
    tag = (tmp_path / "checkpoints" / "latest").read_text().strip()
    step = int(tag.removeprefix("step_"))
    assert 3 <= step < 500, output[-3000:]
    assert (tmp_path / "checkpoints" / tag / "complete.json").is_file()
    assert "stop requested by node 0" in output and "SIGTERM received: saved" in output
    assert json.loads((tmp_path / "train_summary.json").read_text())["completed"] is False


def test_tensorboard_tags(golden_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.reporting.metrics import tensorboard_dir

    events_ = EventAccumulator(str(tensorboard_dir(golden_run)))
    events_.Reload()
    scalars = set(events_.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_sec",
        "train/tokens_per_sec_per_device",
        "train/mfu",
        "train/step_time",
        "train/memory_gb",
        "train/skipped_steps",
        "train/tokens",
        "train/grad_norm/embeddings",
        "train/grad_norm/layers.0",
        "train/grad_norm/layers.1",
        "train/grad_norm/head",
        "eval/loss",
        "eval/perplexity",
    }
    assert expected <= scalars, expected - scalars
    # The instability precursors, every logging.precursors_every=10 steps, on the real engine.
    per_layer = [events_.Scalars(f"stability/attn_logit_max/layer_{i}") for i in (0, 1)]
    largest = events_.Scalars("stability/attn_logit_max")
    assert [e.step for e in largest] == [10, 20] == [e.step for e in per_layer[0]]
    assert [e.value for e in largest] == [max(a.value, b.value) for a, b in zip(*per_layer, strict=True)]
    for tag in ("logit_lse_mean", "logit_lse_max", "logit_abs_max", "update_ratio_max"):
        assert [e.step for e in events_.Scalars(f"stability/{tag}")] == [10, 20], tag
    ratios = [e.value for e in events_.Scalars("stability/update_ratio_max")]
    assert all(0 < r < 1 for r in ratios), ratios  # an update is a small part of the weights
    losses = {e.step: e.value for e in events_.Scalars("train/loss")}
    assert sorted(losses) == list(range(1, 21))
    for step, record in metrics(golden_run).items():
        assert losses[step] == pytest.approx(record["train/loss"], rel=1e-6)
    assert [e.step for e in events_.Scalars("eval/loss")] == [0, 10, 20]
    assert "config/text_summary" in events_.Tags()["tensors"]
    # The attention maps of eval.attention_probe, at every evaluation, as PNG images.
    images = events_.Images("attention/probe")
    assert [i.step for i in images] == [0, 10, 20]
    assert images[0].encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n" and images[0].width > 100
    # The per-group norms compose the global norm.
    at2 = metrics(golden_run)[2]
    groups = [v for k, v in at2.items() if k.startswith("train/grad_norm/")]
    assert math.sqrt(sum(g * g for g in groups)) == pytest.approx(at2["train/grad_norm"], rel=1e-3)


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pretrain", *args], capture_output=True, text=True, timeout=300
    )


def test_attention_refuses_an_empty_text_in_one_line(tmp_path, golden_run):
    """(The maps themselves, of the README's command: tests/integration/test_readme.py.)"""
    bad = run_cli("attention", "--checkpoint", str(golden_run), "--text", "", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_two_nodes_without_ssh_match_one_node(tmp_path, golden_run, train_data):
    """launch/multi_node.sh in the launcher's no-ssh mode, two "nodes" on loopback, one process
    each: the first 6 steps are the golden run's, bit for bit."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    run_dir = tmp_path / "run"
    script = REPO_CONFIG_DIR.parent / "launch" / "multi_node.sh"
    env = os.environ | {
        "HOSTFILE": str(hostfile),
        "NO_SSH": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    nodes = []
    for node_rank in (1, 0):
        args = [
            "bash",
            str(script),
            "--config",
            TINY,
            f"run.dir={run_dir}",
            f"data.dir={train_data}",
            *FAST,
            *GOLDEN,
            "train.stop_at_step=6",
            "eval.every=0",
        ]
        node_env = env | {"NODE_RANK": str(node_rank)}
        nodes.append(
            subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=node_env)
        )
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs[1][-3000:]
    ours, theirs = metrics(run_dir), metrics(golden_run)
    assert [ours[s]["train/loss"] for s in range(1, 7)] == [theirs[s]["train/loss"] for s in range(1, 7)]
    # Both nodes went through `pretrain launch`; node 0 ran the service, which saw every step.
    log = events(run_dir)
    assert [e["step"] for e in log if e["type"] == "step"] == [1, 2, 3, 4, 5, 6]
    (stopped,) = [e for e in log if e["type"] != "step"]  # a clean run: no rollback, no restart
    assert stopped["type"] == "job_stopped" and stopped["saved"] == "step_00000006"
    assert (
        stopped["resume"].startswith("pretrain launch --hostfile")
        and "on every other node" in stopped["resume"]
    )
    assert json.loads((run_dir / "monitor" / "supervisor.json").read_text())["state"] == "stopped"

    # Again, on to step 2000; node 1's supervisor is killed with -9 as step 10 is reported: its
    # ranks save and stop, and so does node 0, whose console and events.jsonl say who left.
    for node_rank in (1, 0):
        args = [
            "bash",
            str(script),
            "--config",
            TINY,
            f"run.dir={run_dir}",
            f"data.dir={train_data}",
            *FAST,
            *GOLDEN,
            "train.steps=2000",
            "eval.every=0",
        ]
        with (tmp_path / f"node{node_rank}.log").open("w") as out:
            nodes[node_rank] = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env | {"NODE_RANK": str(node_rank)}
            )
    deadline = time.time() + 180
    while time.time() < deadline and max(metrics(run_dir)) < 10:
        time.sleep(0.1)
    nodes[1].kill()
    nodes[1].wait()
    try:
        nodes[0].wait(timeout=120)
    finally:
        output = (tmp_path / "node0.log").read_text()
    assert nodes[0].returncode == 0, output[-3000:]
    (stop,) = [e for e in events(run_dir) if e["type"] == "stop_requested"]
    assert [(r["node"], r["rank"]) for r in stop["requested_by"]] == [(1, 1)]
    assert f"its supervisor (pid {nodes[1].pid} on" in stop["requested_by"][0]["why"]
    told = f"stop requested by node 1 ({stop['requested_by'][0]['host']}, rank 1): its supervisor (pid {nodes[1].pid}"
    assert told in output and f"saved {stop['saved']} and exiting" in output
    assert f"newest checkpoint: {stop['saved']}; to resume: pretrain launch --hostfile" in output


def test_batch_size_mismatch_is_refused_before_any_process_group(tmp_path, train_data):
    result = train(launcher(2), tmp_path, train_data, "train.global_batch_size=7", check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("pretrain: error:")]
    assert len(errors) == 1 and "train.global_batch_size=7" in errors[0] and "2 processes = 4" in errors[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "checkpoints").exists()
