"""`pretrain launch --hostfile` over real ssh and pdsh, as most DeepSpeed users start jobs: this
machine is two hosts (`localhost` and its host name) behind a local sshd with a key made for the
test (tests/integration/ssh_hosts.py), and a spare behind an sshd of its own. The ranks started
over ssh recognise their supervisor's lock, a supervisor killed with -9 leaves nothing running on
any host (the ranks save as they stop), the same command resumes, a host whose copy of the
weights goes wrong is rolled back and moved off for the spare, and a host whose launcher fails
ends the job at once, naming the host."""

import json
import subprocess
import sys
import time

from pretrain import checkpoint as ck
from pretrain.parallel.distributed import free_port
from tests.integration.runs import FAST, TINY, events
from tests.integration.test_ownership import CALM, NOISE, processes_of, step_events, wait_for


def launch_command(hostfile, run_dir, data_dir, *overrides):
    return [
        sys.executable,
        "-m",
        "pretrain",
        "launch",
        "--hostfile",
        str(hostfile),
        "--master-port",
        str(free_port()),
        "--config",
        TINY,
        f"run.dir={run_dir}",
        f"data.dir={data_dir}",
        *FAST,
        "eval.every=0",
        "monitor.warmup=4",
        "monitor.window=16",
        *CALM,
        *overrides,
    ]


# A flipped weight bit in rank 1's copy after step 12 (rank 1 on the second host): the replicas
# differ at step 13, and one machine fault is that host's limit.
FLIP = ["faults.flip_step=12", "faults.flip_rank=1", "faults.flip_target=weight"]


def test_a_hostfile_over_ssh_trains_on_both_hosts_and_nothing_outlives_a_killed_supervisor(
    ssh_hosts, tmp_path, train_data
):
    """Then the same command resumes, and a replica mismatch on the second host (its limit of
    machine faults: monitor.machine_faults_to_exclude=1) rolls the job back to its checkpoint, which
    it stops at with status 5; the supervisor moves that host off and the spare takes its place."""
    hostfile = ssh_hosts.write_hostfile(tmp_path / "hostfile")
    hostfile.write_text(hostfile.read_text() + "node-s slots=1\n")
    run_dir = tmp_path / "run"
    overrides = ["train.steps=30", "checkpoint.every=1000", *FLIP, "monitor.machine_faults_to_exclude=1"]
    command = launch_command(hostfile, run_dir, train_data, *overrides)
    command[4:4] = ["--nodes", "2"]  # (after `pretrain launch`: the hostfile's third host is a spare)
    with ssh_hosts.extra_host("node-s") as spare:
        with (tmp_path / "first.log").open("w") as log:
            supervisor = subprocess.Popen(command, env=ssh_hosts.env, stdout=log, stderr=subprocess.STDOUT)
        assert wait_for(lambda: len(step_events(run_dir)) >= 3, timeout=600), (
            tmp_path / "first.log"
        ).read_text()
        assert len(ssh_hosts.remote_pids()) >= 4  # on each host: the launcher and its rank (and their shells)
        assert not ssh_hosts.remote_pids(spare.tag)  # (a spare runs nothing)
        supervisor.kill()  # kill -9: no chance to stop its job
        supervisor.wait()
        killed = time.time()
        assert wait_for(lambda: not ssh_hosts.remote_pids() and not processes_of(run_dir), timeout=60), [
            p.info for p in processes_of(run_dir)
        ]
        print(f"every process on both hosts was gone {time.time() - killed:.1f} s after the supervisor")
        saved = ck.newest_complete(run_dir)
        assert saved is not None and 3 <= ck.step_of(saved) < 12  # the ranks saved as they stopped
        (stop,) = [e for e in events(run_dir) if e["type"] == "stop_requested"]
        assert stop["saved"] == saved and {r["rank"] for r in stop["requested_by"]} <= {0, 1}
        # Each rank stops on its own lifeline (it sees the supervisor's host) or on its launcher's
        # SIGTERM (the path of ranks on other hosts: the launcher beside the supervisor stops every host).
        assert all(
            "its supervisor (pid" in r["why"] or r["why"] == "SIGTERM received" for r in stop["requested_by"]
        )

        again = subprocess.run(command, env=ssh_hosts.env, capture_output=True, text=True, timeout=400)
        assert not ssh_hosts.remote_pids(spare.tag)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"steps {ck.step_of(saved) + 1}..30 (resumed from {saved})" in again.stdout
    assert "localhost: done: 30 steps" in again.stdout  # rank 0's lines, labelled by pdsh with its host
    for noise in NOISE:  # a quiet console: no launcher INFO lines from either host
        assert noise not in again.stdout + again.stderr, noise
    assert "changed since the last start" not in again.stdout  # the same command changes nothing
    assert ck.step_of(ck.newest_complete(run_dir)) == 30
    assert not ssh_hosts.remote_pids()
    moved_off_for_the_spare(run_dir, saved, ssh_hosts.hosts[1], again.stdout)
    assert "the monitor refused" not in again.stdout + again.stderr  # (the rollback's outcome was told)


def moved_off_for_the_spare(run_dir, saved: str, second: str, said: str) -> None:
    """The replica check's rollback is the run's one `Rollback` record, applied and counted; the
    host it found at its limit is moved off (saved at that checkpoint, exit status 5), the spare
    takes its place, and the run completes from that checkpoint."""
    found = events(run_dir)
    (mismatch,) = [e for e in found if e["type"] == "replica_mismatch"]
    assert (mismatch["step"], mismatch["ranks"], mismatch["rolled_back_to"]) == (13, [1], saved)
    (rollback,) = [e for e in found if e["type"] == "rollback"]
    assert rollback["decision"] is None and rollback["finding"] == "replica_mismatch"
    assert (rollback["step"], rollback["target"], rollback["seed"]) == (13, saved, None)
    (applied,) = [e for e in found if e["type"] == "rollback_applied"]
    assert applied["tag"] == saved and applied["applied_at"] == 13
    moves = [(e["type"], e.get("host") or e.get("new")) for e in found if e["type"].startswith("node_")]
    assert moves == [("node_excluded", second), ("node_replaced", "node-s")], moves
    restart = [e for e in found if e["type"] == "restart"][-1]
    assert (
        restart["reason"].startswith(f"replace {second} (1 machine faults on ")
        and restart["resume_from"] == saved
    )
    assert f"saved {saved} and exiting" in said and f"launch: node-s replaces {second}" in said
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["completed"] and summary["rollbacks"] == 1 and summary["restarts"] == 1


def test_a_host_whose_launcher_fails_ends_the_job_at_once_naming_the_host(ssh_hosts, tmp_path, train_data):
    """The second host passes its check, then goes down as the job starts (its ssh connection is
    refused): rank 0 would wait for it in the rendezvous until the startup limit; pdsh's report of
    that host ends the job within seconds. The live host is slow to start its launcher, as a loaded
    machine can be: the stop reaches it before its launcher is there, and must still stop the rank
    it starts (else that rank waits in the rendezvous, the job's stop waits out its grace, and the
    supervisor waits for the rank)."""
    hostfile = ssh_hosts.write_hostfile(tmp_path / "hostfile")
    second = ssh_hosts.hosts[1]
    started = time.time()
    with ssh_hosts.slow_to_launch("localhost", seconds=2), ssh_hosts.refuses_launch(second):
        result = subprocess.run(
            launch_command(
                hostfile,
                tmp_path / "run",
                train_data,
                "train.steps=10",
                "monitor.max_restarts=0",
                "monitor.stop_grace_seconds=600",  # (a stop that waits out its grace: the timeout)
            ),
            env=ssh_hosts.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    took = time.time() - started
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 255, output
    (line,) = [line for line in result.stdout.splitlines() if "failed: its launcher exited" in line]
    assert line.startswith(f"launch: node 1 ({second}) failed: its launcher exited with status 255: ")
    assert "Connection refused" in line and line.endswith("stopping the job on every node")
    # Ended by pdsh's report, not by the 30-minute startup limit nor the stop's 600 s grace (both past
    # the 300 s timeout): 52 s at most here, with the machine loaded (load average 18)
    assert took < 240, f"{took:.0f} s\n{output}"
    assert not ssh_hosts.remote_pids() and not processes_of(tmp_path / "run")
    print(f"the job ended {took:.1f} s after it was started")


def test_a_host_down_before_the_start_is_named_and_nothing_is_started(ssh_hosts, tmp_path, train_data):
    """The second host is down (its ssh connection is refused): its check before the start fails,
    so the job is not started at all (rank 0 would wait for it in the rendezvous until the startup
    limit); with no spare and --min-nodes at its default (every host), the launch gives up at
    once, naming the host and why."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost slots=1\n{ssh_hosts.down} slots=1\n")
    started = time.time()
    result = subprocess.run(
        launch_command(hostfile, tmp_path / "run", train_data, "train.steps=10"),
        env=ssh_hosts.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    took = time.time() - started
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 1, output
    (line,) = [line for line in result.stdout.splitlines() if "left out" in line]
    assert line.startswith(f"launch: {ssh_hosts.down} left out: ssh: ") and "Connection refused" in line
    assert "fewer than --min-nodes 2 host(s) can take part" in result.stdout
    assert (tmp_path / "run" / "monitor" / "hosts.json").exists() is False  # (no start: no host set)
    assert took < 240, f"{took:.0f} s\n{output}"  # the check, not the 30-minute startup limit (23 s loaded)
    assert not ssh_hosts.remote_pids() and not processes_of(tmp_path / "run")
    (excluded,) = [e for e in events(tmp_path / "run") if e["type"] == "node_excluded"]
    assert excluded["host"] == ssh_hosts.down and excluded["ranks"] == []
    print(f"the launch gave up {took:.1f} s after it was started")
