"""A real S3 API on 127.0.0.1: moto's server (`moto[server]`, its ThreadedMotoServer), once per
test session, which the project reaches through s3fs over HTTP exactly as it reaches AWS.

The fixture `s3_server` gives the endpoint, the environment a process needs to reach it (test
credentials, AWS_ENDPOINT_URL, no instance-metadata lookup, no ~/.aws files) and helpers: a fresh
bucket per test, an s3fs filesystem, credentials it refuses (`denied`: an IAM user with no policy,
moto checking IAM meanwhile), and a `blackhole` endpoint that accepts connections and never
answers (a network that stops answering). Skipped, with the reason, where moto or s3fs is missing.

Use: `from tests.integration.s3_server import s3_server  # noqa: F401` in a conftest.py, then
    def test_x(s3_server, monkeypatch):
        bucket = s3_server.bucket()              # "s3://<new bucket>"
        monkeypatch.setattr(os, "environ", ...)  # or pass s3_server.env to a subprocess
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

# What every process reaching the server needs, and nothing of the user's own AWS setup.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    env: dict[str, str]  # os.environ with the credentials and the endpoint: for subprocesses
    _names: Iterator[int] = field(default_factory=itertools.count)

    def bucket(self) -> str:
        """A new, empty bucket: its URL."""
        name = f"bucket-{os.getpid()}-{next(self._names)}"
        self.fs().mkdir(name)
        return f"s3://{name}"

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(
            key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=self.endpoint,
            skip_instance_cache=True,
        )

    @contextlib.contextmanager
    def environment(self, **changes: str | None) -> Iterator[None]:
        """This process's environment as the server's (`env`), with `changes` (None removes a
        variable), for the duration; s3fs's cached filesystems are dropped on the way in and out."""
        saved = dict(os.environ)
        wanted = {**self.env, **changes}
        os.environ.clear()
        os.environ.update({k: v for k, v in wanted.items() if v is not None})
        _forget_filesystems()
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)
            _forget_filesystems()

    @contextlib.contextmanager
    def denied(self, allow: tuple[str, ...] = ()) -> Iterator[dict[str, str]]:
        """Credentials the server knows and refuses: a new IAM user with no policy (or one that
        allows only the actions `allow`, such as "s3:GetObject"), while the server checks every
        request against IAM (moto's /moto-api/reset-auth; unchecked again after). Gives the
        environment changes that use them, for `environment(**changes)`."""
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )
        name = f"denied-{os.getpid()}-{next(self._names)}"
        iam.create_user(UserName=name)
        if allow:
            statement = {"Effect": "Allow", "Action": list(allow), "Resource": "*"}
            document = json.dumps({"Version": "2012-10-17", "Statement": [statement]})
            iam.put_user_policy(UserName=name, PolicyName="allowed", PolicyDocument=document)
        key = iam.create_access_key(UserName=name)["AccessKey"]
        previous = self._checked("0")
        try:
            yield {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        finally:
            self._checked(previous)

    def _checked(self, after: str) -> str:
        """moto's IAM checks from `after` requests on ("0": all, "inf": none); the previous setting."""
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=after.encode(),
            headers={"Content-Type": "text/plain"},
        )  # (not a form: moto reads the body as it is)
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"]


def _forget_filesystems() -> None:
    """fsspec keeps one filesystem per set of arguments: one made under other credentials or
    another endpoint must not answer for the next."""
    import fsspec.config
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fsspec.config.conf.clear()
    fsspec.config.set_conf_env(fsspec.config.conf)


@contextlib.contextmanager
def blackhole() -> Iterator[str]:
    """An endpoint on 127.0.0.1 that accepts connections and never answers: its URL."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held, stop = [], threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])  # kept open, never read or written

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for connection in held:
            connection.close()
        server.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    try:
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        pytest.skip(f"the S3 tests need moto[server] and s3fs (pip install -e '.[dev]'): {exc}")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    env |= CREDENTIALS | {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    try:
        yield S3Server(endpoint, env)
    finally:
        server.stop()
