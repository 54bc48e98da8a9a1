"""Optimizers and schedules: Muon through DeepSpeed's own (`muon`), learning-rate schedules."""
