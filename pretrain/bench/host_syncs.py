"""How often a training step makes the host wait for the device, counted from outside the code
that does it (ours, DeepSpeed's, torch's, Transformers'): `pretrain bench train`'s
`host_syncs_per_step`, and the tests that hold the step to one (docs/performance.md, "Host reads
in the step").

On CUDA, torch counts them itself: `torch.cuda.set_sync_debug_mode("warn")` warns at every
operation that synchronizes with the host (a read of a device value, a device-to-host copy, an
explicit synchronize), and each warning on the main thread is one.

On a CPU nothing waits, so what would wait on a GPU is counted instead: every read of a tensor's
value by the host (`item()`, `bool()`, `float()`, `int()`, `tolist()`, `numpy()`, `cpu()`, and
torch's ops that size their output by the data: `nonzero`, `masked_select`, `equal`), less the
reads of values the host made itself. A tensor is host-made when it was built from Python numbers
(`torch.tensor(x)`: torch's `lift_fresh`, `scalar_tensor`) or computed from host-made tensors only
— AdamW's step counter (torch keeps it on the host so that reading it waits for nothing), or the
gradient norm the norm gate hands DeepSpeed after reading it (pretrain/parallel/norm_gate.py). A
`TorchDispatchMode` follows that through every operation while a count is open, so a count must be
open when such values are made (AdamW makes its counter at its first step: count from the first
step). What the CPU count cannot see: a host-made value copied to the device
(`torch.tensor(x, device=cuda)`, as DeepSpeed's one-time ZeRO-3 trace check does) is a device
value on a GPU and host-made here; the CUDA count sees it.
"""

from __future__ import annotations

import sys
import threading
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

PYTHON_READS = ("tolist", "numpy", "cpu")  # reads that do not pass through torch's dispatcher on a CPU
# where a wait is not made but only seen: torch itself, this module, the warnings machinery
_NOT_CALLERS = (str(Path(torch.__file__).parent), str(Path(__file__)), warnings.__file__)


def _site() -> str:
    """The innermost caller outside torch and this module: `path:line (function)`."""
    caller = sys._getframe(2)
    while caller is not None and caller.f_code.co_filename.startswith(_NOT_CALLERS):
        caller = caller.f_back
    if caller is None:
        return "?"
    name = caller.f_code.co_filename.split("site-packages/")[-1]
    return f"{name}:{caller.f_lineno} ({caller.f_code.co_name})"


class HostSyncs:
    """Counts the host's waits per step while open: `new_step()` as each step begins (and
    `end_step()` where what follows is not the step's), then `steps` holds the call sites of each
    step's waits (`per_step()` their numbers)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.steps: list[list[str]] = []
        self.counting = False
        self._restore: list = []

    def new_step(self) -> None:
        self.steps.append([])
        self.counting = True

    def end_step(self) -> None:
        self.counting = False

    def per_step(self) -> list[int]:
        return [len(sites) for sites in self.steps]

    def record(self, site: str) -> None:
        if self.counting and threading.current_thread() is threading.main_thread():
            self.steps[-1].append(site)

    def __enter__(self) -> HostSyncs:
        if self.device.type == "cuda":
            self._watch_cuda()
        else:
            self._watch_cpu()
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()

    def _watch_cuda(self) -> None:
        catcher = warnings.catch_warnings()
        catcher.__enter__()
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message, category, *args, **kwargs):
            if "synchroniz" in str(message):
                self.record(_site())
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        self._restore += [
            lambda: catcher.__exit__(None, None, None),
            lambda: torch.cuda.set_sync_debug_mode(0),
        ]

    def _watch_cpu(self) -> None:
        mode = _HostValues(self)
        mode.__enter__()
        self._restore.append(lambda: mode.__exit__(None, None, None))
        for name in PYTHON_READS:
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, mode.reading(name, original))
            self._restore.append(lambda name=name, original=original: setattr(torch.Tensor, name, original))


# aten operations whose result the host must read (or size) on a device
_READS = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.equal.default",
}
# aten operations that make a tensor out of Python numbers
_FROM_HOST = {"aten.lift_fresh.default", "aten.lift_fresh_copy.default", "aten.scalar_tensor.default"}


class _HostValues(TorchDispatchMode):
    """Which tensors the host made (module docstring), and the reads of the others."""

    # (one registry for every count in the process: a value made while one was open stays known)
    host_made = WeakTensorKeyDictionary()

    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        made_by_host = name in _FROM_HOST or (bool(inputs) and all(t in self.host_made for t in inputs))
        if name in _READS and not made_by_host:
            self.syncs.record(_site())
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if made_by_host:
                    self.host_made[t] = True
                else:
                    self.host_made.pop(t, None)
        return out

    def reading(self, name: str, original):
        mode = self

        def read(tensor, *args, **kwargs):
            if tensor not in mode.host_made:
                mode.syncs.record(_site())
            return original(tensor, *args, **kwargs)

        read.__name__ = name
        return read
