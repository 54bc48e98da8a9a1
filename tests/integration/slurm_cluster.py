"""A real one-machine Slurm cluster for integration tests: the `slurm` fixture.

Everything lives in a private directory under /tmp (short, because munge's and slurmd's unix sockets
must fit in 108 bytes): slurm.conf, gres.conf, the state and spool directories, the daemons' logs and a
private munged with its own key and socket (`AuthInfo=socket=...`), so the machine's own Slurm and munge
configuration, if any, are neither read nor touched. slurmctld and slurmd run in the foreground as
children of the test process on free ports and are stopped, with every job cancelled, at teardown.

The node, `node0` (NodeHostname is this machine's name, which slurmctld requires of SlurmctldHost), has
`CPUS` CPUs whatever the hardware has (SlurmdParameters=config_overrides) and `GPUS` GPUs as GRES,
backed by links to /dev/null: Slurm drops the device index of a plain file and then sets no
CUDA_VISIBLE_DEVICES. A job with `--gpus-per-node=2` sees SLURM_GPUS_ON_NODE=2, SLURM_GPUS_PER_NODE=2,
SLURM_JOB_GPUS=0,1, CUDA_VISIBLE_DEVICES=0,1 and GPU_DEVICE_ORDINAL=0,1 (its srun steps also
SLURM_STEP_GPUS=0,1). Processes are tracked by proctrack/linuxproc (no cgroup, no systemd needed).
A second node, `node1` (`ABSENT`), is declared DOWN and never started; it is in partition `pair`
(`PAIR`) with node0, while the default partition, debug, is node0 alone. A job in `pair` runs on node0;
excluded from node0 (`ExcNodeList=node0`) it stays PENDING (Reason=ReqNodeNotAvail,...node1), and
runs again once the exclusion is cleared (`scontrol update JobId=N ExcNodeList=`). Slurm refuses a
running job's ExcNodeList ("Job is no longer pending execution"); a requeued one, COMPLETING or
PENDING, takes it.

Timing, Slurm 22.05: slurmctld tests time limits every 30 to 31 s (PERIODIC_TIMEOUT, fixed at build
time; `TIME_LIMIT_CHECK_S`), the first 30 s after its start (`started_at`). `--signal=B:SIG@N` goes out
at the first test that finds at most N + 30 s left, so between N + 30 and N s before the end: with
`--time=1 --signal=B:TERM@45` at the first test after the start, 0 to 31 s in. A job past its time limit
gets SIGTERM at the next test (60 to 91 s in for --time=1), SIGKILL KillWait (2 s) later, and ends
TIMEOUT. Any SIGTERM sent to the batch script also writes "*** JOB n ON node0 CANCELLED AT <time> ***"
(slurmstepd's, whatever the job does next) to the job's output.
`scancel --batch --signal=SIG JOB` signals the batch script at once (0.2 s). A job requeued
(`scontrol requeue JOB`, also from inside itself) keeps its id, goes COMPLETING, then PENDING with
Reason=BeginTime, and runs again 6 s later (Slurm sets its begin time cred_expire + 1 s ahead, and
cred_expire is 5 s here, the least it takes) with SLURM_RESTART_COUNT=1 (the scontrol field: Restarts).
Job records stay for MinJobAge (an hour), so `state` answers for finished jobs. Without slurmdbd,
sacct does not work.

Test modules get the fixture by `from tests.integration.slurm_cluster import slurm  # noqa: F401`
(ruff then flags F811 at each test's `slurm` argument too); imported so in tests/integration/conftest.py
it serves every integration test without either. It skips without Slurm's daemons, munge or root.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

import pytest

from pretrain.parallel.distributed import free_port

NODE = "node0"
ABSENT = "node1"  # declared DOWN, never started
PAIR = "pair"  # the partition of NODE and ABSENT
GPUS = 2
CPUS = 16
TIME_LIMIT_CHECK_S = 30
# States a job does not leave (a requeued job passes through COMPLETING and PENDING, never these).
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
    }
)
_Completed = subprocess.CompletedProcess[str]
_COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")


class SlurmCluster:
    """The running cluster: `env` runs Slurm's commands against it (SLURM_CONF is its slurm.conf;
    jobs inherit it from sbatch, so `scontrol requeue` works inside a job), `node` is its one node."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = NODE
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.ctld_port = free_port()
        self.started_at = 0.0  # time.time() when slurmctld started (its time-limit tests count from it)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- the client side --

    def run(self, args: Sequence[str], cwd: Path | None = None, check: bool = True) -> _Completed:
        """A Slurm command (`["squeue", "-h"]`) against this cluster; raises with its stderr if `check`."""
        result = subprocess.run(list(args), cwd=cwd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def sbatch(self, args: Sequence[str], cwd: Path) -> int:
        """Submits `sbatch args` (options, then the script and its arguments) from `cwd`; the job's id."""
        return int(self.run(["sbatch", "--parsable", *args], cwd=cwd).stdout.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """The job's fields from `scontrol show job` (JobState, Reason, Restarts, ExitCode, BeginTime...);
        values holding spaces are cut at the first."""
        line = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def state(self, job_id: int) -> str:
        """The job's state: PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED, TIMEOUT..."""
        return self.job(job_id)["JobState"]

    def wait(self, job_id: int, timeout: float = 60.0, until: Collection[str] = FINAL_STATES) -> str:
        """Polls the job until its state is one of `until` (by default a final one) and returns that
        state; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (state := self.state(job_id)) not in until:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout} s\n{self.logs()}")
            time.sleep(0.2)
        return state

    @staticmethod
    def log(path: Path) -> str:
        """A job's output file so far ('' before it exists)."""
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, lines: int = 20) -> str:
        """The daemons' last log lines, for assertion messages."""
        files = sorted((self.root / "log").glob("*"))
        return "\n".join(f"== {p.name}\n" + "\n".join(self.log(p).splitlines()[-lines:]) for p in files)

    # -- the daemons --

    def _write_config(self) -> None:
        root, host = self.root, socket.gethostname().split(".")[0]
        for sub in ("state", "spool", "log", "dev", "munge"):
            (root / sub).mkdir()
        for i in range(GPUS):
            (root / "dev" / f"nvidia{i}").symlink_to("/dev/null")
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(f"""\
ClusterName=pytest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=debug
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
GresTypes=gpu
JobRequeue=1
KillWait=2
MinJobAge=3600
ReturnToService=2
SlurmdParameters=config_overrides
NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory=16000 Gres=gpu:{GPUS}
NodeName={ABSENT} NodeAddr=192.0.2.1 CPUs={CPUS} RealMemory=16000 State=DOWN Reason=absent
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
PartitionName={PAIR} Nodes={NODE},{ABSENT} MaxTime=INFINITE State=UP
""")
        (root / "gres.conf").write_text(f"AutoDetect=off\nName=gpu File={root}/dev/nvidia[0-{GPUS - 1}]\n")

    def _spawn(self, name: str, args: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "wb") as out:
            self._procs[name] = subprocess.Popen(args, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def _problem(self) -> str | None:
        """Why the cluster is not up (yet), in one line; None once the node is idle."""
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                lines = self.log(self.root / "log" / f"{name}.out").splitlines()
                fatal, errors = ([x for x in lines if word in x.lower()] for word in ("fatal", "error"))
                last = (fatal or errors or lines or [""])[-1]
                return f"{name} exited with status {proc.returncode}: {last}"
        if not (self.root / "munge" / "socket").exists():
            return "munged made no socket"
        with socket.socket() as s:  # a client retries for seconds before slurmctld listens
            if s.connect_ex(("127.0.0.1", self.ctld_port)) != 0:
                return "slurmctld does not listen"
        result = self.run(["sinfo", "-h", "-n", NODE, "-o", "%T"], check=False)
        node_state = result.stdout.strip()
        return None if node_state == "idle" else result.stderr.strip() or f"node {node_state or 'unknown'}"

    def start(self, timeout: float = 20.0) -> str | None:
        """Starts munged, slurmctld and slurmd and waits for the node to be idle; why not, or None."""
        self._write_config()
        munge = self.root / "munge"
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={munge}/socket",
                f"--key-file={munge}/munge.key",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/seed",
                f"--log-file={munge}/munged.log",
            ],
        )
        deadline = time.monotonic() + timeout
        while self._problem() == "munged made no socket" and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._procs["munged"].poll() is None:
            self.started_at = time.time()
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._spawn("slurmd", ["slurmd", "-D", "-N", NODE, "-f", str(self.conf)])
        while (problem := self._problem()) is not None:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._procs.values()):
                return f"Slurm test cluster did not come up: {self._problem() or problem}"
            time.sleep(0.1)
        return None

    def stop(self) -> None:
        """Cancels every job, stops the daemons and kills whatever still runs with this cluster's
        SLURM_CONF (slurmstepd and job processes that outlived them)."""
        if self._procs.get("slurmctld") and self._procs["slurmctld"].poll() is None:
            deadline = time.monotonic() + 15
            while (jobs := self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()) and (
                time.monotonic() < deadline
            ):
                self.run(["scancel", *jobs], check=False)
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            if (proc := self._procs.get(name)) is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        marker = f"SLURM_CONF={self.conf}\0".encode()
        for pid_dir in Path("/proc").glob("[0-9]*"):
            try:
                if int(pid_dir.name) != os.getpid() and marker in (pid_dir / "environ").read_bytes():
                    os.kill(int(pid_dir.name), signal.SIGKILL)
            except OSError:
                pass  # gone, or not ours to read


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """A fresh cluster per test module (about 1 s to start); skips without Slurm, munge or root,
    fails when they are there and the cluster does not come up (this fixture's own setup)."""
    missing = [name for name in _COMMANDS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"Slurm test cluster: {', '.join(missing)} not installed")
    if os.geteuid() != 0:
        pytest.skip("Slurm test cluster: slurmd must run as root")
    root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    root.chmod(0o755)  # munged wants its socket's directory searchable by all
    cluster = SlurmCluster(root)
    try:
        if (problem := cluster.start()) is not None:
            pytest.fail(problem)  # installed and root, yet not up: this fixture's fault, not the machine's
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
