"""Which nodes launch/slurm.sbatch leaves out of a requeued job (pretrain/cli/slurm_exclude.py): srun's
own lines and Slurm's node states read, the decision and its lines. The lines are Slurm 22.05's, as
seen from a real one-node cluster (tests/integration/test_slurm_launch.py runs the script)."""

import pytest

from pretrain.cli.slurm_exclude import SlurmJob, decide, lines_for, ranks_of, srun_failures, unhealthy

KILLED = "srun: error: node1: task 1: Killed"

SRUN_CASES = [
    ([KILLED, "srun: Force Terminated StepId=7.0"], {"node1": "srun: task 1: Killed"}),
    (["srun: error: node0: tasks 0-1: Terminated"], {"node0": "srun: tasks 0-1: Terminated"}),
    (
        ["srun: error: node2: task 2: Segmentation fault (core dumped)"],
        {"node2": "srun: task 2: Segmentation fault (core dumped)"},
    ),
    (
        ["srun: error: node1: task 1: Exited with exit code 137"],
        {"node1": "srun: task 1: Exited with exit code 137"},
    ),
    (
        [
            "srun: error: node1: task 1: Exited with exit code 1",
            "srun: error: node2: task 2: Exited with exit code 1",
        ],
        {"node1": "srun: task 1: Exited with exit code 1", "node2": "srun: task 2: Exited with exit code 1"},
    ),
    # every node exited with a code: the job's own failure, no node blamed
    (
        [
            "srun: error: node0: task 0: Exited with exit code 1",
            "srun: error: node1: task 1: Exited with exit code 1",
            "srun: error: node2: task 2: Exited with exit code 1",
        ],
        {},
    ),
    # a signal blames its node, and the other nodes' exit codes are taken to follow from it
    (
        [
            "srun: error: node0: task 0: Exited with exit code 1",
            "srun: error: node1: task 1: Killed",
            "srun: error: node2: task 2: Exited with exit code 1",
        ],
        {"node1": "srun: task 1: Killed"},
    ),
    # a node lost: only it, not the tasks ended with it
    (
        ["srun: error: Node failure on node[1-2]", "srun: error: node0: task 0: Killed"],
        {"node[1-2]": "srun: node failure"},
    ),
    (
        ["srun: error: Task launch for StepId=7.0 failed on node node2: Communication connection failure"],
        {"node2": "srun: task launch failed: Communication connection failure"},
    ),
    # the first line about a node is its reason; lines that are not srun's own blame nothing
    ([KILLED, "srun: error: node1: task 1: Exited with exit code 9"], {"node1": "srun: task 1: Killed"}),
    (
        [
            "node1: step 3/40 | loss 9.1",
            "srun: Job step aborted: Waiting up to 32 seconds",
            "srun: error: Application launch failed: boom",
        ],
        {},
    ),
    ([], {}),
]


@pytest.mark.parametrize(("lines", "blamed"), SRUN_CASES)
def test_srun_lines_blame_the_nodes_that_failed(lines, blamed):
    assert srun_failures(lines, ["node0", "node1", "node2"]) == blamed


def test_a_one_node_job_that_exits_with_a_code_blames_no_node_but_a_killed_task_blames_it():
    assert srun_failures(["srun: error: node0: task 0: Exited with exit code 1"], ["node0"]) == {}
    assert srun_failures(["srun: error: node0: tasks 0-1: Killed"], ["node0"]) == {
        "node0": "srun: tasks 0-1: Killed"
    }


def test_slurm_states_name_the_unhealthy_nodes():
    lines = [
        "node0|allocated|none",
        "node1|draining|gpu lost",
        "node1|draining|gpu lost",  # the same node in a second partition
        "node2|down*|Not responding",
        "node3|mixed*|none",
        "node4|idle|none",
        "node5|fail|bad dimm",
        "",
    ]
    assert unhealthy(lines) == {
        "node1": "Slurm marks it draining: gpu lost",
        "node2": "Slurm marks it down*: Not responding",
        "node3": "Slurm marks it mixed*",
        "node5": "Slurm marks it fail: bad dimm",
    }


def job(nodes=("a", "b"), needs=2, partition_nodes=("a", "b", "c"), excluded=()):
    return SlurmJob(
        id="7",
        nodes=list(nodes),
        needs=needs,
        partition="batch",
        partition_nodes=list(partition_nodes),
        excluded=list(excluded),
    )


DECISIONS = [
    # (job, blamed) → (failed, ExcNodeList, requeued)
    (job(), {"b": "srun: task 1: Killed"}, ({"b": "srun: task 1: Killed"}, ["b"], True)),
    (job(excluded=["x"]), {"b": "k"}, ({"b": "k"}, ["x", "b"], True)),  # merged with the excluded before
    (job(), {"zz": "k"}, ({}, [], True)),  # a node not of this job
    (job(), {}, ({}, [], True)),  # nothing found: requeued with the same node list
    (job(), {"a": "k", "b": "k"}, ({"a": "k", "b": "k"}, ["a", "b"], False)),  # 1 left, 2 needed
    (job(nodes=["a"], needs=1, partition_nodes=["a"]), {"a": "k"}, ({"a": "k"}, ["a"], False)),
    (
        job(nodes=["a"], needs=1, partition_nodes=["a", "b"], excluded=["b"]),
        {"a": "k"},
        ({"a": "k"}, ["b", "a"], False),
    ),
    (
        job(partition_nodes=[]),
        {},
        ({}, [], True),
    ),  # a partition that lists nothing never stops a job nothing blamed
]


@pytest.mark.parametrize(("the_job", "blamed", "expected"), DECISIONS)
def test_the_decision_excludes_the_jobs_failed_nodes_while_the_partition_has_enough(
    the_job, blamed, expected
):
    exclusion = decide(the_job, blamed)
    assert (exclusion.failed, exclusion.excluded, exclusion.requeue(the_job)) == expected


def test_the_lines_name_each_node_its_ranks_and_why_or_why_the_job_stops():
    the_job = job(nodes=["a", "b", "c"], needs=3, partition_nodes=["a", "b", "c", "d"], excluded=["x"])
    assert ranks_of("b", the_job.nodes, 4) == [4, 5, 6, 7]
    assert lines_for(the_job, decide(the_job, {"b": "srun: task 1: Killed"}), slots=4) == [
        "slurm.sbatch: leaving b (node 1, ranks 4-7) out of the requeued job: srun: task 1: Killed (ExcNodeList=x,b)"
    ]
    assert lines_for(the_job, decide(the_job, {"c": "Slurm marks it drained: gpu"}), slots=1) == [
        "slurm.sbatch: leaving c (node 2, ranks 2) out of the requeued job: Slurm marks it drained: gpu (ExcNodeList=x,c)"
    ]
    (line,) = lines_for(the_job, decide(the_job, {"a": "k1", "b": "k2"}), slots=1)
    assert line == (
        "slurm.sbatch: not requeueing job 7: it needs 3 node(s), and partition batch has 2 left without x, a, b; "
        "failed: a (k1), b (k2). Bring the node(s) back into service, or submit again elsewhere"
    )
    assert lines_for(the_job, decide(the_job, {}), slots=1) == []


def test_the_exclusion_is_recorded_in_the_run_directory_of_the_scripts_arguments(tmp_path, capsys):
    from monitoring.protocol import NodeExcluded, NodeLost, append_event, read_events
    from pretrain.cli.slurm_exclude import record

    the_job = job()
    exclusion = decide(the_job, {"b": "srun: task 1: Killed"})
    append_event(tmp_path, NodeLost(step=12, host="b", ranks=[2, 3], reason="r"), sync=False)
    record(["--config", "tiny", f"run.dir={tmp_path}", "checkpoint.resume=auto"], the_job, exclusion, slots=2)
    (*_, excluded) = read_events(tmp_path)
    assert isinstance(excluded, NodeExcluded)
    assert (excluded.step, excluded.host, excluded.ranks, excluded.reason) == (
        12,
        "b",
        [2, 3],
        "srun: task 1: Killed",
    )

    record(["--config", "tiny", f"run.dir={tmp_path / 'none'}"], the_job, exclusion, slots=2)  # not yet made
    assert (
        capsys.readouterr().err
        == f"slurm.sbatch: the exclusion is not recorded: {tmp_path / 'none'} does not exist (yet)\n"
    )
