"""Distributed input, one job a module: options, rows, checks, placement, sources, per-replica
elements and the datasets (`datasets.py` says what each holds)."""
