"""Parallelism and the engine: the DeepSpeed engine and its JSON (`engine`), the process group
and collectives (`distributed`), sequence parallelism (`sequence`), DeepSpeed's compiled ops."""
