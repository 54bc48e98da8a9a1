"""Each rank's random number generators as JSON (rng_rank_NNNNN.json in a checkpoint), so a resumed
run draws what the uninterrupted one would have drawn."""

from __future__ import annotations

import base64
import json
import random

import numpy as np
import torch


def rng_file(rank: int) -> str:
    return f"rng_rank_{rank:05d}.json"


def capture() -> dict:
    """Python's, NumPy's, torch's (and CUDA's) generator states, as JSON-ready values."""
    state = {"python": random.getstate(), "numpy": _numpy_state(), "torch": _encode(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = _encode(torch.cuda.get_rng_state())
    return json.loads(json.dumps(state))


def restore(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_decode(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_decode(state["cuda"]))


def _encode(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _numpy_state() -> list:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return [kind, keys.tolist(), pos, has_gauss, cached]
