"""The process group and what every rank must agree on: who it is, when to stop, determinism.

Launchers (the DeepSpeed launcher, torchrun, accelerate, srun wrappers) describe each process in
environment variables; one plain process is rank 0 of 1. The collectives here work without a
process group when there is one process (they are then the identity), so the pieces of the loop
run, and are unit-tested, in a plain Python process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.parallel.deepspeed_ops import announced_builds, without_shm_all_reduce
from pretrain.reporting.console import without_printed_chatter


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int

    @classmethod
    def from_environ(cls) -> DistEnv:
        """Launchers set these; one plain process gets defaults, and no rendezvous port: a group of
        one meets in memory (`init_distributed`)."""
        if "WORLD_SIZE" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        return cls(
            int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), int(os.environ["WORLD_SIZE"])
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0


PORT_LEASE_SECONDS = 1800.0
# Where free_port leases ports: the same for every process of this user on the machine, whatever
# its TMPDIR (a Slurm job's, or a test's, is its own).
PORT_LEASES = Path("/tmp") / f"pretrain-ports-{os.getuid()}"


def free_port() -> int:
    """A port to listen on (a rendezvous store, an sshd), which no other caller on this machine is
    handed for PORT_LEASE_SECONDS: the job it is for binds it seconds or minutes later, and in
    between the port is free, so a bind test alone gave two jobs started together the same port
    (EADDRINUSE in one). Each port handed out is leased (a file named for it, written under a lock
    in /tmp/pretrain-ports-UID); a leased port, or one something listens on, is never handed
    out. Ports come from below the range the kernel hands to outgoing connections
    (ip_local_port_range), so no client socket (ssh, pdsh, Slurm's daemons, HTTP) takes one before
    its listener binds it, as one did."""
    low = _first_outgoing_port()
    if low > 21_000:  # (a range that leaves no room below it: the kernel's choice)
        with _port_leases() as leases:
            port = _leased_port(leases, low)
            if port is not None:
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_outgoing_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    """Whether nothing holds `port` now (a listener, a connection, one closing: no SO_REUSEADDR)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _port_leases() -> Iterator[Path | None]:
    """The lease directory, locked for this caller (None where it cannot be made: bind tests only)."""
    leases = PORT_LEASES
    try:
        leases.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(leases / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield None
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield leases
    finally:
        os.close(fd)


def _leased_port(leases: Path | None, low: int) -> int | None:
    """(Under the leases' lock.) A random port in [20000, low) neither leased nor bound, leased now."""
    pick = random.SystemRandom()  # not the training's seeded generator: every process would pick alike
    now = time.time()
    for _ in range(100):
        port = pick.randrange(20_000, low)
        lease = leases / str(port) if leases is not None else None
        with contextlib.suppress(OSError):
            if lease is not None and now - lease.stat().st_mtime < PORT_LEASE_SECONDS:
                continue
        if not _bindable(port):
            continue
        if lease is not None:
            with contextlib.suppress(OSError):
                lease.touch()
                os.utime(lease, (now, now))
        return port
    return None


def cpu_threads_per_rank() -> int | None:
    """On CPU, this machine's cores shared among the ranks it runs (LOCAL_SIZE from DeepSpeed's
    launcher, LOCAL_WORLD_SIZE from torchrun): torch would give every rank every core, and N ranks
    of N threads each oversubscribe the machine (measured: the 2-process golden run takes 18 s with
    2 threads per rank on 2 cores, 15 s with 1, bit for bit the same numbers). None when
    OMP_NUM_THREADS is set: the user's or the launcher's choice stands."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    return max(1, usable_cores() // max(local, 1))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def init_distributed(env: DistEnv) -> None:
    """The process group (NCCL on GPUs, gloo on CPU), for training and fine-tuning alike. A group
    of one process meets in memory: no port is bound, so none can be taken by another job first
    (a plain process's rendezvous port, chosen free, once was: EADDRINUSE).

    On CPU, DeepSpeed's shared-memory all-reduce, which training never uses, is neither built nor
    loaded (`pretrain.parallel.deepspeed_ops`). Where DeepSpeed builds it anyway (another layout), it makes
    a 66 MB /dev/shm/deepspeed_allreduce_buffer_* per rank and never unlinks it, so every job would
    leave them behind until the machine runs out of memory: once every rank has mapped its peers'
    buffers (they do so while the group starts; the barrier waits for all), each rank unlinks its
    own name: the mappings stay valid, and the memory goes when the processes exit."""
    import deepspeed

    on_gpu = torch.cuda.is_available()
    threads = None if on_gpu else cpu_threads_per_rank()
    if threads is not None:
        torch.set_num_threads(threads)
    # (DeepSpeed print()s a note as it opens the group on CPU)
    with (
        without_printed_chatter(),
        announced_builds(say_once_per_node(env)),
        without_shm_all_reduce() as skipped,
    ):
        backend = "nccl" if on_gpu else "gloo"
        if env.world_size == 1 and not dist.is_initialized():  # (DeepSpeed adopts a group it finds)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        deepspeed.init_distributed(dist_backend=backend)
    if on_gpu:
        torch.cuda.set_device(env.local_rank)
        return
    if skipped:
        return
    dist.barrier()
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}_{env.rank}"
    Path("/dev/shm", name).unlink(missing_ok=True)


def say_once_per_node(env: DistEnv) -> Callable[[str], None]:
    """A console line from the first rank of each node (what each node does once, such as building
    a compiled op); the other ranks say nothing."""

    def say(line: str) -> None:
        if env.local_rank == 0:
            print(f"pretrain: {line}", file=sys.stderr, flush=True)

    return say


def _group_or_single() -> bool:
    """True when a process group exists; False for one process without one; else an error."""
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("a collective was called before the process group started")
    return False


def barrier() -> None:
    if _group_or_single():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks, in place; returns it."""
    if _group_or_single():
        _on_the_groups_device(tensor, dist.all_reduce)
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    if _group_or_single():
        _on_the_groups_device(tensor, lambda t: dist.broadcast(t, src=src))
    return tensor


def _on_the_groups_device(tensor: torch.Tensor, collective) -> None:
    """Run `collective` on `tensor` in place. An NCCL group takes CUDA tensors only, so a host
    tensor (a flag, a count) goes to this rank's GPU for it and its result comes back; gloo
    takes it as it is."""
    if tensor.device.type == "cpu" and dist.get_backend() == "nccl":
        on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        collective(on_device)
        tensor.copy_(on_device)
    else:
        collective(tensor)


def broadcast_int(value: int, env: DistEnv) -> int:
    """Rank 0's `value` on every rank."""
    device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    return int(broadcast(torch.tensor([value], dtype=torch.int64, device=device)).item())


def broadcast_json(payload: dict | None, device) -> dict | None:
    """Rank 0's JSON object (or None) on every rank: its length, then its bytes (the other ranks
    pass None)."""
    data = json.dumps(payload).encode() if payload is not None else b""
    size = int(broadcast(torch.tensor([len(data)], dtype=torch.int64, device=device)).item())
    if size == 0:
        return None
    buffer = (
        torch.tensor(list(data), dtype=torch.uint8, device=device)
        if data
        else torch.empty(size, dtype=torch.uint8, device=device)
    )
    return json.loads(bytes(broadcast(buffer).cpu().tolist()))


def all_gather_objects(obj) -> list:
    """Every rank's `obj` (small and picklable), in rank order, on every rank."""
    if not _group_or_single():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


# SIGUSR1: a scheduler's warning before its time limit (launch/slurm.sbatch; Slurm delivers it to
# every process of the job step, and the launchers between the supervisor and the ranks ignore it).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


# What the collective libraries say when another rank of the job is gone (killed, crashed, exited):
# gloo's transport, NCCL's remote errors and aborted communicators, torch's store timeouts.
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote worker",
    "ncclRemoteError",
    "NCCL communicator was aborted",
    "collective operation timeout",
    "Socket Timeout",
    "connection refused",
)


def lost_peer(exc: BaseException) -> str | None:
    """The library's own words, in one short line, when `exc` (or what caused it) is a collective
    that failed because another rank left the job; else None."""
    while exc is not None:
        text = str(exc)
        if isinstance(exc, (RuntimeError, dist.DistError)) and any(
            m.lower() in text.lower() for m in _PEER_GONE
        ):
            first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
            first = (
                first.split("] ", 1)[1] if first.startswith("[") and "] " in first else first
            )  # (a source path)
            return first.split(". This is typically", 1)[0].strip()
        exc = exc.__cause__ or exc.__context__
    return None


class StopRequest:
    """SIGTERM/SIGINT/SIGUSR1 set a flag that the ranks agree on at the next step boundary; a second
    SIGINT interrupts at once. Use as a context manager: the previous handlers come back.
    `why`: the signal, and what sent it where that is known (the lifeline names a lost supervisor in
    `STOP_CAUSE` before it signals; `cause()` reads what a supervisor said as it asked)."""

    def __init__(self, cause: Callable[[], str | None] = lambda: None) -> None:
        self.requested = False
        self.why = ""
        self.cause = cause  # who sent the signal, where that is written down (a supervisor's request)
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.requested:
            cause = STOP_CAUSE[0] if STOP_CAUSE else self.cause()
            self.why = cause or f"{signal.Signals(signum).name} received"
        self.requested = True

    def requester(self) -> dict | None:
        """Who this rank is and why it asked to stop, for the ranks' record of a stop; None when it
        did not ask."""
        if not self.requested:
            return None
        return {
            "rank": int(os.environ.get("RANK", "0")),
            "node": int(os.environ.get("CROSS_RANK", "0")),
            "host": socket.gethostname(),
            "why": self.why,
        }


def ignore_late_stop_requests() -> None:
    """A rank whose training has ended (saved, about to exit): SIGTERM/SIGUSR1 from now on would
    only turn a clean exit into a killed one — a supervisor's request can cross the rank's own
    stop, as when Slurm's time-limit warning reaches every process of the step. (SIGINT still
    interrupts; the supervisor's SIGKILL still ends a rank that hangs on its way out.)"""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


STOP_CAUSE: list[str] = []  # set once, by whatever signals this process to stop for a known reason


def configure_determinism(deterministic: bool) -> None:
    """`run.deterministic`: deterministic kernels and settings, for bitwise resume.

    Deterministic mode also fills every `torch.empty` with NaN by default, a debugging aid that
    determinism does not need: DeepSpeed's ZeRO-2 allocates two gradient buckets of
    `reduce_bucket_size` (5e8 elements) every micro-step, and filling them made deterministic
    steps several times slower. Nothing here reads memory it has not written (the golden run's
    numbers are the same either way)."""
    if not deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
