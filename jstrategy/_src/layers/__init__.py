"""Keras 3's layers as Flax linen modules (`jstrategy.layers`), one concern a file."""
