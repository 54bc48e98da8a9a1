"""This machine as two ssh hosts, `localhost` and its hostname, served by a real sshd on 127.0.0.1.

For multi-node launches (DeepSpeed's runner over pdsh) without a second machine: the fixture starts
`sshd -D` with its own config, host key and authorized key in a temporary directory, and puts first
on PATH a directory whose `ssh` runs `/usr/bin/ssh -F <its ssh_config>` (the test's key and port, no
host key prompt). pdsh's ssh module and DeepSpeed's runner both run `ssh` from PATH; no ssh config,
key or known_hosts file of the user's (~/.ssh) or of /etc/ssh is read or written.

A remote command runs as `bash -c CMD` (the user's shell, not a login shell) in HOME, after ~/.bashrc
(bash reads it under sshd), with PATH as the test process's `env["PATH"]` (sshd's SetEnv) and `PRETRAIN_SSH_HOSTS`
(the fixture's directory: what teardown and `remote_pids` find it by); no other variable of the
client reaches it: pass them in the command, or to DeepSpeed's ranks through DS_ENV_FILE.

Use: `from tests.integration.ssh_hosts import ssh_hosts  # noqa: F401` in a conftest.py, then
    def test_two_nodes(ssh_hosts, tmp_path):
        hostfile = ssh_hosts.write_hostfile(tmp_path / "hostfile")
        subprocess.run(["deepspeed", "--hostfile", str(hostfile), ...], env=ssh_hosts.env)
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pretrain.parallel.distributed import free_port

SSHD, SSH = "/usr/sbin/sshd", "/usr/bin/ssh"
TAG = "PRETRAIN_SSH_HOSTS"  # set by sshd in each remote command; inherited by what it starts


@dataclass(frozen=True)
class SshHosts:
    env: dict[str, str]  # os.environ with the `ssh` wrapper first on PATH: for ssh, pdsh and deepspeed
    hosts: list[str]  # ["localhost", socket.gethostname()]: both reach this machine
    port: int
    down: str  # a host name whose ssh connection is refused: a node that is down
    root: Path  # keys, configs, the wrapper (bin/ssh) and sshd's log (sshd.log)

    def write_hostfile(self, path: Path, slots: int = 1) -> Path:
        """A DeepSpeed hostfile: each host with `slots` slots."""
        path.write_text("".join(f"{host} slots={slots}\n" for host in self.hosts))
        return path

    @contextlib.contextmanager
    def slow_to_launch(self, host: str, seconds: float) -> Iterator[None]:
        """Within this block, ssh takes `seconds` longer to start a DeepSpeed launcher on `host` (a
        slow connection, a loaded node); other commands over ssh (a stop's pkill) are not slowed."""
        wrapper = self.root / "bin" / "ssh"
        original = wrapper.read_text()
        wait = f'case " $* " in *" {host} "*" -m deepspeed.launcher.launch "*) sleep {seconds};; esac\n'
        wrapper.write_text(original.replace("exec ", wait + "exec ", 1))
        try:
            yield
        finally:
            wrapper.write_text(original)

    @contextlib.contextmanager
    def refuses_launch(self, host: str) -> Iterator[None]:
        """Within this block, ssh to `host` fails as a refused connection when it would start a
        DeepSpeed launcher there (other commands, a host's check before a start, still reach it):
        a host that goes down between its check and the launch."""
        wrapper = self.root / "bin" / "ssh"
        original = wrapper.read_text()
        refuse = (
            f'case " $* " in *" {host} "*" -m deepspeed.launcher.launch "*) '
            f'echo "ssh: connect to host {host} port 22: Connection refused" >&2; exit 255;; esac\n'
        )
        wrapper.write_text(original.replace("exec ", refuse + "exec ", 1))
        try:
            yield
        finally:
            wrapper.write_text(original)

    @contextlib.contextmanager
    def extra_host(self, name: str) -> Iterator[ExtraHost]:
        """One more host name for this machine, `name`, served by an sshd of its own on another port,
        which `stop()` takes down with everything started through it: a node that dies."""
        port = free_port()
        tag = f"{self.root}/{name}"
        config = self.root / f"sshd_config.{name}"
        config.write_text(_sshd_config(self.root, port, self.env["PATH"], tag, pid_file=f"sshd.{name}.pid"))
        client = self.root / "ssh_config"
        block = _client_block(self.root, name, port)
        client.write_text(block + client.read_text())
        host = ExtraHost(name, _start_sshd(config, self.root / f"sshd.{name}.log", port), tag, self)
        try:
            yield host
        finally:
            host.stop()
            client.write_text(client.read_text().replace(block, ""))

    def remote_pids(self, tag: str | None = None) -> list[int]:
        """The live processes started through this sshd (or the extra host's whose `tag` is given)
        and their descendants, wherever they are in the process tree now (a remote command outlives
        its ssh client, pdsh and sshd's session)."""
        entry, found = f"{TAG}={tag or self.root}".encode(), []
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if proc.name.isdigit() and entry in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
        return found


@dataclass
class ExtraHost:
    name: str
    sshd: subprocess.Popen
    tag: str
    hosts: SshHosts

    def stop(self) -> None:
        """The node dies: its sshd and every process started through it, at once (SIGKILL)."""
        if self.sshd.poll() is None:
            self.sshd.kill()
            self.sshd.wait(timeout=10)
        for _ in range(100):
            if not (pids := self.hosts.remote_pids(self.tag)):
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)


def _sshd_config(root: Path, port: int, path: str, tag: str, pid_file: str = "sshd.pid") -> str:
    return (
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {root / 'host_key'}\nPidFile {root / pid_file}\n"
        f"AuthorizedKeysFile {root / 'authorized_keys'}\nAllowUsers {getpass.getuser()}\n"
        "StrictModes no\nUsePAM no\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitUserEnvironment no\nX11Forwarding no\nPrintMotd no\n"
        f'PrintLastLog no\nMaxStartups 100\nSetEnv "PATH={path}" "{TAG}={tag}"\n'
    )


def _client_block(root: Path, hosts: str, port: int) -> str:
    return (
        f"Host {hosts}\n  HostName 127.0.0.1\n  Port {port}\n  IdentityFile {root / 'id_ed25519'}\n"
        f"  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile {root / 'known_hosts'}\n"
        "  GlobalKnownHostsFile /dev/null\n  CheckHostIP no\n  LogLevel ERROR\n  BatchMode yes\n"
    )


def _start_sshd(config: Path, log: Path, port: int) -> subprocess.Popen:
    with log.open("w") as out:
        sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", config], stdout=out, stderr=out)
    deadline = time.monotonic() + 60  # (a safety net: sshd listens within 0.1 s here)
    while f"listening on 127.0.0.1 port {port}" not in log.read_text():
        if sshd.poll() is not None or time.monotonic() > deadline:
            sshd.kill()
            pytest.fail(f"ssh hosts: sshd did not start: {_last_line(log.read_text())}")
        time.sleep(0.02)
    return sshd


def _last_line(text: str) -> str:
    return (text.strip() or "no output").splitlines()[-1]


def _serve(root: Path) -> Iterator[SshHosts]:
    missing = [tool for tool in (SSHD, SSH, "pdsh", "ssh-keygen") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"ssh hosts: {', '.join(missing)} not installed")
    try:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    except OSError as e:
        pytest.skip(f"ssh hosts: cannot create /run/sshd for sshd: {e}")
    for key in ("host_key", "id_ed25519"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", root / key], check=True
        )
    (root / "authorized_keys").write_text((root / "id_ed25519.pub").read_text())
    (root / "bin").mkdir()
    port = free_port()  # (not one the kernel would give a client socket before sshd binds it)
    closed = socket.socket()  # bound, never listened on, held to the end: connections to it are refused
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    hosts = ["localhost", socket.gethostname()]
    if hosts[1] == hosts[0]:
        pytest.skip("ssh hosts: this machine's hostname is localhost: no second host name")
    remote = SshHosts(
        os.environ | {"PATH": f"{root / 'bin'}:{os.environ.get('PATH', os.defpath)}"},
        hosts,
        port,
        "down",
        root,
    )
    (root / "sshd_config").write_text(_sshd_config(root, port, remote.env["PATH"], str(root)))
    (root / "ssh_config").write_text(
        _client_block(root, " ".join(hosts), port)
        + f"Host {remote.down}\n  HostName 127.0.0.1\n  Port {closed_port}\n  BatchMode yes\n  LogLevel ERROR\n"
    )
    (root / "bin" / "ssh").write_text(f'#!/bin/sh\nexec {SSH} -F "{root / "ssh_config"}" "$@"\n')
    (root / "bin" / "ssh").chmod(0o755)

    sshd = _start_sshd(root / "sshd_config", root / "sshd.log", port)
    try:
        check = subprocess.run(
            ["ssh", hosts[-1], "true"], env=remote.env, capture_output=True, text=True, timeout=30
        )
        if check.returncode != 0:
            pytest.fail(f"ssh hosts: sshd refused the test's key: {_last_line(check.stderr)}")
        yield remote
    finally:
        for _ in range(100):  # the remote commands and what they started (their sessions then end), then sshd
            if not (pids := remote.remote_pids()):
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        sshd.terminate()
        sshd.wait(timeout=60)
        closed.close()


@pytest.fixture(scope="session")
def ssh_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    """This machine as ssh hosts `localhost` and its hostname, for the session (one sshd per xdist
    worker). Skips with one reason line where sshd, ssh, pdsh or ssh-keygen is missing or sshd's
    directory cannot be made (not root); fails when an installed sshd does not start or refuses the
    test's key (the fixture's own setup)."""
    yield from _serve(tmp_path_factory.mktemp("ssh_hosts"))
