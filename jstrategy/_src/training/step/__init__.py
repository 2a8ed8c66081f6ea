"""The train step: its spec, the one body, the factory, and what acts inside it
(accumulation, remat, replica constraints, the numeric checks)."""
