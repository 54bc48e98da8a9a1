"""Measuring a model: held-out loss during pretraining (`held_out`), lm-evaluation-harness,
checkpoints and exports read without an engine (`inference`)."""
