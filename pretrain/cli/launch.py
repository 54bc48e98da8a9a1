"""`pretrain launch`: check the run as its job would, then run the DeepSpeed launcher under the
supervisor and the monitoring service (`monitoring/supervisor.py`).

    pretrain launch --config CFG [--nproc N] [--hostfile H [--nodes N] [--min-nodes M]]
                    [--no-ssh --node-rank K] [--fresh] [overrides...]

Over ssh, the supervisor owns the host set (`monitoring/hosts.py`): it checks the hostfile's hosts
before each start, trains on `--nodes` of them, keeps the rest as spares, and after a node is lost
starts again on healthy ones (fewer, down to `--min-nodes`, when no spare is left).

Node 0's launch holds the run directory's lock (`pretrain/run_dir.py`) for the job's life; the
job's launcher inherits it, so it is released only when the last process of the job is gone.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from monitoring.hosts import HostSet
from monitoring.supervisor import JobStart, Supervisor, run_completed
from pretrain import atomic
from pretrain.config import load_config
from pretrain.errors import ExitCode, UserError
from pretrain.lifeline import owner_tag
from pretrain.parallel.distributed import free_port
from pretrain.planning.memory import GIB, refusal, run_plan
from pretrain.pretraining import preflight
from pretrain.reporting.console import deepspeed_log_level, pin_accelerator
from pretrain.run_dir import OWNER_ENV, RunLock, claim


def launcher_command(
    module_args: list[str],
    *,
    nproc: int | None,
    hostfile: str | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    no_ssh: bool = False,
    node_rank: int = 0,
    force_multi: bool = False,
) -> list[str]:
    """The DeepSpeed launcher running `python -m pretrain.train MODULE_ARGS` on this node or a
    hostfile's (`force_multi`: over ssh even when the hostfile names one host)."""
    command = [sys.executable, "-m", "pretrain.cli.deepspeed_runner", "--log_level", deepspeed_log_level()]
    if hostfile:
        command += ["--hostfile", hostfile] + (["--force_multi"] if force_multi else [])
        if master_addr:
            command += ["--master_addr", master_addr]
    if no_ssh:
        command += ["--no_ssh", "--node_rank", str(node_rank)]
    if nproc is not None:
        command += ["--num_gpus", str(nproc)]
    port = master_port or (29500 if hostfile else free_port())
    return [*command, "--master_port", str(port), "--module", "pretrain.train", *module_args]


FORWARDED_OVER_SSH = ("PRETRAIN_", "DS_ACCELERATOR")  # what ranks on other hosts need from here
DEEPSPEED_ENV_FILE = "monitor/deepspeed_env"


def deepspeed_env_file(run_dir: Path, variables: dict[str, str]) -> Path:
    """The file DeepSpeed's launcher exports to every host over ssh (named in DS_ENV_FILE): the
    user's own `.deepspeed_env` files first (home, then here, as DeepSpeed reads them: naming ours
    replaces them), then `variables` and this environment's PRETRAIN_* and DS_ACCELERATOR."""
    lines = []
    for folder in (Path.home(), Path.cwd()):
        with contextlib.suppress(OSError):
            lines += [line for line in (folder / ".deepspeed_env").read_text().splitlines() if "=" in line]
    forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_OVER_SSH)} | variables
    lines += [f"{key}={value}" for key, value in forwarded.items() if "\n" not in value]
    path = run_dir / DEEPSPEED_ENV_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, "\n".join(lines) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}: free space or fix permissions") from None
    return path.absolute()


REQUEUE_ENV = "PRETRAIN_SLURM_REQUEUES"  # set by launch/slurm.sbatch: its job requeues itself


def resume_hint(no_ssh: bool) -> Callable[[int | None], str]:
    """How to go on after this job stops early (by a signal, or by itself): the command that
    started it (without --fresh) or, under Slurm, the requeue — which launch/slurm.sbatch makes
    itself after the time-limit warning (SIGUSR1)."""
    job = os.environ.get("SLURM_JOB_ID")
    words = [w for w in sys.argv[1:] if w not in ("--fresh", "checkpoint.resume=fresh")]
    command = shlex.join(["pretrain", *words]) + (
        " (and on every other node, its own command)" if no_ssh else ""
    )

    def hint(signum: int | None) -> str:
        if job and os.environ.get(REQUEUE_ENV) == "1":
            if signum == signal.SIGUSR1:
                return f"Slurm job {job} requeues itself and resumes from it"
            if signum is None:  # a node or its supervisor went away: the step fails, and the script requeues
                return f"Slurm job {job} requeues itself when a node failed (else: scontrol requeue {job})"
        return f"scontrol requeue {job}" if job else command

    return hint


def local_process_count() -> int:
    """Every local GPU, or 2 CPU processes when there is none."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


NOMINAL_GPU_GIB = 80.0  # the plan's bytes do not depend on it; only whether they fit does


def local_gpu_memory_gib() -> float | None:
    """The smallest local GPU's memory in GiB; None without GPUs (then the memory plan is not checked)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return (
        min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())) / GIB
    )


def check_memory_plan(cfg, ds: dict, world_size: int, gpu_memory_gib: float | None) -> float:
    """The memory plan (`pretrain plan`, pretrain/planning/memory.py) against the GPUs' memory where it is
    known: a plan that cannot fit is refused in one line, with its figures and what would fit.
    The plan's bytes per GPU, for the hosts' own check over ssh (`monitoring/hosts.py`)."""
    report = run_plan(cfg, ds, world_size, gpu_memory_gib or NOMINAL_GPU_GIB)
    line = refusal(report) if gpu_memory_gib is not None else None
    if line is not None:
        raise UserError(line)
    return report["plan"]["bytes"]["total"]


def plan_memory(cfg, ds: dict, world_size: int, spares: HostSet | None) -> None:
    """The memory plan before a start: against this machine's GPUs when the job's are these (each
    node's own launch with --no-ssh too); over ssh, each host's check compares its own (`spares`)."""
    needed = check_memory_plan(cfg, ds, world_size, None if spares is not None else local_gpu_memory_gib())
    if spares is not None:
        spares.gpu_memory_needed = needed


def read_hostfile(path: str) -> dict[str, int]:
    """host → slots, through DeepSpeed's own parser; one clear error for a bad file."""
    if not Path(path).is_file():
        raise UserError(f"--hostfile {path} does not exist: pass a file of 'HOST slots=N' lines")
    from deepspeed.launcher.runner import fetch_hostfile

    try:
        hosts = fetch_hostfile(path)
    except ValueError as exc:
        raise UserError(f"--hostfile {path}: {exc}") from None
    if not hosts:
        raise UserError(f"--hostfile {path} lists no hosts: add 'HOST slots=N' lines")
    empty = [host for host, slots in hosts.items() if slots < 1]
    if empty:
        raise UserError(
            f"--hostfile {path} gives {', '.join(empty)} no slots: every host needs slots=N with N >= 1 "
            f"(its GPUs, or processes on a CPU node)"
        )
    return dict(hosts)


def what_next(cfg, run_dir: Path) -> str:
    """After a complete run: where to look next."""
    lines = [f"tensorboard --logdir {run_dir / 'tensorboard'}"] if cfg.logging.tensorboard else []
    lines += [
        f'pretrain generate --checkpoint {run_dir} --prompt "..."',
        f"pretrain export-hf --checkpoint {run_dir} --out {run_dir / 'hf'}",
    ]
    return "next: " + "\n      ".join(lines)


ATTEMPT_HOSTFILE = "monitor/hostfile"  # over ssh: the hosts of the current start, written before it


def host_set(
    hosts: dict[str, int] | None, nodes: int | None, min_nodes: int | None, no_ssh: bool, cfg
) -> HostSet | None:
    """The supervisor's host set for a launch over ssh (more than one host, or --nodes); None for
    a launch on this machine or in the no-ssh mode. One clear error for counts that cannot be."""
    if (nodes is not None or min_nodes is not None) and (hosts is None or no_ssh):
        raise UserError(
            "--nodes and --min-nodes need --hostfile over ssh (not --no-ssh): they choose among its hosts"
        )
    if hosts is None or no_ssh or (len(hosts) == 1 and nodes is None):
        return None
    nodes = len(hosts) if nodes is None else nodes
    if not 1 <= nodes <= len(hosts):
        raise UserError(f"--nodes {nodes}: the hostfile lists {len(hosts)} host(s); pass 1 to {len(hosts)}")
    min_nodes = nodes if min_nodes is None else min_nodes
    if not 1 <= min_nodes <= nodes:
        raise UserError(f"--min-nodes {min_nodes} must be from 1 to --nodes ({nodes})")
    return HostSet(
        slots=dict(hosts),
        nodes=nodes,
        min_nodes=min_nodes,
        micro_batch=cfg.train.micro_batch_size,
        grad_accum=cfg.train.grad_accum,
    )


def write_attempt_hostfile(run_dir: Path, slots: dict[str, int]) -> str:
    """RUN_DIR/monitor/hostfile: the hosts a start runs on, for DeepSpeed's launcher."""
    path = run_dir / ATTEMPT_HOSTFILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, "".join(f"{host} slots={n}\n" for host, n in slots.items()))
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}: free space or fix permissions") from None
    return str(path.absolute())


def check_arguments(nproc: int | None, hostfile: str | None, no_ssh: bool, node_rank: int) -> None:
    """The launch's own flags, each refusal one line."""
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc {nproc} must be at least 1")
    if no_ssh and not hostfile:
        raise UserError("--no-ssh needs --hostfile (the launcher reads the node list from it)")
    if node_rank < 0 or (node_rank > 0 and not no_ssh):
        raise UserError(f"--node-rank {node_rank}: only with --no-ssh, from 0 to the number of hosts - 1")


def launch(
    config_path: str,
    overrides: list[str],
    *,
    nproc: int | None = None,
    hostfile: str | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    no_ssh: bool = False,
    node_rank: int = 0,
    nodes: int | None = None,
    min_nodes: int | None = None,
    log=None,
    next_steps: bool = True,
) -> int:
    """Check the run as its job would, then supervise it under the service; the job's exit status.
    `next_steps`: after a complete run, where to look next (the demo prints its own)."""
    log = log or (lambda line: print(line, flush=True))
    check_arguments(nproc, hostfile, no_ssh, node_rank)
    cfg = load_config(config_path, [*overrides, "monitor.enabled=true"])  # as the job runs it
    shape = job_shape(cfg, hostfile, nproc, node_rank, nodes, min_nodes, no_ssh)
    checked = preflight(cfg, shape.world_size)
    plan_memory(cfg, checked.ds_config, shape.world_size, shape.spares)
    pin_accelerator()  # the job's processes skip DeepSpeed's accelerator probe (and its note)
    run_dir = Path(cfg.run.dir)
    command = JobCommand(
        module_args=module_args(config_path, overrides, cfg),
        shape=shape,
        grad_accum=cfg.train.grad_accum,
        run_dir=run_dir,
        hostfile=hostfile,
        master_addr=master_addr or (next(iter(shape.hosts)) if shape.hosts else None),
        master_port=master_port,
        no_ssh=no_ssh,
        node_rank=node_rank,
    )
    # Node 0 owns the run directory; its job's ranks, wherever they run, recognise the owner tag.
    owner = owner_tag()
    lock = RunLock(run_dir).acquire(owner=owner) if node_rank == 0 else None
    try:
        if lock is not None:  # the job's rank 0 sees the same run and changes nothing more
            claim(run_dir, checked.identity, asdict(cfg), cfg.checkpoint.resume, log=log)
        supervisor = supervisor_of(command, cfg, lock, owner, log)
        log(f"launch: {shape.world_size} process(es) on {shape.where(hostfile)}; run directory {run_dir}")
        code = supervisor.run()
        if code == ExitCode.DONE and node_rank == 0 and next_steps and run_completed(run_dir):
            log(what_next(cfg, run_dir))
        return code
    finally:
        if lock is not None:
            lock.release()


@dataclass(frozen=True)
class JobShape:
    """Where the job runs: the hostfile's hosts with their processes (None: this machine), the
    host set over ssh (None: this machine, one host, or --no-ssh), and the processes per node."""

    hosts: dict[str, int] | None
    spares: HostSet | None
    per_node: int | None

    @property
    def used(self) -> list[str]:
        """The hosts of the first start."""
        return list(self.hosts)[: self.spares.nodes] if self.spares is not None else list(self.hosts or [])

    @property
    def world_size(self) -> int:
        return sum(self.hosts[h] for h in self.used) if self.hosts else self.per_node

    def where(self, hostfile: str | None) -> str:
        """In words: this machine, or N node(s) from the hostfile (and its spares)."""
        if not self.hosts:
            return "this machine"
        said = f"{len(self.used)} node(s) from {hostfile}"
        if self.spares is not None and len(self.hosts) > self.spares.nodes:
            spare = len(self.hosts) - self.spares.nodes
            said += f" ({spare} spare(s); at least {self.spares.min_nodes} node(s))"
        return said


def job_shape(
    cfg,
    hostfile: str | None,
    nproc: int | None,
    node_rank: int,
    nodes: int | None,
    min_nodes: int | None,
    no_ssh: bool,
) -> JobShape:
    """The hostfile's hosts (--nproc: that many processes on every host) and the host set over ssh;
    one clear error for counts that cannot be."""
    hosts = read_hostfile(hostfile) if hostfile else None
    if hosts is not None and node_rank >= len(hosts):
        raise UserError(f"--node-rank {node_rank} but {hostfile} lists {len(hosts)} host(s)")
    if hosts is not None and nproc is not None:
        hosts = dict.fromkeys(hosts, nproc)  # (--num_gpus: that many processes on every host)
    per_node = nproc if nproc is not None or hosts else local_process_count()
    return JobShape(hosts, host_set(hosts, nodes, min_nodes, no_ssh, cfg), per_node)


def module_args(config_path: str, overrides: list[str], cfg) -> list[str]:
    """`python -m pretrain.train`'s arguments: the launch's own, monitored."""
    args = ["--config", str(config_path), *overrides, "monitor.enabled=true"]
    if cfg.checkpoint.resume == "fresh":
        args.append("checkpoint.resume=auto")  # started over by the launch: not again at each restart
    return args


def supervisor_of(command: JobCommand, cfg, lock: RunLock | None, owner: str, log) -> Supervisor:
    """The job's supervisor: node 0's holds the service and the run directory's lock; over ssh,
    the ranks on every host learn who supervises them (DS_ENV_FILE)."""
    over_ssh = command.shape.spares is not None  # DeepSpeed's launcher then uses pdsh
    command.run_dir.mkdir(parents=True, exist_ok=True)
    job_env = (
        {"DS_ENV_FILE": str(deepspeed_env_file(command.run_dir, {OWNER_ENV: owner}))} if over_ssh else {}
    )
    return Supervisor(
        command,
        command.run_dir,
        cfg.monitor,
        leader=command.node_rank == 0,
        base_seed=cfg.run.seed,
        log=log,
        lock=lock,
        hosts=command.shape.spares,
        job_env=job_env,
        resume=resume_hint(command.no_ssh),
    )


@dataclass(frozen=True, kw_only=True)
class JobCommand:
    """The DeepSpeed launcher's command for each start of the job (the supervisor's
    `make_command`): from the second start on, resuming from the newest checkpoint; over ssh, on
    that start's hosts (RUN_DIR/monitor/hostfile), with the gradient accumulation they need."""

    module_args: list[str]
    shape: JobShape
    grad_accum: int  # train.grad_accum at --nodes nodes
    run_dir: Path
    hostfile: str | None
    master_addr: str | None
    master_port: int | None
    no_ssh: bool
    node_rank: int

    def __call__(self, start: JobStart) -> list[str]:
        args = [*self.module_args] + (["checkpoint.resume=auto"] if start.attempt else [])
        choice = start.hosts
        if choice is None:
            return launcher_command(
                args,
                nproc=self.shape.per_node,
                hostfile=self.hostfile,
                master_addr=self.master_addr,
                master_port=self.master_port,
                no_ssh=self.no_ssh,
                node_rank=self.node_rank,
            )
        if choice.grad_accum != self.grad_accum:
            args.append(f"train.grad_accum={choice.grad_accum}")
        return launcher_command(
            args,
            nproc=self.shape.per_node,
            hostfile=write_attempt_hostfile(self.run_dir, {h: self.shape.hosts[h] for h in choice.hosts}),
            master_addr=self.master_addr if self.master_addr in choice.hosts else choice.hosts[0],
            master_port=self.master_port,
            force_multi=True,
        )
