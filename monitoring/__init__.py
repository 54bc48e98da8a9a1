"""The monitoring service: watches a training run's metrics from its own process and answers
each step with an action (`continue`, or `rollback` to a healthy checkpoint with a new data seed).

`monitoring.protocol` holds the messages both sides speak; the trainer imports nothing else
from this package.
"""
