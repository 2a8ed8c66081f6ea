"""Keras-like training: `Model`, losses, metrics, callbacks, progress bars and summaries."""
