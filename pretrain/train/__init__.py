"""The one training loop (`loop.py`: `Trainer`, its `Task` and `Cadence`), for pretraining and
fine-tuning alike.

    python -m pretrain.train --config CFG [overrides...]     (`pretrain train`, under any launcher)

The package holds the loop and nothing of the command layer; `__main__.py` is the entry that
DeepSpeed's and other launchers run on every rank.
"""
