"""Keeping a run healthy inside the trainer: skipping a bad update in place (`skip_step`), the
instability precursors, replaying a rejected step (`replay`), comparing replicas (`replicas`),
and injected faults to prove the rest."""
