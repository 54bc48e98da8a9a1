"""`python -m pretrain.cli.slurm_exclude`: what launch/slurm.sbatch asks after a failed step. Which
of the job's nodes failed (srun's own lines, and the states Slurm gives the job's nodes), and can
the requeued job run without them?

    python -m pretrain.cli.slurm_exclude --job ID --srun-log FILE --slots N -- LAUNCH_ARGS...

LAUNCH_ARGS are the script's own arguments (`--config CFG KEY=VALUE ...`), read as `pretrain
launch` reads them, for the run directory. One line on stdout for the script:

- `requeue`: no node found at fault; requeue with the same node list, as before this existed;
- `requeue NODES`: requeue, then `scontrol update JobId=ID ExcNodeList=NODES` (the nodes found,
  after those already excluded). Each node found is one line on stderr and a `node_excluded` event
  in RUN_DIR/events.jsonl;
- `stop`: the job's partition has too few nodes left without them. One line on stderr; the job is
  not requeued.

Slurm refuses a running job's ExcNodeList ("Job is no longer pending execution"), so the script
updates it just after `scontrol requeue`. The job is pending by then, and it cannot start again
before cred_expire + 1 s (121 s by default).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from monitoring.protocol import NodeExcluded, append_event, read_events
from pretrain.cli import parse
from pretrain.config import load_config
from pretrain.errors import CommandParser, UserError, run_main

PROG = "slurm.sbatch"  # the lines are the script's
# srun's own lines (Slurm 22.05, launch/slurm): a task's end, a node lost, a launch that failed.
TASK_END = re.compile(r"^srun: error: (?P<node>[^\s:]+): (?P<tasks>tasks? [^:]+): (?P<why>.+)$")
NODE_FAILURE = re.compile(r"^srun: error: Node failure on (?P<nodes>\S+)")
LAUNCH_FAILED = re.compile(
    r"^srun: error: Task launch for \S+ failed on node (?P<node>[^\s:]+): (?P<why>.+)$"
)
EXIT_CODE = re.compile(r"^Exited with exit code \d+$")
UNHEALTHY = ("down", "drain", "fail")  # in sinfo's %T (extended state); a trailing * is "not responding"


def srun_failures(lines: Iterable[str], nodes: Sequence[str]) -> dict[str, str]:
    """The hosts srun's lines blame, each with why (its first such line), the strongest cause only.
    A "Node failure on LIST" (a hostlist expression: expand it) is blamed alone: the step was aborted
    for it, and the other tasks' ends followed. Else the nodes whose task was killed by a signal or
    failed to launch, and the other nodes' exit codes are taken to follow from those. Else the nodes
    whose task exited with a code, unless every node of the job (`nodes`) did: that is the job's own
    failure (its code, config or data), not a node's."""
    lost, signalled, exited = {}, {}, {}
    for line in lines:
        if found := NODE_FAILURE.match(line):
            lost.setdefault(found["nodes"], "srun: node failure")
        elif found := LAUNCH_FAILED.match(line):
            signalled.setdefault(found["node"], f"srun: task launch failed: {found['why']}")
        elif found := TASK_END.match(line):
            ends = exited if EXIT_CODE.match(found["why"]) else signalled
            ends.setdefault(found["node"], f"srun: {found['tasks']}: {found['why']}")
    if lost or signalled:
        return lost or signalled
    return {} if nodes and set(nodes) <= set(exited) else exited


def unhealthy(sinfo_lines: Iterable[str]) -> dict[str, str]:
    """Nodes Slurm marks down, drained or failing, or not responding, from `sinfo -h -N -o
    '%N|%T|%E'` lines (node|state|reason; a node in two partitions is two lines), each with why."""
    found = {}
    for line in sinfo_lines:
        node, _, rest = line.partition("|")
        state, _, reason = rest.partition("|")
        if node and (any(word in state for word in UNHEALTHY) or state.endswith("*")):
            why = f"Slurm marks it {state}" + (f": {reason}" if reason.strip() not in ("", "none") else "")
            found.setdefault(node, why)
    return found


@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    """What the decision needs of the job (`scontrol show job`, hostlists expanded)."""

    id: str
    nodes: list[str]  # its nodes, in Slurm's order: node rank K is nodes[K]
    needs: int  # NumNodes: how many nodes a start asks for
    partition: str
    partition_nodes: list[str]
    excluded: list[str]  # its ExcNodeList so far


@dataclass(frozen=True)
class Exclusion:
    """The decision: the job's nodes at fault (node → why), the requeued job's ExcNodeList (those
    already excluded, then these), and how many of the partition's nodes that leaves."""

    failed: dict[str, str]
    excluded: list[str]
    left: int

    def requeue(self, job: SlurmJob) -> bool:
        """With no node at fault, always (as before); else while the partition has enough left."""
        return not self.failed or self.left >= job.needs


def decide(job: SlurmJob, blamed: dict[str, str]) -> Exclusion:
    """Leave out the job's nodes `blamed` (by srun or Slurm: node → why), with the ones already out."""
    failed = {node: why for node, why in blamed.items() if node in job.nodes and node not in job.excluded}
    excluded = [*job.excluded, *failed]
    return Exclusion(failed, excluded, left=len([n for n in job.partition_nodes if n not in excluded]))


def ranks_of(node: str, nodes: Sequence[str], slots: int) -> list[int]:
    """The ranks a node held: DeepSpeed numbers them in the hostfile's order, `slots` per node."""
    first = nodes.index(node) * slots
    return list(range(first, first + slots))


def lines_for(job: SlurmJob, exclusion: Exclusion, slots: int) -> list[str]:
    """What the script says: one line per node left out, or why the job is not requeued."""
    if not exclusion.requeue(job):
        failed = ", ".join(f"{node} ({why})" for node, why in exclusion.failed.items())
        return [
            f"{PROG}: not requeueing job {job.id}: it needs {job.needs} node(s), and partition "
            f"{job.partition} has {exclusion.left} left without {', '.join(exclusion.excluded)}; "
            f"failed: {failed}. Bring the node(s) back into service, or submit again elsewhere"
        ]
    return [
        f"{PROG}: leaving {node} (node {job.nodes.index(node)}, ranks {_span(ranks_of(node, job.nodes, slots))}) "
        f"out of the requeued job: {why} (ExcNodeList={','.join(exclusion.excluded)})"
        for node, why in exclusion.failed.items()
    ]


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


# -- the shell: Slurm's commands, the run directory --


def _slurm(*args: str) -> str:
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"{' '.join(args)}: {exc}") from None
    if result.returncode != 0:
        raise UserError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def _hostnames(hostlist: str) -> list[str]:
    """A Slurm hostlist expression ("node[1-3],gpu7") as names; "(null)" or "" is none."""
    if hostlist in ("", "(null)"):
        return []
    if not any(c in hostlist for c in "[,"):
        return [hostlist]
    return _slurm("scontrol", "show", "hostnames", hostlist).split()


def slurm_job(job_id: str) -> SlurmJob:
    fields = dict(re.findall(r"(\w+)=(\S*)", _slurm("scontrol", "show", "job", "-o", job_id)))
    partition = fields.get("Partition", "")
    return SlurmJob(
        id=job_id,
        nodes=_hostnames(fields.get("NodeList", "")),
        needs=int(fields.get("NumNodes", "1").split("-")[0]),
        partition=partition,
        partition_nodes=list(dict.fromkeys(_slurm("sinfo", "-h", "-N", "-p", partition, "-o", "%N").split())),
        excluded=_hostnames(fields.get("ExcNodeList", "")),
    )


def blamed(job: SlurmJob, srun_log: Path) -> dict[str, str]:
    """The nodes srun's lines blame (hostlists expanded), then those Slurm marks unhealthy."""
    lines = srun_log.read_text(errors="replace").splitlines() if srun_log.is_file() else []
    found = {node: why for expr, why in srun_failures(lines, job.nodes).items() for node in _hostnames(expr)}
    if job.nodes:
        states = _slurm("sinfo", "-h", "-N", "-n", ",".join(job.nodes), "-o", "%N|%T|%E")
        found |= {node: why for node, why in unhealthy(states.splitlines()).items() if node not in found}
    return found


def record(launch_args: list[str], job: SlurmJob, exclusion: Exclusion, slots: int) -> None:
    """A `node_excluded` event per node left out, in the run directory of the script's arguments
    (`step`: the last one the run's events name). Not recorded is one line: the exclusion stands."""
    launch = parse(["launch", *launch_args])
    try:
        run_dir = Path(load_config(launch.config, launch.overrides).run.dir)
    except UserError as exc:
        print(f"{PROG}: the exclusion is not recorded: {exc}", file=sys.stderr)
        return
    if not run_dir.is_dir():
        print(f"{PROG}: the exclusion is not recorded: {run_dir} does not exist (yet)", file=sys.stderr)
        return
    step = next((e.step for e in reversed(read_events(run_dir)) if e.step is not None), None)
    for node, why in exclusion.failed.items():
        event = NodeExcluded(step=step, host=node, ranks=ranks_of(node, job.nodes, slots), reason=why)
        append_event(run_dir, event)


def exclude(job_id: str, srun_log: Path, slots: int, launch_args: list[str]) -> str:
    """The verdict line for the script (see the module's docstring), after its lines and events."""
    job = slurm_job(job_id)
    exclusion = decide(job, blamed(job, srun_log))
    for line in lines_for(job, exclusion, slots):
        print(line, file=sys.stderr)
    if not exclusion.requeue(job):
        return "stop"
    if not exclusion.failed:
        return "requeue"
    record(launch_args, job, exclusion, slots)
    return f"requeue {','.join(exclusion.excluded)}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = CommandParser(prog="python -m pretrain.cli.slurm_exclude")
    parser.add_argument("--job", required=True, help="the Slurm job id ($SLURM_JOB_ID)")
    parser.add_argument("--srun-log", type=Path, required=True, help="srun's own lines of the failed step")
    parser.add_argument("--slots", type=int, required=True, help="processes per node")
    args = parser.parse_args(argv[:split])

    def handler() -> int:
        print(exclude(args.job, args.srun_log, args.slots, argv[split + 1 :]))
        return 0

    return run_main(handler, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
