"""Objects behind URLs (`s3://`, `gs://`, `az://`, `hf://`, any fsspec URL): the filesystem for a
URL with our timeouts, whole reads, existence, and every failure as one line that says what to do.
The data pipeline's shard cache (`pretrain/data/storage.py`) and the checkpoint mirror
(`pretrain/checkpoint/mirror.py`) both read and write through it."""

from __future__ import annotations

import re
from pathlib import Path

from pretrain.errors import UserError

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# The fsspec filesystems named in docs/data.md, and the package each needs.
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
PACKAGES |= {"hf": "huggingface_hub"}
EXTRA = {"s3fs": "pip install 'pretrain[s3]' (or s3fs)"}
# S3: an answer within these, or the request fails (and is retried, below). FSSPEC_S3's
# config_kwargs (fsspec's own configuration, from the environment) take precedence.
S3_CONFIG = {"connect_timeout": 10, "read_timeout": 30, "retries": {"max_attempts": 2, "mode": "standard"}}
# The S3 permissions `problem` names for an access denied.
ACTIONS = {"read": "s3:GetObject, s3:ListBucket", "write": "s3:PutObject, s3:DeleteObject"}


def is_url(location: str | Path | None) -> bool:
    """Whether `location` is a URL (scheme://...) rather than a local path. `file://` is a URL too
    (fsspec reads it like any other)."""
    return isinstance(location, str) and SCHEME.match(location) is not None


def refuse_url(location: str | Path, what: str) -> None:
    """For the places that take only a local path: a URL is one clear line, never a relative path
    named `s3:` (which is what Path("s3://b/x") would become)."""
    if is_url(location):
        raise UserError(f"{what} {location} is a URL: this takes a local path (docs/data.md, object storage)")


def join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


def filesystem(url: str):
    """(fsspec filesystem, path within it) for `url`; a missing package is one line."""
    scheme = SCHEME.match(url).group(1).lower()
    try:
        import fsspec
        import fsspec.config
    except ImportError:
        raise UserError(f"{url}: reading URLs needs fsspec: {EXTRA['s3fs']}") from None
    options = {}
    if scheme in ("s3", "s3a"):  # our timeouts, under whatever FSSPEC_S3 sets
        configured = fsspec.config.conf.get("s3", {}).get("config_kwargs", {})
        options["config_kwargs"] = S3_CONFIG | configured
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError:
        package = PACKAGES.get(scheme, f"the fsspec filesystem for {scheme}://")
        raise UserError(
            f"{url}: reading {scheme}:// needs {package}: {EXTRA.get(package, f'pip install {package}')}"
        ) from None
    except ValueError as exc:
        raise UserError(f"{url}: {exc}: use s3://, gs://, az://, hf:// or another fsspec URL") from None
    if scheme in ("s3", "s3a"):
        fs.retries = 1  # (s3fs's own loop, besides botocore's: ours, with backoff, while training)
    return fs, path


def problem(url: str, exc: BaseException, access: str = "read") -> str:
    """What went wrong reading (or, `access="write"`, writing) `url`, in one line that says what to do."""
    name, text = type(exc).__name__, " ".join(str(exc).split())
    bucket = url.split("://", 1)[1].split("/", 1)[0] if "://" in url else url
    if name in ("NoCredentialsError", "PartialCredentialsError") or "credentials" in text.lower():
        return (
            f"{url}: no credentials for it ({text[:120]}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or run where an instance role gives them (docs/data.md)"
        )
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        # (a HEAD request's 403 carries no code: a key the store does not know reads the same)
        return (
            f"{url}: access denied ({text[:80]}): give these credentials {access} access to it "
            f"({ACTIONS[access]}), or check they are the ones meant (AWS_ACCESS_KEY_ID, AWS_PROFILE)"
        )
    if "bucket does not exist" in text.lower() or "NoSuchBucket" in text:
        return (
            f"{url}: the bucket {bucket} does not exist: check its name, and AWS_ENDPOINT_URL for an "
            "S3-compatible store"
        )
    if isinstance(exc, FileNotFoundError):
        return f"{url} does not exist"
    return (
        f"{url}: the store did not answer ({name}: {text[:160]}): check the network, and AWS_ENDPOINT_URL "
        "for an S3-compatible store"
    )


def read_bytes(url: str) -> bytes:
    """The object at `url`, whole (a manifest, a tokenizer): one try (the client retries within
    it); any failure is one line."""
    fs, path = filesystem(url)
    try:
        return fs.cat_file(path)
    except Exception as exc:  # the filesystems raise their own kinds
        raise UserError(problem(url, exc)) from None


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    try:
        return fs.exists(path)
    except Exception as exc:
        raise UserError(problem(url, exc)) from None
