"""DeepSpeed's compiled ops: the one this project never needs is not built, the ones it needs are
built once per installation, and a build is said while it happens.

DeepSpeed compiles some of its ops the first time a process asks for one (a JIT C++ or CUDA build
with ninja, into torch's extensions directory): on CPU the shared-memory all-reduce, as every
process group starts; on GPUs the fused Adam (and the CPU Adam when ZeRO offloads the optimizer).
A build takes a minute or more and printed nothing, so a first run sat silent before its first step.

- **The shared-memory all-reduce (CPU)** serves only `deepspeed.comm.inference_all_reduce`
  (tensor-parallel inference); training's collectives go through gloo either way. Building it cost
  70-80 s of CPU on a fresh machine (a 2-core Xeon; 1-2.5 minutes of a first launch), and a
  66 MB /dev/shm buffer per rank. `without_shm_all_reduce()` keeps `deepspeed.init_distributed`
  from building or loading it: the same collectives, bit for bit the same run.
- **Where builds go.** torch keys its build directory by Python, torch and CUDA version only, and
  a build records the absolute paths of DeepSpeed's sources: two virtual environments on one
  machine rebuilt each other's op at every launch. `announced_builds()` points
  `TORCH_EXTENSIONS_DIR` (unless set) at a directory of this installation's own, and prints one
  line as a build begins.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"


def extensions_dir() -> Path:
    """Where this installation's compiled ops live: `TORCH_EXTENSIONS_DIR` when set, else a
    directory under ~/.cache named for this Python environment (`sys.prefix`)."""
    if os.environ.get(EXTENSIONS_ENV):
        return Path(os.environ[EXTENSIONS_ENV])
    key = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "pretrain" / "torch_extensions" / f"{Path(sys.prefix).name}-{key}"


def _built(name: str, root: Path) -> bool:
    """Whether a build of op `name` is already on disk (torch then only checks and loads it): with
    TORCH_EXTENSIONS_DIR set, torch builds op NAME in ROOT/NAME/NAME.so."""
    return (root / name / f"{name}.so").is_file()


@contextlib.contextmanager
def announced_builds(say: Callable[[str], None]) -> Iterator[None]:
    """While open: DeepSpeed's JIT builds go to `extensions_dir()`, and `say` is told of each one
    before it starts (a second load of a built op says nothing). Another DeepSpeed layout: no
    announcement, the directory still applies."""
    os.environ.setdefault(EXTENSIONS_ENV, str(extensions_dir()))
    try:
        from deepspeed.ops.op_builder.builder import OpBuilder
    except ImportError:
        yield
        return
    jit_load = OpBuilder.jit_load

    def announcing(builder, *args, **kwargs):
        root = extensions_dir()
        if not _built(builder.name, root):
            say(
                f"building DeepSpeed's {builder.name} op, once for this installation (a minute or more) "
                f"in {root}"
            )
        return jit_load(builder, *args, **kwargs)

    OpBuilder.jit_load = announcing
    try:
        yield
    finally:
        OpBuilder.jit_load = jit_load


@contextlib.contextmanager
def without_shm_all_reduce() -> Iterator[bool]:
    """While open, a process group DeepSpeed starts neither builds nor loads its CPU shared-memory
    all-reduce (see the module docstring). Yields False where DeepSpeed's layout differs and it
    builds the op all the same."""
    try:
        comm = importlib.import_module("deepspeed.comm.torch")  # (not `import ... as`: that is torch)
    except ImportError:
        yield False
        return
    build = getattr(comm, "build_shm_op", None)
    if build is None:
        yield False
        return
    comm.build_shm_op = lambda: None
    try:
        yield True
    finally:
        comm.build_shm_op = build
