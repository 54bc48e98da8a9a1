"""`scripts/gpu_check.sh --cpu`: the GPU check's parts on a CPU (the tiny config, a few steps),
writing the files a lent GPU's run writes, so that a change that breaks the script fails here and
not in the first minutes of a GPU lease (docs/gpu.md)."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from pretrain.config import REPO_CONFIG_DIR

SCRIPT = REPO_CONFIG_DIR.parent / "scripts" / "gpu_check.sh"


def test_the_cpu_mode_runs_every_part_and_writes_the_gpu_runs_files(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = os.environ | {"PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(SCRIPT), "--cpu", str(out), "--work", str(work)],
        capture_output=True,
        text=True,
        timeout=2100,  # (a safety net past the CPU mode's own 1800 s budget, which only a hang uses)
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {
        "summary.json",
        "gpu_check.log",
        "bench-tiny.json",
        "launch.json",
        "profile.json",
    }
    summary = json.loads((out / "summary.json").read_text())
    statuses = {p["name"]: p["status"] for p in summary["parts"]}
    assert statuses == {
        "versions": "ok",
        "fused_adam": "skipped",
        "pytest": "ok",
        "bench tiny": "ok",
        "launch": "ok",
        "profile": "ok",
    }
    assert summary["mode"] == "cpu" and summary["versions"]["torch"].startswith("2.")
    pytest_part = next(p for p in summary["parts"] if p["name"] == "pytest")
    assert (
        pytest_part["tests"]["skipped"] >= 10 and pytest_part["tests"]["failed"] == 0
    )  # the GPU tier, skipped

    bench = json.loads((out / "bench-tiny.json").read_text())
    assert (
        bench["device"] == "cpu"
        and bench["ours_tokens_per_sec"] > 0
        and bench["first_loss_difference"] < 1e-2
    )
    # our step's one host read (the norm gate's); Transformers' model in DeepSpeed's own engine: its
    # 4 checks under ZeRO-1 (and transformers 5.24's own in its masking)
    syncs = bench["host_syncs_per_step"]
    assert syncs["ours"] == 1 and syncs["hf"] >= 4, bench["host_sync_sites"]
    profile = json.loads((out / "profile.json").read_text())["tiny"]
    assert profile["timeline"] == "cpu" and 0 < profile["matmul_share"] < 1

    launch = json.loads((out / "launch.json").read_text())
    assert launch["ok"] and all(launch["checks"].values()), launch["checks"]
    assert [(r["step"], r["target"]) for r in launch["rollbacks"]] == [(9, "step_00000008")]  # the spike
    assert [r["resume_from"] for r in launch["restarts"]] == ["step_00000008"]  # killed as step 11 began
    assert launch["resumed_from"] == "step_00000012" and launch["summary"]["step"] == 14
    log = (out / "gpu_check.log").read_text()
    for part in statuses:
        assert f"===== {part} (budget" in log
    assert result.stdout.splitlines()[-7].startswith("gpu_check (cpu): 6 parts")


def test_the_variants_part_runs_what_a_cpu_can_and_chooses(tmp_path):
    """`scripts/gpu_check.sh --cpu --parts variants`: on the tiny model, the baseline (the step
    before the levers), all levers together and the larger micro-batch, each its own process; the
    levers a CPU cannot show skipped with the reason; variants.json as a GPU's call writes it."""
    from pretrain.bench.variants import FIELDS

    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", str(SCRIPT), "--cpu", "--parts", "variants", str(out), "--work", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"summary.json", "gpu_check.log", "variants.json"}
    assert [p["status"] for p in json.loads((out / "summary.json").read_text())["parts"]] == ["ok"]
    variants = json.loads((out / "variants.json").read_text())
    rows = {r["name"]: r for r in variants["variants"]}
    assert all(tuple(r) == FIELDS for r in rows.values())
    ran = [name for name, r in rows.items() if r["skipped"] is None]
    assert ran == ["tiny/baseline", "tiny/all", "tiny/all_mb2"], rows
    assert all(r["tokens_per_second"] > 0 for name, r in rows.items() if name in ran)
    # the step before the levers: DeepSpeed's 4 reads and the loop's; with them, the one read
    assert rows["tiny/baseline"]["host_syncs_per_step"] == 5 and rows["tiny/all"]["host_syncs_per_step"] == 1
    assert (
        rows["tiny/all"]["first_loss"] == rows["tiny/baseline"]["first_loss"]
    )  # (the same numbers on a CPU)
    assert "CUDA" in rows["tiny/loss_liger"]["skipped"] and "CUDA" in rows["tiny/cudnn_attention"]["skipped"]
    assert variants["chosen"]["tiny"] in ran


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT.with_suffix(".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_a_part_over_its_budget_is_stopped_with_its_processes_and_the_check_goes_on(tmp_path):
    """A part's command (and what it started) is stopped at the part's budget; the part is recorded
    as failed, and a part with no time left in the check's budget as skipped."""
    gpu_check = load_gpu_check()
    gpu_check.MINIMUM = 0.5
    mode = gpu_check.Mode(**{**gpu_check.CPU.__dict__, "budget": 3.0, "budgets": {"slow": 1.5, "after": 5.0}})
    check = gpu_check.Check(mode, tmp_path, tmp_path, started=time.time())

    def slow(check, budget):
        finished = check.run(["bash", "-c", "sleep 61.25 & sleep 61.5"], budget)
        raise gpu_check.failed_command(finished, "slow")

    with open(tmp_path / "gpu_check.log", "a") as check.log_file:
        gpu_check.run_part(check, "slow", slow)
        time.sleep(max(0.0, check.remaining() - 0.2))
        gpu_check.run_part(check, "after", lambda check, budget: {})
    slow_part, after = check.summary["parts"]
    # stopped at its 1.5 s budget, not after its commands' 61 s (a loaded 2-core machine took 6.5 s once)
    assert (
        slow_part["status"] == "failed" and "time budget" in slow_part["line"] and slow_part["seconds"] < 30
    )
    assert after["status"] == "skipped" and "no time left" in after["line"]
    assert json.loads((tmp_path / "summary.json").read_text())["parts"] == check.summary["parts"]
    leftover = subprocess.run(["pgrep", "-f", "sleep 61.(25|5)"], capture_output=True, text=True)
    assert leftover.stdout == "", leftover.stdout  # the background sleep too: the whole group


def test_on_a_cpu_each_budget_stretches_with_the_slowdown_the_finished_parts_measured(tmp_path):
    """A CPU shared with other work runs every part slower by a factor that changes: the budgets
    follow what the parts before measured (the slowest ratio to what they are expected to take),
    and a part that took less than expected does not shrink them."""
    gpu_check = load_gpu_check()
    check = gpu_check.Check(gpu_check.CPU, tmp_path, tmp_path, started=time.time())
    expected, budgets = gpu_check.CPU.expected, gpu_check.CPU.budgets
    assert check.budget_of("launch") == budgets["launch"] >= 5 * expected["launch"]
    check.summary["parts"] += [
        {"name": "versions", "status": "ok", "seconds": 3 * expected["versions"]},
        {"name": "pytest", "status": "ok", "seconds": 0.5 * expected["pytest"]},
    ]
    assert check.budget_of("launch") == pytest.approx(3 * budgets["launch"])
    check.summary["parts"].append({"name": "launch", "status": "failed", "seconds": 4 * expected["launch"]})
    assert check.budget_of("bench tiny") == pytest.approx(4 * budgets["bench tiny"])
    gpu = gpu_check.Check(gpu_check.GPU, tmp_path, tmp_path, started=time.time())
    gpu.summary["parts"] = check.summary["parts"]
    assert gpu.budget_of("launch") == gpu_check.GPU.budgets["launch"]  # a lease's budgets are fixed
