"""The unit tier: no process group and no subprocess; everything runs in this Python process."""

import pytest


@pytest.fixture(scope="package", autouse=True)
def _no_process_group_and_no_subprocess():
    """The tier's promise, kept: starting a subprocess, forking, or creating a process group fails
    (from the first unit test to the last: the package scope ends before the integration tier)."""
    import os
    import subprocess

    import torch.distributed

    def refuse(what):
        def refused(*args, **kwargs):
            raise AssertionError(f"the unit tier must not {what}; such tests belong in tests/integration")

        return refused

    patches = [
        (subprocess.Popen, "_execute_child", refuse("start a subprocess")),
        (os, "fork", refuse("fork")),
        (os, "posix_spawn", refuse("spawn a process")),
        (torch.distributed, "init_process_group", refuse("create a process group")),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    yield
    for owner, name, original in saved:
        setattr(owner, name, original)
