"""From raw text to the batches each rank sees: sources, preparation, shards, the window stream.

    from pretrain.data import WindowStream, MixtureStream, BatchLoader, prepare_dataset, resolve_source

Names are imported on first use, so the tokenizer worker processes that `prepare` spawns do not
pay for torch.
"""

from typing import Any

_EXPORTS = {
    "WindowStream": "pretrain.data.stream",
    "MixtureStream": "pretrain.data.mixture",
    "BatchLoader": "pretrain.data.loader",
    "ShardSet": "pretrain.data.shards",
    "read_manifest": "pretrain.data.shards",
    "prepare_dataset": "pretrain.data.prepare",
    "prepare_corpus": "pretrain.data.prepare",
    "Source": "pretrain.data.sources",
    "resolve_source": "pretrain.data.sources",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pretrain.data' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
