"""Llama-style decoder pretraining with DeepSpeed ZeRO, streaming token shards, and an
out-of-process monitor that rolls training back on loss or gradient spikes."""

__version__ = "0.1.0"
