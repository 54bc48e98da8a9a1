import pytest
import torch

from pretrain.config import ModelConfig


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def small_model_config(**overrides) -> ModelConfig:
    """A model small enough for unit tests (sequence lengths below 512 are fine for the model itself)."""
    fields = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, d_ff=48)
    fields.update(overrides)
    return ModelConfig(**fields)
