"""launch/slurm.sbatch under a real one-machine Slurm (slurmctld, slurmd, munge; GPUs declared as
GRES backed by placeholder devices: tests/integration/slurm_cluster.py): slots follow what Slurm
allocated, zero slots is one line, the time-limit warning ends in a checkpoint saved by design and
a requeued job that resumes from it, a failed node is excluded from the requeued job (or, with no
node left, the job is not requeued), and scancel leaves nothing running."""

import itertools
import time

from pretrain import checkpoint as ck
from pretrain.config import REPO_CONFIG_DIR
from pretrain.parallel.distributed import free_port
from tests.integration.runs import FAST, TINY, events
from tests.integration.slurm_cluster import ABSENT, FINAL_STATES, NODE, PAIR
from tests.integration.test_ownership import CALM, processes_of, step_events, wait_for

REPO = REPO_CONFIG_DIR.parent
SCRIPT = str(REPO / "launch" / "slurm.sbatch")


def submit(slurm, tmp_path, *sbatch_args, steps=40):
    """The node's name is not an address here: MASTER_ADDR says where node 0 listens."""
    slurm.env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # (tests run side by side)
    tmp_path.mkdir(exist_ok=True)
    args = [
        *sbatch_args,
        f"--output={tmp_path / 'job.out'}",
        SCRIPT,
        "--config",
        TINY,
        f"run.dir={tmp_path / 'run'}",
        f"data.dir={slurm.data}",
        *FAST,
        "eval.every=0",
        f"train.steps={steps}",
        "checkpoint.every=1000",
        *CALM,
    ]
    return slurm.sbatch(args, cwd=REPO)


def supervisor_of(run_dir):
    """The node's `pretrain launch` (the Slurm task itself: multi_node.sh execs it), or None."""
    found = [p for p in processes_of(run_dir) if "launch" in p.cmdline()[:4]]
    return found[0] if found else None


def training(slurm, job, run_dir) -> float | None:
    """Wait until the job has reported 3 steps: the seconds it took from now, a start's measure on
    this machine as loaded as it is, which later waits are sized by (None if it ended first).
    (600 s: only a hang's limit; 150 s here with a load average of 16.)"""
    started = time.monotonic()
    assert wait_for(lambda: len(step_events(run_dir)) >= 3 or slurm.state(job) in FINAL_STATES, timeout=600)
    return time.monotonic() - started if len(step_events(run_dir)) >= 3 else None


def seconds_per_step(run_dir) -> float:
    """The longest interval between the steps reported so far (the events' times)."""
    times = [e["time"] for e in events(run_dir) if e["type"] == "step"]
    return max(b - a for a, b in itertools.pairwise(times))


def test_the_time_limit_warning_saves_requeues_and_the_job_resumes(slurm, tmp_path, train_data):
    slurm.data = train_data
    run_dir = tmp_path / "run"
    # (--time: far enough for Slurm's own warning, 5 minutes before it, never to come: with --time=10
    # a loaded machine's resumed job ran past it and would have been warned and requeued again)
    job = submit(slurm, tmp_path, "--nodes=1", "--gpus-per-node=2", "--time=120")
    started = training(slurm, job, run_dir)
    assert started, slurm.log(tmp_path / "job.out")
    # What `#SBATCH --signal=B:USR1@300` sends the batch script 5 minutes before the time limit.
    slurm.run(["scancel", "--batch", "--signal=USR1", str(job)])
    # Saved, requeued (6 s), started again and 37 steps more: 3 times that as measured, a hang's limit
    limit = 3 * (started + 40 * seconds_per_step(run_dir)) + 60
    assert slurm.wait(job, timeout=limit) == "COMPLETED", slurm.log(tmp_path / "job.out")
    output = slurm.log(tmp_path / "job.out")
    assert slurm.job(job)["Restarts"] == "1", output  # requeued once, by the script itself
    (stop,) = [e for e in events(run_dir) if e["type"] == "stop_requested"]
    saved = stop["saved"]
    assert ck.step_of(saved) >= 3 and [r["rank"] for r in stop["requested_by"]] == [0, 1]  # 2 GPUs → 2 slots
    # Slurm's copy and the supervisor's reach each rank in either order: the same words for both
    assert all(r["why"] == "SIGUSR1 received" for r in stop["requested_by"]), stop["requested_by"]
    (stopped,) = [e for e in events(run_dir) if e["type"] == "job_stopped"]
    assert (
        stopped["saved"] == saved
        and stopped["resume"] == f"Slurm job {job} requeues itself and resumes from it"
    )
    assert (
        f"requeueing job {job}" in output
        and f"steps {ck.step_of(saved) + 1}..40 (resumed from {saved})" in output
    )
    assert "srun: error" not in output  # the warned job ended cleanly
    assert ck.step_of(ck.newest_complete(run_dir)) == 40
    assert not processes_of(run_dir)


def test_zero_slots_is_one_line_a_lost_supervisor_requeues_without_its_node_and_scancel_leaves_nothing_running(
    slurm, tmp_path, train_data
):
    slurm.data = train_data
    refused = submit(slurm, tmp_path / "refused", "--nodes=1")  # no GPUs allocated, no PROCS_PER_NODE
    assert slurm.wait(refused, timeout=60) == "FAILED"
    assert slurm.job(refused)["ExitCode"] == "2:0"
    lines = slurm.log(tmp_path / "refused" / "job.out").splitlines()
    assert len(lines) == 1 and "pass --gpus-per-node=N to sbatch, or set PROCS_PER_NODE=N" in lines[0], lines

    slurm.env["PROCS_PER_NODE"] = "2"  # a CPU node: processes per node as the user gives them
    run_dir = tmp_path / "run"
    # In partition PAIR: the job's node and ABSENT (down), so a node is left once NODE is excluded.
    job = submit(slurm, tmp_path, "--nodes=1", f"--partition={PAIR}", steps=400)
    started = training(slurm, job, run_dir)
    assert started, slurm.log(tmp_path / "job.out")
    supervisor = supervisor_of(run_dir)
    supervisor.kill()  # the node's supervisor is lost: its ranks save and stop, the step fails
    limit = 3 * started + 60  # (hang limits from here on: 3 times a start as measured)
    assert wait_for(lambda: slurm.job(job)["Restarts"] == "1", timeout=limit), slurm.log(tmp_path / "job.out")
    (stop,) = [e for e in events(run_dir) if e["type"] == "stop_requested"]
    assert all(f"its supervisor (pid {supervisor.pid} on" in r["why"] for r in stop["requested_by"])
    # srun's own line named the node: the requeued job excludes it, and waits for a node (ABSENT's down)
    output = slurm.log(tmp_path / "job.out")
    assert f"srun: error: {NODE}: task 0: Killed" in output
    assert (
        f"slurm.sbatch: leaving {NODE} (node 0, ranks 0-1) out of the requeued job: srun: task 0: Killed "
        f"(ExcNodeList={NODE})" in output
    ), output
    assert f"the job failed on some node (status 137); requeueing job {job} (1 of MAX_REQUEUES=10)" in output
    (excluded,) = [e for e in events(run_dir) if e["type"] == "node_excluded"]
    assert excluded["host"] == NODE and excluded["ranks"] == [0, 1] and excluded["step"] >= 3
    assert excluded["reason"] == "srun: task 0: Killed"
    # (the script sets it just after the requeue, which the restart count already shows)
    assert wait_for(lambda: slurm.job(job)["ExcNodeList"] == NODE, timeout=limit), (slurm.job(job), output)
    assert wait_for(lambda: ABSENT in slurm.job(job)["Reason"], timeout=30), slurm.job(job)  # not on NODE
    assert slurm.state(job) == "PENDING"

    slurm.run(["scontrol", "update", f"JobId={job}", "ExcNodeList="])  # the node is back: the job runs
    assert wait_for(
        lambda: max(step_events(run_dir)) > ck.step_of(stop["saved"]) + 2 or slurm.state(job) in FINAL_STATES,
        timeout=limit,
    ), slurm.log(tmp_path / "job.out")
    assert f"(resumed from {stop['saved']})" in slurm.log(tmp_path / "job.out")

    assert len(processes_of(run_dir)) >= 3  # the supervisor, the launcher, two ranks
    slurm.run(["scancel", str(job)])
    assert slurm.wait(job, timeout=limit) == "CANCELLED"
    assert wait_for(lambda: not processes_of(run_dir), timeout=limit), processes_of(run_dir)
    assert slurm.job(job)["Restarts"] == "1"  # a cancelled job is not requeued


def test_a_job_whose_partition_has_no_node_left_without_the_failed_one_is_not_requeued(
    slurm, tmp_path, train_data
):
    slurm.data = train_data
    slurm.env["PROCS_PER_NODE"] = "2"
    run_dir = tmp_path / "run"
    job = submit(slurm, tmp_path, "--nodes=1")  # the default partition: NODE alone
    assert wait_for(  # (300 s, 60 s: hang limits; a loaded machine starts and ends a job slowly)
        lambda: supervisor_of(run_dir) is not None or slurm.state(job) in FINAL_STATES, timeout=300
    )
    supervisor_of(run_dir).kill()  # at once: the step fails before training
    assert slurm.wait(job, timeout=300) == "FAILED", slurm.log(tmp_path / "job.out")
    output = slurm.log(tmp_path / "job.out")
    assert slurm.job(job)["ExitCode"] == "137:0" and slurm.job(job)["Restarts"] == "0", output
    assert (
        f"slurm.sbatch: not requeueing job {job}: it needs 1 node(s), and partition debug has 0 left without "
        f"{NODE}; failed: {NODE} (srun: task 0: Killed)" in output
    ), output
    assert "the job failed on some node" not in output and slurm.job(job)["ExcNodeList"] == "(null)"
    recorded = events(run_dir) if (run_dir / "events.jsonl").exists() else []
    assert not [e for e in recorded if e["type"] == "node_excluded"]  # nothing was excluded
    assert wait_for(lambda: not processes_of(run_dir), timeout=300), processes_of(run_dir)
