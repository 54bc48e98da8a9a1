"""A node lost mid-run, with and without a spare (`pretrain launch --hostfile H --nodes 2
--min-nodes 1`), over real ssh and pdsh: this machine is three hosts, `localhost` behind the
session's sshd and `node-b`, `node-c` each behind an sshd of its own that the test kills with
everything started through it (tests/integration/ssh_hosts.py). One run shows both: node-b dies,
and the job goes on on localhost and the spare node-c at the same world size, its losses those
the first timeline had from the same checkpoint; node-c dies, no spare is left, and the job goes
on alone with twice the gradient accumulation, its losses those of a one-process run resumed from
that checkpoint."""

import shutil
import subprocess
import sys
import time

from pretrain import checkpoint as ck
from pretrain.parallel.distributed import free_port
from pretrain.reporting.metrics import read_metrics
from tests.integration.runs import FAST, TINY, events, torchrun, train
from tests.integration.test_ownership import CALM, wait_for

STEPS = 24


def timelines(run_dir) -> list[dict[int, float]]:
    """metrics.jsonl's losses, one {step: loss} per timeline (a restart that goes back starts one)."""
    found: list[dict[int, float]] = [{}]
    for record in read_metrics(run_dir):
        if found[-1] and record["step"] <= max(found[-1]):
            found.append({})
        found[-1][record["step"]] = record["train/loss"]
    return found


def last_step(run_dir) -> int:
    records = read_metrics(run_dir)
    return records[-1]["step"] if records else 0


def saved(run_dir) -> int:
    return ck.step_of(ck.newest_complete(run_dir, verify_hashes=False) or "step_00000000")


def kill_between_checkpoints(node, run_dir, after: int, timeout: float = 240) -> None:
    """Kill `node` as soon as the job has trained two steps past its newest checkpoint (itself at
    or after step `after`): the restart then trains those steps again, from that checkpoint. The
    next checkpoint is two steps and a save away, so killing at once lands before it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        newest = saved(run_dir)
        if newest >= after and last_step(run_dir) >= newest + 2:
            node.stop()
            return
        time.sleep(0.05)
    raise AssertionError(f"the job did not reach step {after} + 2 in {timeout:.0f} s")


def restarts(run_dir) -> list[dict]:
    return [e for e in events(run_dir) if e["type"] == "restart"]


def test_a_lost_node_is_replaced_by_a_spare_and_with_none_left_the_job_shrinks(
    ssh_hosts, tmp_path, train_data
):
    run_dir = tmp_path / "run"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\nnode-b slots=1\nnode-c slots=1\n")
    overrides = [f"run.dir={run_dir}", f"data.dir={train_data}", *FAST, "eval.every=0", *CALM]
    overrides += ["monitor.warmup=4", "monitor.window=16", f"train.steps={STEPS}", "checkpoint.every=4"]
    overrides += ["checkpoint.keep=100"]
    command = [sys.executable, "-m", "pretrain", "launch", "--hostfile", str(hostfile), "--nodes", "2"]
    command += ["--min-nodes", "1", "--master-port", str(free_port()), "--config", TINY, *overrides]
    log = tmp_path / "launch.log"
    with ssh_hosts.extra_host("node-b") as node_b, ssh_hosts.extra_host("node-c") as node_c:
        with log.open("w") as out:
            supervisor = subprocess.Popen(command, env=ssh_hosts.env, stdout=out, stderr=subprocess.STDOUT)
        try:
            kill_between_checkpoints(node_b, run_dir, after=4)  # the node dies: launcher, rank, sshd
            lost_b = time.time()
            assert wait_for(lambda: restarts(run_dir), 240), log.read_text()
            resumed = ck.step_of(restarts(run_dir)[0]["resume_from"])
            kill_between_checkpoints(node_c, run_dir, after=resumed + 4)  # the spare dies too
            assert supervisor.wait(timeout=400) == 0, log.read_text()[-4000:]
        finally:
            if supervisor.poll() is None:
                supervisor.kill()
    said = log.read_text()
    print("\n".join(line for line in said.splitlines() if line.startswith("launch:")))
    kinds = [
        (e["type"], e.get("host") or e.get("new"))
        for e in events(run_dir)
        if e["type"].startswith(("node_", "world"))
    ]
    assert kinds == [
        ("node_lost", "node-b"),
        ("node_excluded", "node-b"),
        ("node_replaced", "node-c"),
        ("node_lost", "node-c"),
        ("node_excluded", "node-c"),
        ("world_resized", None),
    ], said
    (resized,) = [e for e in events(run_dir) if e["type"] == "world_resized"]
    assert (resized["from"], resized["to"], resized["accumulation"]) == (2, 1, 2)
    assert "launch: node-c replaces node-b" in said and "launch: node-b left out: ssh: " in said
    first, second = restarts(run_dir)

    # After the spare took over: the same losses as the first timeline from the same checkpoint.
    before, after_spare = timelines(run_dir)[:2]
    resumed_at = ck.step_of(first["resume_from"])
    overlap = [s for s in before if s > resumed_at and s in after_spare]
    assert len(overlap) >= 2 and all(before[s] == after_spare[s] for s in overlap), (
        overlap,
        before,
        after_spare,
    )
    # The first step after the loss, and how long it took to come.
    judged_again = next(e for e in events(run_dir) if e["type"] == "step" and e["time"] > first["time"])
    print(f"node-b lost -> first step after the restart on the spare: {judged_again['time'] - lost_b:.1f} s")

    # Alone, twice the accumulation: the losses of one process resumed from the same checkpoint.
    tag = second["resume_from"]
    reference = tmp_path / "reference"
    shutil.copytree(run_dir / "checkpoints" / tag, reference / "checkpoints" / tag)
    (reference / "checkpoints" / "latest").write_text(tag + "\n")
    again = [o for o in overrides if not o.startswith(("run.dir=", "data.dir="))]
    train(torchrun(1), reference, train_data, *again, "train.grad_accum=2", "checkpoint.resume=auto")
    ours = {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if r["step"] > ck.step_of(tag)}
    (one,) = timelines(reference)
    assert sorted(one) == sorted(ours) and all(one[s] == ours[s] for s in one), (one, ours)
