"""DeepSpeed's compiled ops (pretrain/parallel/deepspeed_ops.py): the CPU shared-memory all-reduce is never
built, a build that does happen is said once and goes to this installation's own directory."""

from __future__ import annotations

import importlib
import sys

import pytest

from pretrain.parallel import deepspeed_ops


def test_a_process_group_neither_builds_nor_loads_the_shm_all_reduce():
    comm = importlib.import_module("deepspeed.comm.torch")
    build = comm.build_shm_op
    with deepspeed_ops.without_shm_all_reduce() as skipped:
        assert skipped
        assert comm.build_shm_op() is None  # what TorchBackend.__init__ calls as the group starts
    assert comm.build_shm_op is build  # DeepSpeed's own again


def test_another_deepspeed_layout_builds_it_as_before(monkeypatch):
    comm = importlib.import_module("deepspeed.comm.torch")
    monkeypatch.delattr(comm, "build_shm_op")
    with deepspeed_ops.without_shm_all_reduce() as skipped:
        assert not skipped


def test_each_python_environment_has_its_own_extensions_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(deepspeed_ops.EXTENSIONS_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "prefix", "/opt/venvs/one")
    one = deepspeed_ops.extensions_dir()
    monkeypatch.setattr(sys, "prefix", "/opt/venvs/two")
    two = deepspeed_ops.extensions_dir()
    assert one != two and one.parent == two.parent == tmp_path / "pretrain" / "torch_extensions"
    assert one.name.startswith("one-") and two.name.startswith("two-")
    monkeypatch.setenv(deepspeed_ops.EXTENSIONS_ENV, str(tmp_path / "mine"))
    assert deepspeed_ops.extensions_dir() == tmp_path / "mine"  # the user's choice stands


@pytest.fixture
def fake_builds(monkeypatch, tmp_path):
    """DeepSpeed's op builder with its JIT build replaced by one that writes the .so torch would."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    built = []

    def jit_load(builder, verbose=True):
        out = tmp_path / "ext" / builder.name  # where torch builds it, TORCH_EXTENSIONS_DIR set
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{builder.name}.so").write_bytes(b"")
        built.append(builder.name)
        return builder.name

    monkeypatch.setattr(OpBuilder, "jit_load", jit_load)
    monkeypatch.setenv(deepspeed_ops.EXTENSIONS_ENV, str(tmp_path / "ext"))
    return CPUAdamBuilder, built


def test_a_build_is_said_before_it_starts_and_only_the_first_time(fake_builds):
    builder, built = fake_builds
    said = []
    with deepspeed_ops.announced_builds(said.append):
        assert builder().jit_load() == "cpu_adam"
        assert builder().jit_load() == "cpu_adam"  # on disk now: loaded, nothing to say
    assert built == ["cpu_adam", "cpu_adam"]
    assert len(said) == 1 and said[0].startswith(
        "building DeepSpeed's cpu_adam op, once for this installation"
    )


def test_builds_go_to_this_installations_directory_unless_one_is_set(monkeypatch, tmp_path):
    monkeypatch.delenv(deepspeed_ops.EXTENSIONS_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    import os

    with deepspeed_ops.announced_builds(print):
        assert os.environ[deepspeed_ops.EXTENSIONS_ENV] == str(deepspeed_ops.extensions_dir())
