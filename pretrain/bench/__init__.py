"""Benchmarks behind `pretrain bench ...`: each prints figures (and one JSON object with --json)."""
